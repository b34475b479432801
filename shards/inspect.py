"""Whole-cache questions: a summary, a full verification, one sample's data."""

from __future__ import annotations

import dataclasses
import difflib
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shards.codec import decode_context
from shards.common.owned import Dir
from shards.format import (
    MANIFEST_FILE,
    PROJECTION_FILE,
    SHARDS_DIR,
    TARGET_HEAD_FILE,
    CacheFormatError,
    bytes_per_shard,
    shard_path,
)
from shards.manifest import manifest_table, read_manifest
from shards.ownership import QUARANTINE_DIR, is_our_shard
from shards.projection import load_projection
from shards.reader import ShardError, ShardInfo, ShardReader, load_target_head

_NEAREST_IDS = 5  # sample ids `show` proposes for one that is not in the cache


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
    # Quarantined shards are no part of the cache (verify --quarantine moved them out): counted apart.
    quarantine = Path(cache_dir) / QUARANTINE_DIR
    files = [p for p in Path(cache_dir).rglob("*") if p.is_file()]
    held = [p for p in files if quarantine in p.parents]
    disk = sum(p.stat().st_size for p in files) - sum(p.stat().st_size for p in held)
    expected = expected_batch_ids(reader)
    return {
        "cache": str(cache_dir),
        "format_version": cfg.format_version,
        "target": cfg.target.name,
        "hidden_size": cfg.target.hidden_size,
        "target_dtype": cfg.target.dtype,
        "target_compute": cfg.target.compute,
        "target_quantization": cfg.target.quantization,
        "tap_layer_ids": cfg.tap_layer_ids,
        "storage_dtype": cfg.storage_dtype,
        "projection": dataclasses.asdict(cfg.projection) if cfg.projection is not None else None,
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
        "num_quarantined": len(held),
        "bytes_quarantined": sum(p.stat().st_size for p in held),
        "bytes_per_token": bytes_per_shard(cfg) / cfg.token_budget,
        "dataset": dataclasses.asdict(cfg.dataset) if cfg.dataset is not None else None,
    }


@dataclass
class VerifyReport:
    cache_dir: str = ""
    checked: int = 0
    bad: list[dict] = field(default_factory=list)  # {"file", "batch_id", "reason"}
    quarantined: list[str] = field(default_factory=list)
    extract_command: str | None = None  # the command that made the cache, from cache.json's provenance

    @property
    def ok(self) -> bool:
        return not self.bad

    def remedy(self) -> str | None:
        """The one next action that repairs everything reported (None when all is good)."""
        if self.ok:
            return None
        if any(b["file"].endswith(PROJECTION_FILE) for b in self.bad):  # the codes were made with it
            return (
                f"restore the original {PROJECTION_FILE} (every shard's codes were made with it), or re-extract "
                "the cache into a new --out"
            )
        head = [b for b in self.bad if b["batch_id"] is None and b["file"].endswith(TARGET_HEAD_FILE)]
        shards = [b for b in self.bad if b["batch_id"] is not None]
        in_place = [b for b in shards if b["reason"] != "missing" and "moved_to" not in b]
        rerun = (
            "re-run the dflash-extract command that made this cache: it extracts the missing shards"
            + (", writes the target head again" if head else "")
            + " and rewrites the manifest"
        )
        if self.extract_command:
            rerun += f" (as cache.json records it, less --overwrite and --fast-resume: {resume_command(self.extract_command)})"
        if shards and all("belongs to another cache" in b["reason"] for b in shards) and self.checked == len(shards):
            return (
                "every shard names another cache than cache.json does: cache.json was edited or replaced; "
                "restore the original (the shards themselves are intact)"
            )
        if in_place:
            return f"move the bad shards aside with `dflash-shards verify {self.cache_dir} --quarantine`, then " + rerun
        if shards or head:  # a resume writes a missing or damaged target head again
            return rerun
        return f"rebuild the manifest from the shards with `dflash-shards index {self.cache_dir}`"


# Flags of the recorded command that a repair must not repeat: --overwrite deletes the finished shards,
# --fast-resume trusts them without reading them.
NOT_FOR_REPAIR = ("--overwrite", "--fast-resume")


def resume_command(command: str) -> str:
    """The recorded dflash-extract command without the NOT_FOR_REPAIR flags (shell words kept as quoted)."""
    try:
        words = shlex.split(command)
    except ValueError:  # not shell syntax after all: drop the flags word by word
        return " ".join(w for w in command.split() if w not in NOT_FOR_REPAIR)
    return shlex.join([w for w in words if w not in NOT_FOR_REPAIR])


