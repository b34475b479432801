"""manifest.parquet: one row per sample (sample id, batch, offset, length, loss tokens, mode index); a long sample
stored as pieces (cache.json "pieces") has one row per piece, in as many shards.

Written at the end of an extraction and rebuildable at any time from the shard headers, so it is a
convenience index, never the source of truth.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from shards.common.durable import atomic_write_bytes
from shards.format import MANIFEST_FILE, CacheFormatError
from shards.reader import ShardInfo, ShardReader

SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("batch_id", pa.int64()),
        ("offset", pa.int32()),
        ("length", pa.int32()),
        ("loss_tokens", pa.int32()),
        ("mode", pa.int32()),  # index into cache.json's modes (CacheConfig.modes)
    ]
)
_OLDER_NAMES = SCHEMA.names[:-1]  # manifests written before the mode column: every sample in mode 0


def manifest_table(infos: list[ShardInfo]) -> pa.Table:
    rows = [
        (s.sample_id, i.batch_id, s.offset, s.length, s.loss_tokens, s.mode)
        for i in sorted(infos, key=lambda i: i.batch_id)
        for s in i.samples
    ]
    columns = list(zip(*rows)) if rows else [[] for _ in SCHEMA]
    return pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(columns, SCHEMA)], schema=SCHEMA)


def write_manifest(cache_dir: str | Path, infos: list[ShardInfo]) -> Path:
    buf = io.BytesIO()
    pq.write_table(manifest_table(infos), buf)
    path = Path(cache_dir) / MANIFEST_FILE
    atomic_write_bytes(path, buf.getvalue())
    return path


def read_manifest(cache_dir: str | Path) -> pa.Table:
    path = Path(cache_dir) / MANIFEST_FILE
    if not path.is_file():
        raise CacheFormatError(f"{path}: not found; rebuild it with `dflash-shards index {cache_dir}`")
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise CacheFormatError(f"{path}: unreadable ({e}); rebuild it with `dflash-shards index {cache_dir}`") from e
    if table.schema.names == _OLDER_NAMES:
        table = table.append_column(SCHEMA.field("mode"), pa.array([0] * table.num_rows, pa.int32()))
    if table.schema.names != SCHEMA.names:
        raise CacheFormatError(f"{path}: columns {table.schema.names}, expected {SCHEMA.names}")
    return table


def rebuild_manifest(cache_dir: str | Path) -> Path:
    """Rewrite manifest.parquet from the shard headers (bad shards raise ShardError)."""
    reader = ShardReader(cache_dir)
    return write_manifest(cache_dir, [reader.info(b) for b in reader.batch_ids()])


def pieced_samples(rows: Iterable[tuple[str, int]]) -> dict[str, list[int]]:
    """Each long sample's batch ids, ascending, from (sample id, batch id) rows: a sample id is unique in
    a cache, so one that more than one shard holds is a sample stored as pieces."""
    batches: dict[str, list[int]] = {}
    for sample_id, batch_id in rows:
        batches.setdefault(sample_id, []).append(batch_id)
    return {sample_id: sorted(ids) for sample_id, ids in batches.items() if len(ids) > 1}


def header_rows(reader: ShardReader) -> Iterator[tuple[str, int]]:
    """(sample id, batch id) of every sample the shard headers list (the truth the manifest is rebuilt
    from); a header that cannot be read raises ShardError."""
    for batch_id in reader.batch_ids():
        yield from ((s.sample_id, batch_id) for s in reader.info(batch_id).samples)
