"""Dataset input for dflash-extract: find, validate, index and load tokenised samples.

Input is a Parquet or JSON Lines file, a directory holding such files (searched recursively), or a
glob. Files are taken in sorted order, so the dataset order, and with it the packing plan and every
batch id, is the same on every run and every rank.

Each row carries
    input_ids   list of ints in [0, vocab_size)           required
    loss_mask   list of 0/1, as long as input_ids         optional; all ones when absent
    id          string or int                             optional; "<file stem>:<row>" when absent
Rows are counted from 0 within their file (a JSONL row is a line, so row r is line r + 1).

scan_dataset() reads every row once, before any model loads, and raises DataError naming file, row
and reason at the first bad row. It returns a DatasetIndex: per non-empty sample its id, length,
loss tokens, file and row; small enough to plan the packing of millions of samples. Empty samples
are skipped and counted in the index's ScanReport. load_samples() / SampleLoader fetch the token data
of chosen samples later, one packed batch at a time, reading only the Parquet row groups or JSONL
lines they need.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

DATA_SUFFIXES = (".parquet", ".jsonl")
LONG_SEQ_POLICIES = ("truncate", "skip", "error")
_NUM_EMPTY_EXAMPLES = 5  # empty sample ids kept for the report line
_LARGE_ROW_GROUP_TOKENS = 16 * 2**20  # a Parquet row group past this makes random sample access slow


class DataError(ValueError):
    """A dataset file or row that cannot be used; the message names file, row and reason."""


@dataclass
class Sample:
    """One tokenised sample: token ids and the mask of supervised tokens."""

    sample_id: str
    input_ids: np.ndarray  # [length] int32
    loss_mask: np.ndarray  # [length] uint8, 1 = token is supervised

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids, dtype=np.int32)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.uint8)
        if self.input_ids.ndim != 1 or self.input_ids.shape != self.loss_mask.shape:
            raise ValueError(
                f"sample {self.sample_id!r}: input_ids shape {self.input_ids.shape} and loss_mask shape "
                f"{self.loss_mask.shape} must be equal and 1-D"
            )

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class ScanReport:
    """What one pass over the dataset found; logged and recorded with the cache."""

    num_files: int
    num_rows: int  # rows read, empty ones included
    num_samples: int  # non-empty samples indexed
    num_empty: int  # rows with zero tokens: skipped, never packed
    num_tokens: int  # tokens of the indexed samples (before any truncation)
    num_loss_tokens: int  # of which loss_mask == 1
    max_length: int  # longest sample, tokens
    token_budget: int | None  # budget the long-sample count refers to; None = not counted
    num_longer_than_budget: int  # samples longer than token_budget (0 when token_budget is None)
    empty_examples: tuple[str, ...]  # ids of the first few empty samples, for the log

    def summary(self) -> str:
        long = "" if self.token_budget is None else f", {self.num_longer_than_budget} longer than {self.token_budget}"
        empty = f" (e.g. {', '.join(self.empty_examples)})" if self.empty_examples else ""
        return (
            f"{self.num_files} files, {self.num_rows} rows: {self.num_samples} samples, {self.num_tokens} tokens "
            f"({self.num_loss_tokens} supervised), longest {self.max_length}{long}; "
            f"{self.num_empty} empty samples skipped{empty}"
        )


@dataclass
class DatasetIndex:
    """Per non-empty sample, in dataset order: id, length and where it lives (file, row)."""

    files: list[str]  # data files, sorted
    file_sizes: list[int]  # bytes at scan time, to catch files changed before loading
    vocab_size: int  # token ids were checked against [0, vocab_size)
    sample_ids: list[str]  # [N]
    lengths: np.ndarray  # [N] int64, tokens
    loss_tokens: np.ndarray  # [N] int64, tokens with loss_mask == 1
    file_index: np.ndarray  # [N] int32, into files
    rows: np.ndarray  # [N] int64, row within its file
    byte_offsets: np.ndarray  # [N] int64, start of the JSONL line; -1 for Parquet
    content_sha256: str  # sha256 of all tokens (int32 LE) and masks (uint8), in index order
    report: ScanReport

    def __len__(self) -> int:
        return len(self.sample_ids)

    def location(self, i: int) -> str:
        """Human-readable place of sample i, for error messages."""
        return _where(self.files[int(self.file_index[i])], int(self.rows[i]))


def _where(path: str, row: int) -> str:
    line = f" (line {row + 1})" if path.endswith(".jsonl") else ""
    return f"{path}, row {row}{line}"


def find_data_files(path: str | os.PathLike) -> list[str]:
    """The data files named by `path` (file, directory or glob), sorted."""
    text = str(path)
    if any(c in text for c in "*?["):
        files = sorted(glob.glob(text, recursive=True))
        if not files:
            raise DataError(f"no files match {text!r}")
        bad = [f for f in files if not f.endswith(DATA_SUFFIXES)]
        if bad:
            raise DataError(f"{text!r} matches files that are neither Parquet nor JSONL: {bad[:5]}")
        return files
    p = Path(text)
    if p.is_dir():
        found = sorted(str(f) for f in p.rglob("*") if f.is_file())
        files = [f for f in found if f.endswith(DATA_SUFFIXES)]
        if len(files) < len(found):
            logger.info("%s: ignoring %d files that are not %s", p, len(found) - len(files), DATA_SUFFIXES)
        if not files:
            raise DataError(f"directory {p} holds no {' or '.join(DATA_SUFFIXES)} files")
        return files
    if not p.is_file():
        raise DataError(f"dataset path {p} does not exist")
    if not text.endswith(DATA_SUFFIXES):
        raise DataError(f"{p}: unsupported file type; expected one of {DATA_SUFFIXES}")
    return [text]


class _Chunk(NamedTuple):
    """A run of n consecutive rows of one file, parsed and validated."""

    rows: np.ndarray  # [n] int64, row within the file
    ids: list  # [n] the given id (str or int) or None
    lengths: np.ndarray  # [n] int64
    tokens: np.ndarray  # [sum(lengths)] int32, the rows' input_ids back to back
    mask: np.ndarray  # [sum(lengths)] uint8, the rows' loss masks back to back
    byte_offsets: np.ndarray | None  # [n] int64 start of each JSONL line; None for Parquet


def _check_values(tokens: np.ndarray, mask: np.ndarray, lengths: np.ndarray, vocab_size: int, path: str, first_row: int) -> None:
    """Raise at the first token id outside the vocabulary or mask value other than 0/1."""
    for name, bad in (
        ("input_ids", (tokens < 0) | (tokens >= vocab_size)),
        ("loss_mask", (mask != 0) & (mask != 1)),
    ):
        if bad.any():
            flat = int(np.argmax(bad))
            ends = np.cumsum(lengths)
            row = int(np.searchsorted(ends, flat, side="right"))
            pos = flat - (int(ends[row - 1]) if row else 0)
            value = (tokens if name == "input_ids" else mask)[flat]
            allowed = f"outside [0, {vocab_size}) (the target's vocabulary)" if name == "input_ids" else "not 0 or 1"
            raise DataError(f"{_where(path, first_row + row)}: {name}[{pos}] = {value} is {allowed}")


def _int_list(value: object, name: str, where: str, allow_bool: bool, may_hold_bool: bool) -> np.ndarray:
    """A JSON list of integers as a 1-D numpy array, or DataError.

    may_hold_bool: the raw line contains "true" or "false", so elements must be checked one by one.
    """
    if not isinstance(value, list):
        raise DataError(f"{where}: {name} must be a list of integers, found {type(value).__name__}")
    if not value:
        return np.zeros(0, dtype=np.int64)
    try:
        arr = np.asarray(value)
    except (ValueError, OverflowError) as e:
        raise DataError(f"{where}: {name} must be a flat list of integers ({e})") from e
    if arr.ndim != 1 or not (arr.dtype.kind in "iu" or (allow_bool and arr.dtype.kind == "b")):
        kinds = sorted({type(v).__name__ for v in value})
        if kinds == ["int"]:  # numpy keeps Python ints past 64 bits as objects
            raise DataError(f"{where}: {name} holds an integer too large for 64 bits")
        raise DataError(f"{where}: {name} must be a flat list of integers, found elements of type {kinds}")
    # numpy turns [True, 5] into ints; a bool among ids is a malformed row, not token id 1.
    if may_hold_bool and not allow_bool and any(type(v) is bool for v in value):
        raise DataError(f"{where}: {name} must be a list of integers, found a boolean")
    return arr


def _parse_json_row(line: bytes, path: str, row: int, vocab_size: int) -> tuple[object, np.ndarray, np.ndarray]:
    where = _where(path, row)
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{where}: malformed JSON line ({e}); the file must be JSON Lines, one object per line") from e
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, found {type(obj).__name__}")
    if "input_ids" not in obj:
        raise DataError(f"{where}: missing input_ids (keys: {sorted(obj)})")
    may_hold_bool = b"true" in line or b"false" in line  # cheap test that spares a per-element loop
    tokens = _int_list(obj["input_ids"], "input_ids", where, allow_bool=False, may_hold_bool=may_hold_bool)
    if obj.get("loss_mask") is None:
        mask = np.ones(tokens.shape[0], dtype=np.uint8)
    else:
        mask = _int_list(obj["loss_mask"], "loss_mask", where, allow_bool=True, may_hold_bool=may_hold_bool)
        if mask.shape != tokens.shape:
            raise DataError(f"{where}: loss_mask has {mask.shape[0]} values, input_ids has {tokens.shape[0]}")
    sample_id = obj.get("id")
    if sample_id is not None and (isinstance(sample_id, bool) or not isinstance(sample_id, (str, int))):
        raise DataError(f"{where}: id must be a string or an integer, found {type(sample_id).__name__}")
    lengths = np.array([tokens.shape[0]], dtype=np.int64)
    _check_values(tokens, mask, lengths, vocab_size, path, row)
    return sample_id, tokens.astype(np.int32), mask.astype(np.uint8)


def _jsonl_chunk(path: str, items: list[tuple[int, int, bytes]], vocab_size: int) -> _Chunk:
    """Parse (row, byte offset, line) items of one JSONL file into a chunk."""
    ids, toks, masks = [], [], []
    for row, _, line in items:
        sample_id, tokens, mask = _parse_json_row(line, path, row, vocab_size)
        ids.append(sample_id)
        toks.append(tokens)
        masks.append(mask)
    rows = np.array([r for r, _, _ in items], dtype=np.int64)
    offsets = np.array([o for _, o, _ in items], dtype=np.int64)
    lengths = np.array([t.shape[0] for t in toks], dtype=np.int64)
    return _Chunk(rows, ids, lengths, np.concatenate(toks), np.concatenate(masks), offsets)


def _iter_jsonl(path: str, vocab_size: int, rows_per_chunk: int = 4096) -> Iterator[_Chunk]:
    items: list[tuple[int, int, bytes]] = []
    offset = 0
    with open(path, "rb") as f:
        for row, line in enumerate(f):
            items.append((row, offset, line))
            offset += len(line)
            if len(items) == rows_per_chunk:
                yield _jsonl_chunk(path, items, vocab_size)
                items = []
    if items:
        yield _jsonl_chunk(path, items, vocab_size)


def _list_type_ok(t: pa.DataType, allow_bool: bool) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        return False
    v = t.value_type
    return pa.types.is_integer(v) or (allow_bool and pa.types.is_boolean(v))


def _parquet_columns(schema: pa.Schema, path: str) -> list[str]:
    """Check the column types of a Parquet file; return the columns to read."""
    names = schema.names
    if "input_ids" not in names:
        raise DataError(f"{path}: missing input_ids column (columns: {names})")
    for name in ("input_ids", "loss_mask"):
        if name in names and not _list_type_ok(schema.field(name).type, allow_bool=name == "loss_mask"):
            raise DataError(f"{path}: column {name} has type {schema.field(name).type}, expected a list of integers")
    if "id" in names:
        t = schema.field("id").type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)):
            raise DataError(f"{path}: column id has type {t}, expected string or integer")
    return [n for n in ("input_ids", "loss_mask", "id") if n in names]


def _flat_list(col: pa.ChunkedArray, name: str, path: str, first_row: int) -> tuple[np.ndarray, np.ndarray]:
    """(lengths [n] int64, flat values) of a list column, refusing null lists and null elements."""
    arr = col.combine_chunks()
    if arr.null_count:
        row = int(np.argmax(arr.is_null().to_numpy(zero_copy_only=False)))
        raise DataError(f"{_where(path, first_row + row)}: {name} is null")
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    values = arr.flatten()
    if values.null_count:
        flat = int(np.argmax(values.is_null().to_numpy(zero_copy_only=False)))
        row = int(np.searchsorted(np.cumsum(lengths), flat, side="right"))
        raise DataError(f"{_where(path, first_row + row)}: {name} contains a null value")
    return lengths, values.to_numpy(zero_copy_only=False)


def _parquet_chunk(table: pa.Table, path: str, first_row: int, vocab_size: int) -> _Chunk:
    n = table.num_rows
    lengths, tokens = _flat_list(table.column("input_ids"), "input_ids", path, first_row)
    if "loss_mask" in table.column_names:
        mask_lengths, mask = _flat_list(table.column("loss_mask"), "loss_mask", path, first_row)
        if not np.array_equal(mask_lengths, lengths):
            row = int(np.argmax(mask_lengths != lengths))
            raise DataError(
                f"{_where(path, first_row + row)}: loss_mask has {mask_lengths[row]} values, "
                f"input_ids has {lengths[row]}"
            )
    else:
        mask = np.ones(tokens.shape[0], dtype=np.uint8)
    _check_values(tokens, mask, lengths, vocab_size, path, first_row)
    ids = table.column("id").to_pylist() if "id" in table.column_names else [None] * n
    rows = np.arange(first_row, first_row + n, dtype=np.int64)
    return _Chunk(rows, ids, lengths, tokens.astype(np.int32), mask.astype(np.uint8), None)


def _iter_parquet(path: str, vocab_size: int) -> Iterator[_Chunk]:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e
    columns = _parquet_columns(pf.schema_arrow, path)
    first_row, largest = 0, 0
    for g in range(pf.num_row_groups):
        table = pf.read_row_group(g, columns=columns)
        chunk = _parquet_chunk(table, path, first_row, vocab_size)
        largest = max(largest, int(chunk.tokens.shape[0]))
        yield chunk
        first_row += table.num_rows
    if largest > _LARGE_ROW_GROUP_TOKENS:
        logger.warning(
            "%s: row groups of up to %d tokens; loading a sample decodes its whole row group, so packed "
            "batches load slowly; rewrite the file with smaller row groups (write_parquet uses 256 rows)",
            path, largest,
        )


def _iter_file(path: str, vocab_size: int) -> Iterator[_Chunk]:
    return _iter_parquet(path, vocab_size) if path.endswith(".parquet") else _iter_jsonl(path, vocab_size)


def scan_dataset(
    path: str | os.PathLike,
    *,
    vocab_size: int,
    token_budget: int | None = None,
    long_seqs: str = "truncate",
) -> DatasetIndex:
    """Read and validate every row of the dataset at `path`; return its index.

    Raises DataError at the first bad row (naming file, row and reason) or duplicate id (naming
    both places). With `token_budget`, samples longer than it are counted, and with
    long_seqs="error" the first one is refused here, before any model loads.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if long_seqs not in LONG_SEQ_POLICIES:
        raise ValueError(f"long_seqs must be one of {LONG_SEQ_POLICIES}, got {long_seqs!r}")
    files = find_data_files(path)
    seen: dict[str, tuple[int, int]] = {}  # sample id -> (file index, row), for duplicate reports
    ids: list[str] = []
    parts: dict[str, list[np.ndarray]] = {"lengths": [], "loss": [], "file": [], "rows": [], "offsets": []}
    token_hash, mask_hash = hashlib.sha256(), hashlib.sha256()
    num_rows, empty = 0, []
    for fi, file in enumerate(files):
        stem = Path(file).stem
        for rows, row_ids, lengths, tokens, mask, offsets in _iter_file(file, vocab_size):
            num_rows += len(rows)
            names = [f"{stem}:{r}" if i is None else str(i) for i, r in zip(row_ids, rows.tolist())]
            for name, row in zip(names, rows.tolist()):
                if name in seen:
                    pf, prow = seen[name]
                    raise DataError(
                        f"duplicate sample id {name!r}: {_where(files[pf], prow)} and {_where(file, row)}"
                    )
                seen[name] = (fi, row)
            if token_budget is not None and long_seqs == "error" and (lengths > token_budget).any():
                k = int(np.argmax(lengths > token_budget))
                raise DataError(
                    f"{_where(file, int(rows[k]))}: sample {names[k]!r} has {lengths[k]} tokens, more than "
                    f"token_budget {token_budget}; use --long-seqs truncate or skip, or a larger --token-budget"
                )
            # Per-sample loss tokens: sum of the mask over each sample's slice of the flat array.
            csum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
            ends = np.cumsum(lengths)
            loss = csum[ends] - csum[ends - lengths]
            keep = lengths > 0
            empty.extend(n for n, k in zip(names, keep.tolist()) if not k)
            ids.extend(n for n, k in zip(names, keep.tolist()) if k)
            parts["lengths"].append(lengths[keep])
            parts["loss"].append(loss[keep])
            parts["file"].append(np.full(int(keep.sum()), fi, dtype=np.int32))
            parts["rows"].append(rows[keep])
            parts["offsets"].append(offsets[keep] if offsets is not None else np.full(int(keep.sum()), -1, np.int64))
            token_hash.update(tokens.astype("<i4").tobytes())
            mask_hash.update(mask.tobytes())
    cat = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in parts.items()}
    lengths = cat["lengths"].astype(np.int64)
    report = ScanReport(
        num_files=len(files),
        num_rows=num_rows,
        num_samples=len(ids),
        num_empty=len(empty),
        num_tokens=int(lengths.sum()),
        num_loss_tokens=int(cat["loss"].sum()),
        max_length=int(lengths.max()) if lengths.size else 0,
        token_budget=token_budget,
        num_longer_than_budget=int((lengths > token_budget).sum()) if token_budget is not None else 0,
        empty_examples=tuple(empty[:_NUM_EMPTY_EXAMPLES]),
    )
    logger.info("scanned %s: %s", path, report.summary())
    return DatasetIndex(
        files=files,
        file_sizes=[os.path.getsize(f) for f in files],
        vocab_size=vocab_size,
        sample_ids=ids,
        lengths=lengths,
        loss_tokens=cat["loss"].astype(np.int64),
        file_index=cat["file"].astype(np.int32),
        rows=cat["rows"].astype(np.int64),
        byte_offsets=cat["offsets"].astype(np.int64),
        content_sha256=hashlib.sha256(token_hash.digest() + mask_hash.digest()).hexdigest(),
        report=report,
    )