def verify_cache(cache_dir: str | Path, quarantine: bool = False) -> VerifyReport:
    """Read every byte of every shard: header, shapes, checksum, packing; then the manifest.

    quarantine: move each bad shard into CACHE/quarantine/ so that a resumed extraction rewrites it.
    """
    cache_dir = Path(cache_dir)
    reader = ShardReader(cache_dir)
    report = VerifyReport(
        cache_dir=str(cache_dir), extract_command=_extract_command(reader.config.provenance, cache_dir)
    )
    try:
        load_target_head(cache_dir)
    except CacheFormatError as e:
        report.bad.append({"file": str(cache_dir / "target_head.safetensors"), "batch_id": None, "reason": str(e)})
    if reader.config.projection is not None:
        try:
            load_projection(cache_dir, reader.config)
        except CacheFormatError as e:
            report.bad.append({"file": str(cache_dir / PROJECTION_FILE), "batch_id": None, "reason": str(e)})
    present = reader.batch_ids()
    good: list[ShardInfo] = []
    for b in present:
        report.checked += 1
        try:
            good.append(reader.verify(b))
        except ShardError as e:
            report.bad.append({"file": str(e.path), "batch_id": b, "reason": e.reason})
            if quarantine:
                moved = _quarantine(cache_dir, e.path)
                if moved is None:
                    report.bad[-1]["reason"] += (
                        f"; not quarantined: {cache_dir / QUARANTINE_DIR / e.path.name} is a file dflash-extract "
                        "did not write (move it away and run again)"
                    )
                else:
                    report.bad[-1]["moved_to"] = str(moved)
                    report.quarantined.append(str(moved))
    expected = expected_batch_ids(reader)
    if expected is None:  # no recorded plan (a cache not made by dflash-extract): what the manifest lists
        expected = _manifest_batch_ids(cache_dir)
    missing = sorted(set(expected) - set(present)) if expected is not None else []
    for b in missing:
        report.bad.append({"file": str(shard_path(cache_dir, b)), "batch_id": b, "reason": "missing"})
    # With shards bad or missing the manifest is compared only for readability: the extraction that
    # redoes them rewrites it, so "out of date" would only suggest a second, useless remedy.
    manifest_problem = _check_manifest(cache_dir, good, len(good) == len(present) and not missing)
    if manifest_problem:
        report.bad.append({"file": str(cache_dir / MANIFEST_FILE), "batch_id": None, "reason": manifest_problem})
    return report


def _check_manifest(cache_dir: Path, good: list[ShardInfo], all_good: bool) -> str | None:
    try:
        table = read_manifest(cache_dir)
    except CacheFormatError as e:  # the reason only: the remedy is the report's one remedy line
        return str(e).split(": ", 1)[-1].split("; rebuild it", 1)[0]
    if all_good and not table.equals(manifest_table(good)):
        return "out of date with the shards"
    return None


def _manifest_batch_ids(cache_dir: Path) -> list[int] | None:
    try:
        return sorted(set(read_manifest(cache_dir).column("batch_id").to_pylist()))
    except CacheFormatError:
        return None


_PATH_FLAGS = ("--target", "--data")


def _extract_command(provenance: dict | None, cache_dir: str | Path | None = None) -> str | None:
    """The dflash-extract command line recorded in cache.json, as a user would type it. With cache_dir:
    runnable from anywhere for the cache where it is now (a copied or moved one too): --out names
    cache_dir, and relative --target / --data are made absolute against the recorded working directory."""
    provenance = provenance or {}
    argv = provenance.get("argv")
    # dflash-extract itself, or extract/cli.py under torchrun; anything else (a test, a script) is no command.
    if not argv or Path(argv[0]).name not in ("dflash-extract", "cli.py"):
        return None
    words = list(argv[1:])
    if cache_dir is not None:
        words = _portable(words, os.path.abspath(cache_dir), provenance.get("cwd"))
    return shlex.join(["dflash-extract", *words])


def _portable(words: list[str], cache_dir: str, cwd: str | None) -> list[str]:
    """`words` with --out naming cache_dir and relative --target / --data made absolute against cwd,
    in both spellings (`--out DIR` and `--out=DIR`)."""

    def fixed(flag: str, value: str) -> str:
        if flag == "--out":
            return cache_dir
        return os.path.join(cwd, value) if cwd and not os.path.isabs(value) else value

    out = list(words)
    for i, word in enumerate(words):
        flag, eq, value = word.partition("=")
        if flag not in ("--out", *_PATH_FLAGS):
            continue
        if eq:
            out[i] = f"{flag}={fixed(flag, value)}"
        elif i + 1 < len(words):
            out[i + 1] = fixed(flag, words[i + 1])
    return out


