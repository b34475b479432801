"""Which files in a cache directory are ours: the cache's Layout, the only files `dflash-extract
--overwrite` may delete (shards/common/owned judges every entry with it).

A file is ours when its name and its content both say dflash-extract wrote it:
  cache.json                  a JSON object with a format_version
  target_head.safetensors     a container whose header carries our format_version and checksum
  projection.safetensors      likewise (projected caches)
  manifest.parquet            a Parquet file with the manifest's columns
  shards/ and quarantine/     b{8 digits}.safetensors whose header names that batch
  logs/extract-rank{r}.jsonl  the per-rank extraction logs
  the lock file, and atomic-write temporaries (.tmp-NAME.xxxxxxxx) of those names (and of
  check_writable's probe) at each level.
Damage does not make a file foreign: a container of ours cut short still starts with our header, an
empty shard holds nothing to lose, and in a directory that is recognisably our cache (a shard, head
or cache.json of ours in it) a damaged cache.json, head or manifest under its own name is ours too.
Anything else (another name, a folder, a link, a FIFO, a file of our name holding something else) is
the user's: its presence makes --overwrite refuse, and nothing here ever deletes it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow.parquet as pq

from shards.common.json_input import parse_json
from shards.common.owned import (
    LOCK_FILE,
    Dir,
    Entry,
    Layout,
    OwnershipError,
    Survey,
    describe,
    judge,
    remove_empty_folders,
    remove_entries,
    survey,
)
from shards.container import read_header
from shards.format import (
    CACHE_CONFIG_FILE,
    MANIFEST_FILE,
    PROJECTION_FILE,
    SHARDS_DIR,
    TARGET_HEAD_FILE,
    CacheFormatError,
    batch_id_of,
)
from shards.manifest import SCHEMA as MANIFEST_SCHEMA

QUARANTINE_DIR = "quarantine"
LOGS_DIR = "logs"
_LOG = re.compile(r"extract-rank\d+\.jsonl")
# How every header write_container writes begins, after its 8-byte length: the first metadata key.
_OUR_HEADER_START = b'{"__metadata__":{"format_version":"'


def _our_container(d: Dir, name: str, batch_id: int | None = None) -> bool:
    """A safetensors file whose header we wrote (for a shard: naming `batch_id`); its data may be
    damaged, or the file cut short inside the header (then its first bytes decide)."""
    if not d.is_file(name):
        return False
    try:
        meta = read_header(d.pinned_path(name), check_size=False).metadata
    except CacheFormatError:
        try:
            with os.fdopen(d.open_own(name, os.O_RDONLY), "rb") as f:
                return f.read(8 + len(_OUR_HEADER_START))[8:] == _OUR_HEADER_START
        except (OSError, ValueError):
            return False
    return (
        "format_version" in meta and "checksum" in meta and (batch_id is None or meta.get("batch_id") == str(batch_id))
    )


def _our_cache_config(d: Dir, name: str) -> bool:
    try:
        record = parse_json(d.read_bytes(name), str(d.path / name))
    except (OSError, ValueError):  # absent, not a regular file, not JSON
        return False
    return isinstance(record, dict) and "format_version" in record


def _our_manifest(d: Dir, name: str) -> bool:
    try:
        with os.fdopen(d.open_own(name, os.O_RDONLY), "rb") as f:
            return pq.read_schema(f).names == MANIFEST_SCHEMA.names
    except Exception:  # pyarrow raises several types for a file that is not Parquet
        return False


_TOP_FILES = {
    CACHE_CONFIG_FILE: _our_cache_config,
    TARGET_HEAD_FILE: _our_container,
    PROJECTION_FILE: _our_container,
    MANIFEST_FILE: _our_manifest,
}


def is_our_shard(d: Dir, name: str) -> bool:
    """A regular file of a shard's name in shards/ or quarantine/ (`d`) that dflash-extract wrote, or an empty one."""
    batch_id = batch_id_of(name)
    if batch_id is None or not d.is_file(name):
        return False
    return d.lstat(name).st_size == 0 or _our_container(d, name, batch_id)


