"""Which files in a cache directory are ours: the only ones `dflash-extract --overwrite` may delete.

A file is ours when its name and its content both say dflash-extract wrote it:
  cache.json                  a JSON object with a format_version
  target_head.safetensors     a container whose header carries our format_version and checksum
  manifest.parquet            a Parquet file with the manifest's columns
  shards/ and quarantine/     b{8 digits}.safetensors whose header names that batch
  logs/extract-rank{r}.jsonl  the per-rank extraction logs
  the lock file, and atomic_write temporaries (.tmp-NAME.xxxxxxxx) of those names (and of
  check_writable's probe) at each level.
Damage does not make a file foreign: a container of ours cut short still starts with our header, an
empty shard holds nothing to lose, and in a directory that is recognisably our cache (a shard, head
or cache.json of ours in it) a damaged cache.json, head or manifest under its own name is ours too.
Anything else (another name, a folder, a link, a file of our name holding something else) is the
user's: its presence makes --overwrite refuse, and nothing here ever deletes it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow.parquet as pq

from shards.common.durable import PROBE, remove_stale_temporaries, temporary_final_name
from shards.common.json_input import InputFileError, read_json
from shards.common.lock import LOCK_FILE
from shards.container import read_header
from shards.format import CACHE_CONFIG_FILE, MANIFEST_FILE, SHARDS_DIR, TARGET_HEAD_FILE, CacheFormatError, batch_id_of
from shards.manifest import SCHEMA as MANIFEST_SCHEMA

QUARANTINE_DIR = "quarantine"
LOGS_DIR = "logs"
_LOG = re.compile(r"extract-rank\d+\.jsonl")
# How every header write_container writes begins, after its 8-byte length: the first metadata key.
_OUR_HEADER_START = b'{"__metadata__":{"format_version":"'


def _our_container(path: Path, batch_id: int | None = None) -> bool:
    """A safetensors file whose header we wrote (for a shard: naming `batch_id`); its data may be
    damaged, or the file cut short inside the header (then its first bytes decide)."""
    try:
        meta = read_header(path, check_size=False).metadata
    except CacheFormatError:
        try:
            with open(path, "rb") as f:
                return f.read(8 + len(_OUR_HEADER_START))[8:] == _OUR_HEADER_START
        except OSError:
            return False
    return (
        "format_version" in meta and "checksum" in meta and (batch_id is None or meta.get("batch_id") == str(batch_id))
    )


def _our_cache_config(path: Path) -> bool:
    try:
        record = read_json(path)
    except (OSError, InputFileError):
        return False
    return isinstance(record, dict) and "format_version" in record


def _our_manifest(path: Path) -> bool:
    try:
        return pq.read_schema(path).names == MANIFEST_SCHEMA.names
    except Exception:  # pyarrow raises several types for a file that is not Parquet
        return False


_TOP_FILES = {
    CACHE_CONFIG_FILE: _our_cache_config,
    TARGET_HEAD_FILE: _our_container,
    MANIFEST_FILE: _our_manifest,
    LOCK_FILE: lambda path: True,  # DirectoryLock's: its name is the only mark it has
}


def _plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def is_our_shard(path: str | Path) -> bool:
    """A file under shards/ or quarantine/ that dflash-extract wrote (or an empty one)."""
    path = Path(path)
    batch_id = batch_id_of(path)
    if batch_id is None or not _plain_file(path):
        return False
    return path.stat().st_size == 0 or _our_container(path, batch_id)


def _top_final(name: str) -> bool:
    return name in _TOP_FILES or name == PROBE


def _ours_in(sub: str, path: Path) -> bool:
    final = temporary_final_name(path)
    if sub in (SHARDS_DIR, QUARANTINE_DIR):
        return batch_id_of(final) is not None if final is not None else is_our_shard(path)
    return final is None and _LOG.fullmatch(path.name) is not None and _plain_file(path)


def _ours_at_top(path: Path, our_cache: bool) -> bool:
    final = temporary_final_name(path)
    if final is not None:
        return _top_final(final)
    check = _TOP_FILES.get(path.name)
    return check is not None and _plain_file(path) and (our_cache or check(path))


def _is_our_cache(cache_dir: Path) -> bool:
    """Recognisably a cache of ours: cache.json, the target head or one shard under shards/ says so."""
    if _our_cache_config(cache_dir / CACHE_CONFIG_FILE) or _our_container(cache_dir / TARGET_HEAD_FILE):
        return True
    shard_dir = cache_dir / SHARDS_DIR
    if not shard_dir.is_dir() or shard_dir.is_symlink():
        return False
    return any(batch_id_of(p) is not None and is_our_shard(p) and p.stat().st_size for p in shard_dir.iterdir())


def our_entries(cache_dir: str | Path) -> tuple[list[Path], list[Path]]:
    """(files of ours, entries that are not ours) under cache_dir; folders of ours are not listed."""
    cache_dir = Path(cache_dir)
    our_cache = _is_our_cache(cache_dir)
    ours, foreign = [], []
    for p in sorted(cache_dir.iterdir()):
        if p.name in (SHARDS_DIR, QUARANTINE_DIR, LOGS_DIR) and p.is_dir() and not p.is_symlink():
            for q in sorted(p.iterdir()):
                (ours if _ours_in(p.name, q) else foreign).append(q)
        else:
            (ours if _ours_at_top(p, our_cache) else foreign).append(p)
    return ours, foreign


def is_our_file(cache_dir: str | Path, path: str | Path) -> bool:
    """One top-level file of cache_dir (cache.json, the head, the manifest), judged as our_entries would."""
    return _ours_at_top(Path(path), _is_our_cache(Path(cache_dir)))


def remove_stale_cache_temporaries(cache_dir: str | Path) -> int:
    """Delete what killed writers of ours left half written: temporaries of our names at the top and
    under shards/ (never a user's `.tmp-notes.markdown`); returns how many."""
    cache_dir = Path(cache_dir)
    removed = len(remove_stale_temporaries(cache_dir, _top_final))
    shard_dir = cache_dir / SHARDS_DIR
    if shard_dir.is_dir():
        removed += len(remove_stale_temporaries(shard_dir, lambda final: batch_id_of(final) is not None))
    return removed


def foreign_entries(cache_dir: str | Path) -> list[Path]:
    return our_entries(cache_dir)[1]


def describe(paths: list[Path], limit: int = 5) -> str:
    shown = ", ".join(str(p) for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def remove_cache_files(cache_dir: str | Path) -> int:
    """Delete our files in cache_dir (never the lock, never anything else); returns how many.

    Refuses (ValueError) when anything else is there, before deleting anything. cache.json goes first,
    so a deletion cut short leaves a directory that is visibly not a complete cache.
    """
    cache_dir = Path(cache_dir)
    ours, foreign = our_entries(cache_dir)
    if foreign:
        raise ValueError(
            f"{cache_dir} holds files dflash-extract did not write ({describe(foreign)}); "
            "nothing was deleted: move them away or choose another --out"
        )
    ours = [p for p in ours if p.name != LOCK_FILE]
    ours.sort(key=lambda p: p.name != CACHE_CONFIG_FILE)
    for p in ours:
        p.unlink()
    for sub in (SHARDS_DIR, QUARANTINE_DIR, LOGS_DIR):
        d = cache_dir / sub
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    return len(ours)


def nested(a: str | Path, b: str | Path) -> bool:
    """a and b are the same directory or one lies inside the other (symlinks resolved)."""
    ra, rb = Path(os.path.realpath(a)), Path(os.path.realpath(b))
    return ra == rb or ra in rb.parents or rb in ra.parents