def _quarantine(cache_dir: Path, path: Path) -> Path | None:
    """Move a bad shard to quarantine/ (replacing only an earlier quarantined copy of ours); None, and
    nothing moved, when a file there under its name is not ours."""
    with Dir.opened(cache_dir, SHARDS_DIR) as shards, Dir.opened(cache_dir, QUARANTINE_DIR, create=True) as held:
        if held.lstat(path.name) is not None and not is_our_shard(held, path.name):
            return None
        shards.replace(path.name, held, path.name)  # the entry itself moves: a link is never followed
        held.fsync()
        shards.fsync()
    return cache_dir / QUARANTINE_DIR / path.name


def find_sample(cache_dir: str | Path, sample_id: str, position: int | None = None) -> dict:
    """A sample's tokens, loss mask and per-tap hidden-state statistics (of a projected cache: of its
    codes, as one "tap" named "codes").

    position: also the target's stored top-k next tokens at this position of the sample (0-based),
    with the data's own next token and its rank among them. Raises ValueError when the cache stores
    no top-k or the position is outside the sample.
    """
    reader = ShardReader(cache_dir)
    batch_id = _locate(cache_dir, reader, sample_id)
    tensors, info = reader.read(batch_id, verify_checksum=True)
    entry = next(s for s in info.samples if s.sample_id == sample_id)
    span = slice(entry.offset, entry.offset + entry.length)
    hidden = decode_context(tensors, reader.config)[span].float()
    layers = reader.config.tap_layer_ids if reader.config.projection is None else ["codes"]
    taps = []
    for j, layer in enumerate(layers):
        h = hidden[:, j]
        taps.append(
            {
                "layer": layer,
                "mean": h.mean().item(),
                "std": h.std().item() if h.numel() > 1 else 0.0,
                "rms": h.pow(2).mean().sqrt().item(),
                "absmax": h.abs().max().item(),
                "finite": bool(torch.isfinite(h).all()),
            }
        )
    out = {
        "sample_id": sample_id,
        "batch_id": batch_id,
        "offset": entry.offset,
        "length": entry.length,
        "loss_tokens": entry.loss_tokens,
        "input_ids": tensors["input_ids"][span].tolist(),
        "loss_mask": tensors["loss_mask"][span].tolist(),
        "hidden": taps,
    }
    if position is not None:
        out["target_topk"] = _topk_at(tensors, reader.config.target_topk, entry, position, cache_dir)
    return out


def _topk_at(tensors: dict, k: int, entry, position: int, cache_dir) -> dict:
    if k == 0:
        raise ValueError(
            f"{cache_dir} stores no target top-k (extracted with --target-topk 0); "
            "re-extract with --target-topk K to have it"
        )
    if not 0 <= position < entry.length:
        raise ValueError(
            f"--position {position} is outside sample {entry.sample_id!r} (positions 0..{entry.length - 1})"
        )
    row = entry.offset + position
    ids = tensors["target_topk_ids"][row].tolist()
    logprobs = tensors["target_topk_logprobs"][row].float().tolist()
    # The stored distribution at position p is the target's prediction of the token at p + 1.
    next_id = int(tensors["input_ids"][row + 1]) if position + 1 < entry.length else None
    return {
        "position": position,
        "token_id": int(tensors["input_ids"][row]),
        "next_token_id": next_id,
        "next_token_rank": ids.index(next_id) + 1 if next_id in ids else None,
        "ids": ids,
        "logprobs": logprobs,
    }


def _locate(cache_dir: str | Path, reader: ShardReader, sample_id: str) -> int:
    try:
        table = read_manifest(cache_dir)
        ids = table.column("sample_id").to_pylist()
        if sample_id in ids:
            return int(table.column("batch_id")[ids.index(sample_id)].as_py())
    except CacheFormatError:
        pass  # no usable manifest: fall back to the shard headers
    known: list[str] = []
    for b in reader.batch_ids():
        entries = reader.info(b).samples
        if any(s.sample_id == sample_id for s in entries):
            return b
        known += [s.sample_id for s in entries]
    # The nearest ids by spelling: `chats:17` finds `chat-17` (the derived `file:row` form vs the data's ids).
    near = difflib.get_close_matches(sample_id, known, n=_NEAREST_IDS, cutoff=0.5)
    hint = f"; nearest ids: {', '.join(near)}" if near else ""
    raise KeyError(
        f"sample {sample_id!r} is not in {cache_dir}{hint} (`dflash-shards ls {cache_dir} --samples` lists all "
        f"{len(known)})"
    )
