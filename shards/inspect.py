"""Whole-cache questions: a summary, a full verification, one sample's data."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shards.codec import decode_context
from shards.common.chat_mode import describe_mode
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
from shards.manifest import header_rows, manifest_table, pieced_samples, read_manifest
from shards.ownership import QUARANTINE_DIR, is_our_shard
from shards.projection import load_projection
from shards.reader import ShardError, ShardInfo, ShardReader, load_target_head

_NEAREST_IDS = 5  # sample ids `show` proposes for one that is not in the cache


def expected_batch_ids(reader: ShardReader) -> list[int] | None:
    """The batch ids the extraction planned (recorded in cache.json), when known."""
    n = reader.config.planned_batches
    return list(range(n)) if isinstance(n, int) else None


def summarize_cache(cache_dir: str | Path) -> dict:
    """Config, counts, tokens, padding efficiency and bytes on disk, from headers only. A long sample
    stored as pieces counts as one sample (num_long_samples, in num_pieces shards); tokens and supervised
    tokens are those stored, a piece's context and label overlap counted in each piece holding it."""
    reader = ShardReader(cache_dir)
    cfg = reader.config
    infos, bad = [], []
    for b in reader.batch_ids():
        try:
            infos.append(reader.info(b))
        except ShardError as e:
            bad.append({"batch_id": b, "reason": e.reason})
    real = sum(i.num_tokens for i in infos)
    pieced = pieced_samples((s.sample_id, i.batch_id) for i in infos for s in i.samples)
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
        "num_samples": sum(len(i.samples) for i in infos) - sum(len(b) - 1 for b in pieced.values()),
        "num_long_samples": len(pieced),  # samples stored as pieces, each counted once in num_samples
        "num_pieces": sum(len(b) for b in pieced.values()),
        "num_tokens": real,
        "num_loss_tokens": sum(s.loss_tokens for i in infos for s in i.samples),
        "padding_efficiency": real / (len(infos) * cfg.token_budget) if infos else 0.0,
        "bytes_on_disk": disk,
        "num_quarantined": len(held),
        "bytes_quarantined": sum(p.stat().st_size for p in held),
        "bytes_per_token": bytes_per_shard(cfg) / cfg.token_budget,
        "dataset": dataclasses.asdict(cfg.dataset) if cfg.dataset is not None else None,
        "modes": _mode_counts(cfg, infos),
    }


