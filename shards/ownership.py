"""Which files in a cache directory are ours: the only ones `dflash-extract --overwrite` may delete.

Ours: cache.json, target_head.safetensors, manifest.parquet, shards/b{8 digits}.safetensors,
quarantine/b{8 digits}.safetensors (dflash-shards verify --quarantine), logs/extract*, the lock file
and durable-write temporaries (.tmp-*) at each of those levels. Anything else is the user's: its
presence makes --overwrite refuse, and nothing here ever deletes it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .durable import TMP_PREFIX
from .format import CACHE_CONFIG_FILE, MANIFEST_FILE, SHARDS_DIR, TARGET_HEAD_FILE, batch_id_of
from .lock import LOCK_FILE

QUARANTINE_DIR = "quarantine"
LOGS_DIR = "logs"
_TOP_FILES = (CACHE_CONFIG_FILE, TARGET_HEAD_FILE, MANIFEST_FILE, LOCK_FILE)


def _ours_in(sub: str, name: str) -> bool:
    if name.startswith(TMP_PREFIX):
        return True
    if sub in (SHARDS_DIR, QUARANTINE_DIR):
        return batch_id_of(name) is not None
    return name.startswith("extract")  # logs/extract-rank{r}.jsonl and other extraction logs


def our_entries(cache_dir: str | Path) -> tuple[list[Path], list[Path]]:
    """(files of ours, entries that are not ours) under cache_dir; folders of ours are not listed."""
    cache_dir = Path(cache_dir)
    ours, foreign = [], []
    for p in sorted(cache_dir.iterdir()):
        if p.name in _TOP_FILES or p.name.startswith(TMP_PREFIX):
            (ours if p.is_file() or p.name.startswith(TMP_PREFIX) else foreign).append(p)
        elif p.name in (SHARDS_DIR, QUARANTINE_DIR, LOGS_DIR) and p.is_dir() and not p.is_symlink():
            for q in sorted(p.iterdir()):
                (ours if _ours_in(p.name, q.name) and not q.is_dir() else foreign).append(q)
        else:
            foreign.append(p)
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
        if p.is_dir():  # a temporary directory of ours
            for q in p.iterdir():
                q.unlink()
            p.rmdir()
        else:
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