def _is_our_cache(d: Dir) -> bool:
    """Recognisably a cache of ours: cache.json, the target head or one shard under shards/ says so."""
    if _our_cache_config(d, CACHE_CONFIG_FILE) or _our_container(d, TARGET_HEAD_FILE):
        return True
    if not d.is_dir(SHARDS_DIR):
        return False
    with d.child(SHARDS_DIR) as shards:
        return any(is_our_shard(shards, n) and shards.lstat(n).st_size for n in shards.names() if batch_id_of(n))


def _top_claim(d: Dir, e: Entry, our_cache: bool) -> bool:
    check = _TOP_FILES.get(e.name)
    return e.is_file and check is not None and (our_cache or check(d, e.name))


_SHARD_FOLDER = Layout(
    claim=lambda d, e, marked: is_our_shard(d, e.name),
    temporaries=lambda final: batch_id_of(final) is not None,
)
CACHE_LAYOUT = Layout(
    claim=_top_claim,
    temporaries=_TOP_FILES.__contains__,
    folders={
        SHARDS_DIR: _SHARD_FOLDER,
        QUARANTINE_DIR: _SHARD_FOLDER,
        LOGS_DIR: Layout(claim=lambda d, e, marked: e.is_file and _LOG.fullmatch(e.name) is not None),
    },
    marked=_is_our_cache,
)


def survey_cache(cache_dir: str | Path) -> Survey:
    with Dir.open(cache_dir) as d:
        return survey(d, CACHE_LAYOUT)


def planted_at_our_names(cache_dir: str | Path) -> list[Entry]:
    """Links, FIFOs and devices under a name the cache's writers write (cache.json, the head, the
    manifest, a rank's log): a resume refuses them before any work, not when it gets there. Looks at
    those names only (a full survey would read every shard's header)."""
    with Dir.open(cache_dir) as d:
        found = [_entry(d, None, name) for name in _TOP_FILES]
        if d.is_dir(LOGS_DIR):
            with d.child(LOGS_DIR) as logs:
                found += [_entry(logs, LOGS_DIR, name) for name in logs.names() if _LOG.fullmatch(name)]
    return [e for e in found if e is not None and not (e.is_file or e.is_dir)]


def _entry(d: Dir, folder: str | None, name: str) -> Entry | None:
    st = d.lstat(name)
    return None if st is None else Entry(folder, name, st, d.path / name)


def is_our_file(cache_dir: str | Path, name: str) -> bool:
    """One top-level file of cache_dir (cache.json, the head, the manifest), judged as survey_cache would."""
    with Dir.open(cache_dir) as d:
        return judge(d, name, CACHE_LAYOUT)


def remove_stale_cache_temporaries(cache_dir: str | Path) -> int:
    """Delete what killed writers of ours left half written: temporaries of our names at the top and
    under shards/ (never a user's `.tmp-notes.markdown`); returns how many."""
    found = survey_cache(cache_dir)
    stale = [e for e in found.scaffolding if e.folder in (None, SHARDS_DIR) and e.name != LOCK_FILE and e.is_file]
    with Dir.open(cache_dir) as d:
        remove_entries(d, stale)
    return len(stale)


def remove_cache_files(cache_dir: str | Path) -> int:
    """Delete our files in cache_dir (never the lock, never anything else); returns how many.

    Refuses (OwnershipError) when anything else is there, before deleting anything. cache.json goes
    first, so a deletion cut short leaves a directory that is visibly not a complete cache.
    """
    with Dir.open(cache_dir) as d:
        found = survey(d, CACHE_LAYOUT)
        if found.foreign:
            raise OwnershipError(
                f"{cache_dir} holds files dflash-extract did not write ({describe(found.foreign)}); "
                "nothing was deleted: move them away or choose another --out"
            )
        ours = [e for e in found.ours + found.scaffolding if not (e.folder is None and e.name == LOCK_FILE)]
        ours.sort(key=lambda e: not (e.folder is None and e.name == CACHE_CONFIG_FILE))
        remove_entries(d, ours)
        remove_empty_folders(d, [SHARDS_DIR, QUARANTINE_DIR, LOGS_DIR])
    return len(ours)
