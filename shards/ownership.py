"""Which files in a cache directory are ours: the only ones `dflash-extract --overwrite` may delete.

A file is ours when its name and its content both say dflash-extract wrote it:
  cache.json                  a JSON object with a format_version
  target_head.safetensors     a container whose header carries our format_version and checksum
  manifest.parquet            a Parquet file with the manifest's columns
  shards/ and quarantine/     b{8 digits}.safetensors whose header names that batch (or an empty file:
                              nothing in it to lose; resume writes it again)
  logs/extract-rank{r}.jsonl  the per-rank extraction logs
  the lock file, and atomic_write temporaries (.tmp-NAME.xxxxxxxx) of those names at each level.
Anything else (another name, a folder, a link, a file of our name holding something else) is the
user's: its presence makes --overwrite refuse, and nothing here ever deletes it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow.parquet as pq

from .container import read_header
from .durable import temporary_final_name
from .format import CACHE_CONFIG_FILE, MANIFEST_FILE, SHARDS_DIR, TARGET_HEAD_FILE, CacheFormatError, batch_id_of
from .lock import LOCK_FILE
from .manifest import SCHEMA as MANIFEST_SCHEMA

QUARANTINE_DIR = "quarantine"
LOGS_DIR = "logs"
_LOG = re.compile(r"extract-rank\d+\.jsonl")


def _our_container(path: Path, batch_id: int | None = None) -> bool:
    """A safetensors file whose header we wrote (for a shard: naming `batch_id`); its data may be damaged."""
    try:
        meta = read_header(path, check_size=False).metadata
    except CacheFormatError:
        return False
    return (
        "format_version" in meta and "checksum" in meta and (batch_id is None or meta.get("batch_id") == str(batch_id))
    )


def _our_cache_config(path: Path) -> bool:
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
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


def is_our_shard(path: str | Path) -> bool:
    """A file under shards/ or quarantine/ that dflash-extract wrote (or an empty one)."""
    path = Path(path)
    batch_id = batch_id_of(path)
    if batch_id is None or path.is_symlink() or not path.is_file():
        return False
    return path.stat().st_size == 0 or _our_container(path, batch_id)


def _ours_in(sub: str, path: Path) -> bool:
    final = temporary_final_name(path)
    if sub in (SHARDS_DIR, QUARANTINE_DIR):
        return batch_id_of(final) is not None if final is not None else is_our_shard(path)
    return final is None and _LOG.fullmatch(path.name) is not None and path.is_file() and not path.is_symlink()


def _ours_at_top(path: Path) -> bool:
    final = temporary_final_name(path)
    if final is not None:
        return final in _TOP_FILES
    check = _TOP_FILES.get(path.name)
    return check is not None and path.is_file() and not path.is_symlink() and check(path)


def our_entries(cache_dir: str | Path) -> tuple[list[Path], list[Path]]:
    """(files of ours, entries that are not ours) under cache_dir; folders of ours are not listed."""
    cache_dir = Path(cache_dir)
    ours, foreign = [], []
    for p in sorted(cache_dir.iterdir()):
        if p.name in (SHARDS_DIR, QUARANTINE_DIR, LOGS_DIR) and p.is_dir() and not p.is_symlink():
            for q in sorted(p.iterdir()):
                (ours if _ours_in(p.name, q) else foreign).append(q)
        else:
            (ours if _ours_at_top(p) else foreign).append(p)
    return ours, foreign


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