def dataset_fingerprint(index: DatasetIndex) -> str:
    """sha256 over sample ids, lengths and content: a reordered or edited dataset changes it.

    Independent of file format and location: the same samples with the same ids as JSONL or as
    Parquet, anywhere on disk, give the same fingerprint.
    """
    h = hashlib.sha256(b"dflash-dataset-v1\0")
    h.update(len(index).to_bytes(8, "little"))
    for sample_id in index.sample_ids:
        raw = sample_id.encode("utf-8")
        h.update(len(raw).to_bytes(4, "little") + raw)  # length-prefixed: ids may contain any byte
    h.update(index.lengths.astype("<i8").tobytes())
    h.update(bytes.fromhex(index.content_sha256))
    return h.hexdigest()


class SampleLoader:
    """Fetches the samples of an index by position, keeping files open and recent row groups parsed.

    Every row read is validated again (same checks as the scan) and its id and length compared with
    the index, so a file edited after the scan is an error, never a silently different batch.
    """

    def __init__(self, index: DatasetIndex, cache_tokens: int = 64 * 2**20):
        self.index = index
        # Parsed Parquet row groups are kept between calls up to this many tokens (5 bytes each);
        # the row group in use is always kept.
        self._cache_tokens = cache_tokens
        self._cached = 0  # tokens in self._cache
        self._parquet: dict[int, tuple[pq.ParquetFile, list[str], np.ndarray]] = {}  # file -> (file, columns, row-group starts)
        self._cache: OrderedDict[tuple[int, int], tuple[list, np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        for file, size in zip(index.files, index.file_sizes):
            now = os.path.getsize(file) if os.path.exists(file) else None
            if now != size:
                raise DataError(f"{file} changed since the dataset was scanned ({size} -> {now} bytes); scan it again")

    def load(self, positions: Sequence[int]) -> list[Sample]:
        """Samples at `positions` of the index, in the order given."""
        return [self._load_one(int(i)) for i in positions]

    def _load_one(self, i: int) -> Sample:
        index = self.index
        if not 0 <= i < len(index):
            raise IndexError(f"sample position {i} outside the index of {len(index)} samples")
        fi, row = int(index.file_index[i]), int(index.rows[i])
        path = index.files[fi]
        if path.endswith(".parquet"):
            raw_id, tokens, mask = self._parquet_row(fi, row)
        else:
            with open(path, "rb") as f:
                f.seek(int(index.byte_offsets[i]))
                raw_id, tokens, mask = _parse_json_row(f.readline(), path, row, index.vocab_size)
        sample_id = f"{Path(path).stem}:{row}" if raw_id is None else str(raw_id)
        if sample_id != index.sample_ids[i]:
            raise DataError(
                f"{_where(path, row)}: id is {sample_id!r}, the scan found {index.sample_ids[i]!r}; "
                f"the file changed, scan it again"
            )
        if tokens.shape[0] != index.lengths[i]:
            raise DataError(
                f"{_where(path, row)}: sample {sample_id!r} has {tokens.shape[0]} tokens, the scan found "
                f"{index.lengths[i]}; the file changed, scan it again"
            )
        return Sample(sample_id, tokens, mask)

    def _parquet_row(self, fi: int, row: int) -> tuple[object, np.ndarray, np.ndarray]:
        """(raw id, tokens, mask) of one Parquet row, via a small LRU of parsed row groups."""
        path = self.index.files[fi]
        if fi not in self._parquet:
            pf = pq.ParquetFile(path)
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            self._parquet[fi] = (pf, _parquet_columns(pf.schema_arrow, path), np.cumsum([0] + sizes))
        pf, columns, starts = self._parquet[fi]
        g = int(np.searchsorted(starts, row, side="right")) - 1
        key = (fi, g)
        if key not in self._cache:
            table = pf.read_row_group(g, columns=columns)
            chunk = _parquet_chunk(table, path, int(starts[g]), self.index.vocab_size)
            self._cache[key] = (chunk.ids, np.concatenate([[0], np.cumsum(chunk.lengths)]), chunk.tokens, chunk.mask)
            self._cached += chunk.tokens.shape[0]
            while self._cached > self._cache_tokens and len(self._cache) > 1:
                self._cached -= self._cache.popitem(last=False)[1][2].shape[0]
        self._cache.move_to_end(key)
        ids, bounds, tokens, mask = self._cache[key]
        k = row - int(starts[g])
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        return ids[k], tokens[lo:hi].copy(), mask[lo:hi].copy()


def load_samples(index: DatasetIndex, positions: Sequence[int]) -> list[Sample]:
    """Samples at `positions` of the index (as in PackedBatch.rows), in the order given."""
    return SampleLoader(index).load(positions)


def write_jsonl(path: str | os.PathLike, samples: Iterable[Sample], with_ids: bool = True) -> None:
    """Write samples as JSON Lines (id, input_ids, loss_mask); for tests and demo data."""
    with open(path, "w", encoding="ascii") as f:
        for s in samples:
            row = {"id": s.sample_id} if with_ids else {}
            row.update(input_ids=s.input_ids.tolist(), loss_mask=s.loss_mask.tolist())
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def write_parquet(path: str | os.PathLike, samples: Iterable[Sample], with_ids: bool = True, row_group_size: int = 256) -> None:
    """Write samples as Parquet; small row groups keep load_samples' reads per batch small."""
    samples = list(samples)
    columns = {
        "input_ids": pa.array([s.input_ids for s in samples], type=pa.list_(pa.int32())),
        "loss_mask": pa.array([s.loss_mask for s in samples], type=pa.list_(pa.uint8())),
    }
    if with_ids:
        columns = {"id": pa.array([s.sample_id for s in samples], type=pa.string()), **columns}
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