def _mode_counts(cfg, infos: list[ShardInfo]) -> list[dict]:
    """Per serving mode of cache.json (CacheConfig.modes): its record, description, samples (a long
    sample once), tokens and supervised tokens stored (as num_tokens counts them)."""
    counts = [
        {"mode": m, "described": describe_mode(m), "num_samples": 0, "num_tokens": 0, "num_loss_tokens": 0}
        for m in cfg.modes
    ]
    seen: set[str] = set()
    for s in (s for i in infos for s in i.samples):
        c = counts[s.mode]
        c["num_samples"] += s.sample_id not in seen
        c["num_tokens"] += s.length
        c["num_loss_tokens"] += s.loss_tokens
        seen.add(s.sample_id)
    return counts


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
    codes, as one "tap" named "codes"). A long sample stored as pieces is read whole: each position from
    the own part of the piece that holds it (never from a context overlap), "pieces" listing them.

    position: also the target's stored top-k next tokens at this position of the sample (0-based, the
    sample's absolute position), with the data's own next token and its rank among them. Raises
    ValueError when the cache stores no top-k or the position is outside the sample.
    """
    reader = ShardReader(cache_dir)
    if position is not None and reader.config.target_topk == 0:
        raise ValueError(
            f"{cache_dir} stores no target top-k (extracted with --target-topk 0); "
            "re-extract with --target-topk K to have it"
        )
    batch_ids = _locate(cache_dir, reader, sample_id)
    parts = [_own_part(reader, b, sample_id, position, piece=len(batch_ids) > 1) for b in batch_ids]
    _check_tiling(parts, sample_id, cache_dir)
    length = parts[-1].end
    input_ids = [t for part in parts for t in part.input_ids]
    loss_mask = [m for part in parts for m in part.loss_mask]
    layers = reader.config.tap_layer_ids if reader.config.projection is None else ["codes"]
    out = {
        "sample_id": sample_id,
        "batch_id": batch_ids[0],
        "offset": parts[0].row if len(parts) == 1 else None,
        "length": length,
        "loss_tokens": sum(loss_mask),
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "hidden": [_tap_stats(layer, [part.moments[j] for part in parts]) for j, layer in enumerate(layers)],
        "pieces": [part.describe() for part in parts] if len(parts) > 1 else None,
    }
    if position is not None:
        if not 0 <= position < length:
            raise ValueError(f"--position {position} is outside sample {sample_id!r} (positions 0..{length - 1})")
        topk = next(part.topk for part in parts if part.start <= position < part.end)
        # The stored distribution at position p is the target's prediction of the token at p + 1.
        next_id = input_ids[position + 1] if position + 1 < length else None
        out["target_topk"] = {
            "position": position,
            "batch_id": topk["batch_id"],
            "token_id": input_ids[position],
            "next_token_id": next_id,
            "next_token_rank": topk["ids"].index(next_id) + 1 if next_id in topk["ids"] else None,
            "ids": topk["ids"],
            "logprobs": topk["logprobs"],
        }
    return out


@dataclass
class _OwnPart:
    """What one shard holds of a sample at the sample's positions [start, end): the whole sample, or a
    piece's own part (anchor_mask), with per-tap moments of its hidden states and the top-k at the
    asked position when it falls here."""

    batch_id: int
    row: int  # the shard row of position `start`
    start: int
    end: int
    input_ids: list[int]
    loss_mask: list[int]
    moments: list[dict]  # per tap: n, sum, sum of squares, absmax, finite (float64)
    topk: dict | None

    def describe(self) -> dict:
        return {"batch_id": self.batch_id, "own_start": self.start, "own_end": self.end}


def _own_part(reader: ShardReader, batch_id: int, sample_id: str, position: int | None, piece: bool) -> _OwnPart:
    tensors, info = reader.read(batch_id, verify_checksum=True)
    entry = next(s for s in info.samples if s.sample_id == sample_id)
    row, n, start = entry.offset, entry.length, 0
    if piece:  # its own part, one run of rows marked by anchor_mask, at the sample's absolute positions
        own = torch.nonzero(tensors["anchor_mask"][row : row + n]).flatten()
        row, n = row + int(own[0]), len(own)
        start = int(tensors["position_ids"][row])
    span = slice(row, row + n)
    hidden = decode_context(tensors, reader.config)[span].float()  # [n, K, H]: float64 one tap at a time
    topk = None
    if position is not None and start <= position < start + n:
        at = row + position - start
        topk = {
            "batch_id": batch_id,
            "ids": tensors["target_topk_ids"][at].tolist(),
            "logprobs": tensors["target_topk_logprobs"][at].float().tolist(),
        }
    return _OwnPart(
        batch_id=batch_id,
        row=row,
        start=start,
        end=start + n,
        input_ids=tensors["input_ids"][span].tolist(),
        loss_mask=tensors["loss_mask"][span].tolist(),
        moments=[_moments(hidden[:, j].double()) for j in range(hidden.shape[1])],
        topk=topk,
    )


def _moments(h: torch.Tensor) -> dict:
    return {
        "n": h.numel(),
        "sum": h.sum().item(),
        "sumsq": h.pow(2).sum().item(),
        "absmax": h.abs().max().item(),
        "finite": bool(torch.isfinite(h).all()),
    }


def _tap_stats(layer, moments: list[dict]) -> dict:
    """One tap's mean, std (unbiased), rms, absmax and finiteness over every part of a sample."""
    n = sum(m["n"] for m in moments)
    total, squares = sum(m["sum"] for m in moments), sum(m["sumsq"] for m in moments)
    mean = total / n
    return {
        "layer": layer,
        "mean": mean,
        "std": math.sqrt(max(squares - n * mean * mean, 0.0) / (n - 1)) if n > 1 else 0.0,
        "rms": math.sqrt(squares / n),
        "absmax": max(m["absmax"] for m in moments),
        "finite": all(m["finite"] for m in moments),
    }


def _check_tiling(parts: list[_OwnPart], sample_id: str, cache_dir: str | Path) -> None:
    """A sample's parts must cover its positions 0..length-1 once, in order (a piece missing from the
    manifest, or one that is not this sample's, would shift every position after it)."""
    expected = 0
    for part in parts:
        if part.start != expected:
            raise ValueError(
                f"sample {sample_id!r}: its shard {part.batch_id} holds positions {part.start}..{part.end - 1}, "
                f"expected to start at {expected}; check the cache with `dflash-shards verify {cache_dir}`"
            )
        expected = part.end


def _locate(cache_dir: str | Path, reader: ShardReader, sample_id: str) -> list[int]:
    """The batch ids holding the sample (a long sample's pieces, in order): the manifest's, else the
    shard headers'."""
    try:
        table = read_manifest(cache_dir)
        rows = zip(table.column("sample_id").to_pylist(), table.column("batch_id").to_pylist())
        found = sorted(b for s, b in rows if s == sample_id)
        if found:
            return found
    except CacheFormatError:
        pass  # no usable manifest: fall back to the shard headers
    rows = list(header_rows(reader))
    found = sorted(b for s, b in rows if s == sample_id)
    if found:
        return found
    known = list(dict.fromkeys(s for s, _ in rows))  # a long sample's id once, not once per piece
    # The nearest ids by spelling: `chats:17` finds `chat-17` (the derived `file:row` form vs the data's ids).
    near = difflib.get_close_matches(sample_id, known, n=_NEAREST_IDS, cutoff=0.5)
    hint = f"; nearest ids: {', '.join(near)}" if near else ""
    raise KeyError(
        f"sample {sample_id!r} is not in {cache_dir}{hint} (`dflash-shards ls {cache_dir} --samples` lists all "
        f"{len(known)})"
    )
