"""Whole-cache questions: a summary, a full verification, one sample's data."""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .codec import decode_hidden
from .format import MANIFEST_FILE, CacheFormatError, bytes_per_shard, shard_path
from .manifest import manifest_table, read_manifest
from .reader import ShardError, ShardInfo, ShardReader, load_target_head

QUARANTINE_DIR = "quarantine"


def expected_batch_ids(reader: ShardReader) -> list[int] | None:
    """The batch ids the extraction planned (recorded in cache.json), when known."""
    n = reader.config.planned_batches
    return list(range(n)) if isinstance(n, int) else None


def summarize_cache(cache_dir: str | Path) -> dict:
    """Config, counts, tokens, padding efficiency and bytes on disk, from headers only."""
    reader = ShardReader(cache_dir)
    cfg = reader.config
    infos, bad = [], []
    for b in reader.batch_ids():
        try:
            infos.append(reader.info(b))
        except ShardError as e:
            bad.append({"batch_id": b, "reason": e.reason})
    real = sum(i.num_tokens for i in infos)
    disk = sum(p.stat().st_size for p in Path(cache_dir).rglob("*") if p.is_file())
    expected = expected_batch_ids(reader)
    return {
        "cache": str(cache_dir),
        "format_version": cfg.format_version,
        "target": cfg.target.name,
        "hidden_size": cfg.target.hidden_size,
        "tap_layer_ids": cfg.tap_layer_ids,
        "storage_dtype": cfg.storage_dtype,
        "target_topk": cfg.target_topk,
        "token_budget": cfg.token_budget,
        "max_seqs": cfg.max_seqs,
        "num_shards": len(infos),
        "num_shards_expected": len(expected) if expected is not None else None,
        "num_bad_shard_headers": len(bad),
        "num_samples": sum(len(i.samples) for i in infos),
        "num_tokens": real,
        "num_loss_tokens": sum(s.loss_tokens for i in infos for s in i.samples),
        "padding_efficiency": real / (len(infos) * cfg.token_budget) if infos else 0.0,
        "bytes_on_disk": disk,
        "bytes_per_token": bytes_per_shard(cfg) / cfg.token_budget,
        "dataset": dataclasses.asdict(cfg.dataset) if cfg.dataset is not None else None,
    }


@dataclass
class VerifyReport:
    checked: int = 0
    bad: list[dict] = field(default_factory=list)  # {"file", "batch_id", "reason"}
    quarantined: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad


def verify_cache(cache_dir: str | Path, quarantine: bool = False) -> VerifyReport:
    """Read every byte of every shard: header, shapes, checksum, packing; then the manifest.

    quarantine: move each bad shard into CACHE/quarantine/ so that a resumed extraction rewrites it.
    """
    cache_dir = Path(cache_dir)
    report = VerifyReport()
    reader = ShardReader(cache_dir)
    try:
        load_target_head(cache_dir)
    except CacheFormatError as e:
        report.bad.append({"file": str(cache_dir / "target_head.safetensors"), "batch_id": None, "reason": str(e)})
    present = reader.batch_ids()
    good: list[ShardInfo] = []
    for b in present:
        report.checked += 1
        try:
            good.append(reader.verify(b))
        except ShardError as e:
            report.bad.append({"file": str(e.path), "batch_id": b, "reason": e.reason})
            if quarantine:
                report.quarantined.append(str(_quarantine(cache_dir, e.path)))
    expected = expected_batch_ids(reader)
    if expected is not None:
        for b in sorted(set(expected) - set(present)):
            report.bad.append({"file": str(shard_path(cache_dir, b)), "batch_id": b, "reason": "missing"})
    manifest_problem = _check_manifest(cache_dir, good, len(good) == len(present))
    if manifest_problem:
        report.bad.append({"file": str(cache_dir / MANIFEST_FILE), "batch_id": None, "reason": manifest_problem})
    return report


def _check_manifest(cache_dir: Path, good: list[ShardInfo], all_good: bool) -> str | None:
    try:
        table = read_manifest(cache_dir)
    except CacheFormatError as e:
        return str(e).split(": ", 1)[-1]
    if all_good and not table.equals(manifest_table(good)):
        return f"out of date with the shards; rebuild it with `dflash-shards index {cache_dir}`"
    return None


def _quarantine(cache_dir: Path, path: Path) -> Path:
    dest_dir = cache_dir / QUARANTINE_DIR
    dest_dir.mkdir(exist_ok=True)
    dest = dest_dir / path.name
    shutil.move(str(path), dest)
    return dest


def find_sample(cache_dir: str | Path, sample_id: str) -> dict:
    """A sample's tokens, loss mask and per-tap hidden-state statistics."""
    reader = ShardReader(cache_dir)
    batch_id = _locate(cache_dir, reader, sample_id)
    tensors, info = reader.read(batch_id, verify_checksum=True)
    entry = next(s for s in info.samples if s.sample_id == sample_id)
    span = slice(entry.offset, entry.offset + entry.length)
    scale = tensors["hidden_scale"][span] if "hidden_scale" in tensors else None
    hidden = decode_hidden(tensors["hidden"][span], scale).float()
    taps = []
    for j, layer in enumerate(reader.config.tap_layer_ids):
        h = hidden[:, j]
        taps.append({
            "layer": layer, "mean": h.mean().item(), "std": h.std().item() if h.numel() > 1 else 0.0,
            "rms": h.pow(2).mean().sqrt().item(), "absmax": h.abs().max().item(),
            "finite": bool(torch.isfinite(h).all()),
        })
    return {
        "sample_id": sample_id, "batch_id": batch_id, "offset": entry.offset, "length": entry.length,
        "loss_tokens": entry.loss_tokens,
        "input_ids": tensors["input_ids"][span].tolist(), "loss_mask": tensors["loss_mask"][span].tolist(),
        "hidden": taps,
    }


def _locate(cache_dir: str | Path, reader: ShardReader, sample_id: str) -> int:
    try:
        table = read_manifest(cache_dir)
        ids = table.column("sample_id").to_pylist()
        if sample_id in ids:
            return int(table.column("batch_id")[ids.index(sample_id)].as_py())
    except CacheFormatError:
        pass  # no usable manifest: fall back to the shard headers
    for b in reader.batch_ids():
        if any(s.sample_id == sample_id for s in reader.info(b).samples):
            return b
    raise KeyError(f"sample {sample_id!r} is not in {cache_dir}")
