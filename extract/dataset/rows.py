"""Row formats: read, parse and validate the rows of JSON Lines and Parquet dataset files.

Every problem is a DataError naming file, row (a JSONL row r is line r + 1) and reason; a scan
collects them all (`Problems`) and reports them together. A file is
read in chunks of rows (`Chunk`): row numbers, raw ids, lengths, and all tokens and masks of the
chunk flattened, so a scan of millions of rows does no per-row Python work past parsing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shards.common.chat_mode import MODE_COLUMN, mode_from_value, mode_text
from shards.common.errors import UserError
from shards.common.json_input import InputFileError, parse_json

logger = logging.getLogger(__name__)

LARGE_ROW_GROUP_TOKENS = 16 * 2**20  # a Parquet row group past this makes random sample access slow
MAX_ROW_BYTES = 1 << 30  # one JSON Lines row; a million tokens take ~7 MB


class DataError(UserError, ValueError):
    """A dataset file or row that cannot be used; the message names file, row and reason."""


MAX_REPORTED_PROBLEMS = 20  # bad rows listed in one error; the rest are counted


class Problems:
    """Bad rows and files met by a scan: every one counted, the first `limit` kept with their message.

    A scan goes on past a bad row so that one run names every row to fix, not one per run.
    """

    def __init__(self, limit: int = MAX_REPORTED_PROBLEMS):
        self.limit = limit
        self.count = 0
        self.messages: list[str] = []

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.messages) < self.limit:
            self.messages.append(message)

    def raise_if_any(self, where: str) -> None:
        if self.count == 0:
            return
        if self.count == 1:
            raise DataError(self.messages[0])
        more = f"\n  ... and {self.count - len(self.messages)} more" if self.count > len(self.messages) else ""
        raise DataError(
            f"{where}: {self.count} bad rows"
            + (f" (the first {len(self.messages)})" if more else "")
            + ":\n  "
            + "\n  ".join(self.messages)
            + more
        )


def _report(problems: Problems | None, message: str) -> None:
    """Raise at once without a collector (loading one sample), else count it and go on."""
    if problems is None:
        raise DataError(message)
    problems.add(message)


def row_location(path: str, row: int) -> str:
    line = f" (line {row + 1})" if path.endswith(".jsonl") else ""
    return f"{path}, row {row}{line}"


class Chunk(NamedTuple):
    """A run of n consecutive rows of one file, parsed and validated."""

    rows: np.ndarray  # [n] int64, row within the file
    ids: list  # [n] the given id (str or int) or None
    lengths: np.ndarray  # [n] int64
    tokens: np.ndarray  # [sum(lengths)] int32, the rows' input_ids back to back
    mask: np.ndarray  # [sum(lengths)] uint8, the rows' loss masks back to back
    byte_offsets: np.ndarray | None  # [n] int64 start of each JSONL line; None for Parquet
    modes: list[str | None] | None = None  # [n] each row's MODE_COLUMN as mode_text; None: the file has none


def _check_values(
    tokens: np.ndarray,
    mask: np.ndarray,
    lengths: np.ndarray,
    vocab_size: int,
    path: str,
    first_row: int,
    problems: Problems | None = None,
) -> None:
    """Every row with a token id outside the vocabulary or a mask value other than 0/1 (its first bad
    position each); raises at the first one without a collector."""
    ends = np.cumsum(lengths)
    for name, bad in (
        ("input_ids", (tokens < 0) | (tokens >= vocab_size)),
        ("loss_mask", (mask != 0) & (mask != 1)),
    ):
        if not bad.any():
            continue
        flats = np.flatnonzero(bad)
        rows = np.searchsorted(ends, flats, side="right")
        firsts = flats[np.concatenate([[True], rows[1:] != rows[:-1]])]  # first bad position of each row
        values = tokens if name == "input_ids" else mask
        allowed = f"outside [0, {vocab_size}) (the target's vocabulary)" if name == "input_ids" else "not 0 or 1"
        for flat in firsts.tolist():
            row = int(np.searchsorted(ends, flat, side="right"))
            pos = flat - (int(ends[row - 1]) if row else 0)
            _report(problems, f"{row_location(path, first_row + row)}: {name}[{pos}] = {values[flat]} is {allowed}")


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


def parse_json_row(line: bytes, path: str, row: int, vocab_size: int) -> tuple[object, np.ndarray, np.ndarray]:
    where = row_location(path, row)
    try:
        obj = parse_json(line, where, max_bytes=MAX_ROW_BYTES)
    except InputFileError as e:
        reason = str(e).removeprefix(f"{where}: ")
        raise DataError(
            f"{where}: malformed JSON line ({reason}); the file must be JSON Lines, one object per line"
        ) from e
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


def row_mode_text(value: object, where: str) -> str | None:
    """A token row's MODE_COLUMN value as its canonical text (shards.common.chat_mode.mode_text), None when
    the row states none; DataError naming the row when it is malformed."""
    if value is None:
        return None
    try:
        return mode_text(mode_from_value(value, where))
    except ValueError as e:
        raise DataError(str(e)) from e


def _json_row_mode(line: bytes, where: str) -> str | None:
    """The mode a JSON Lines token row states: parsed again only for rows that name the field (rare)."""
    if MODE_COLUMN.encode() not in line:
        return None
    return row_mode_text(parse_json(line, where, max_bytes=MAX_ROW_BYTES).get(MODE_COLUMN), where)


def _jsonl_chunk(
    path: str, items: list[tuple[int, int, bytes]], vocab_size: int, problems: Problems | None = None
) -> Chunk | None:
    """Parse (row, byte offset, line) items of one JSONL file into a chunk of its good rows (None: no good row)."""
    ids, toks, masks, kept, modes = [], [], [], [], []
    for item in items:
        row, _, line = item
        try:
            sample_id, tokens, mask = parse_json_row(line, path, row, vocab_size)
            modes.append(_json_row_mode(line, row_location(path, row)))
        except DataError as e:
            _report(problems, str(e))
            continue
        ids.append(sample_id)
        toks.append(tokens)
        masks.append(mask)
        kept.append(item)
    if not kept:
        return None
    rows = np.array([r for r, _, _ in kept], dtype=np.int64)
    offsets = np.array([o for _, o, _ in kept], dtype=np.int64)
    lengths = np.array([t.shape[0] for t in toks], dtype=np.int64)
    return Chunk(rows, ids, lengths, np.concatenate(toks), np.concatenate(masks), offsets, modes)


def _iter_jsonl(
    path: str, vocab_size: int, problems: Problems | None = None, rows_per_chunk: int = 4096
) -> Iterator[Chunk]:
    items: list[tuple[int, int, bytes]] = []
    offset = 0
    with open(path, "rb") as f:
        for row, line in enumerate(f):
            items.append((row, offset, line))
            offset += len(line)
            if len(items) == rows_per_chunk:
                chunk = _jsonl_chunk(path, items, vocab_size, problems)
                if chunk is not None:
                    yield chunk
                items = []
    if items:
        chunk = _jsonl_chunk(path, items, vocab_size, problems)
        if chunk is not None:
            yield chunk


def _list_type_ok(t: pa.DataType, allow_bool: bool) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        return False
    v = t.value_type
    return pa.types.is_integer(v) or (allow_bool and pa.types.is_boolean(v))


def parquet_columns(schema: pa.Schema, path: str) -> list[str]:
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
    if MODE_COLUMN in names:
        t = schema.field(MODE_COLUMN).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
            raise DataError(f"{path}: column {MODE_COLUMN} has type {t}, expected string (a mode's JSON)")
    return [n for n in ("input_ids", "loss_mask", "id", MODE_COLUMN) if n in names]


def _flat_list(
    col: pa.ChunkedArray, name: str, path: str, first_row: int, problems: Problems | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """(lengths [n] int64, flat values) of a list column; None (each bad row reported) when a list or an
    element is null."""
    arr = col.combine_chunks()
    if arr.null_count:
        for row in np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False)).tolist():
            _report(problems, f"{row_location(path, first_row + row)}: {name} is null")
        return None
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    values = arr.flatten()
    if values.null_count:
        flats = np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))
        rows = np.unique(np.searchsorted(np.cumsum(lengths), flats, side="right"))
        for row in rows.tolist():
            _report(problems, f"{row_location(path, first_row + row)}: {name} contains a null value")
        return None
    return lengths, values.to_numpy(zero_copy_only=False)


def parquet_chunk(
    table: pa.Table, path: str, first_row: int, vocab_size: int, problems: Problems | None = None
) -> Chunk | None:
    """The rows of one row group; None when a row is structurally bad (null lists, lengths differing),
    after reporting every such row (its value checks would only repeat the problem)."""
    n = table.num_rows
    flat = _flat_list(table.column("input_ids"), "input_ids", path, first_row, problems)
    mask_flat = (
        _flat_list(table.column("loss_mask"), "loss_mask", path, first_row, problems)
        if "loss_mask" in table.column_names
        else None
    )
    if flat is None or ("loss_mask" in table.column_names and mask_flat is None):
        return None
    lengths, tokens = flat
    if mask_flat is not None:
        mask_lengths, mask = mask_flat
        if not np.array_equal(mask_lengths, lengths):
            for row in np.flatnonzero(mask_lengths != lengths).tolist():
                _report(
                    problems,
                    f"{row_location(path, first_row + row)}: loss_mask has {mask_lengths[row]} values, "
                    f"input_ids has {lengths[row]}",
                )
            return None
    else:
        mask = np.ones(tokens.shape[0], dtype=np.uint8)
    _check_values(tokens, mask, lengths, vocab_size, path, first_row, problems)
    ids = table.column("id").to_pylist() if "id" in table.column_names else [None] * n
    rows = np.arange(first_row, first_row + n, dtype=np.int64)
    modes = None
    if MODE_COLUMN in table.column_names:
        modes = []
        for row, value in enumerate(table.column(MODE_COLUMN).to_pylist()):
            try:
                modes.append(row_mode_text(value, row_location(path, first_row + row)))
            except DataError as e:
                _report(problems, str(e))
                return None
    return Chunk(rows, ids, lengths, tokens.astype(np.int32), mask.astype(np.uint8), None, modes)


def open_parquet(path: str) -> pq.ParquetFile:
    """A Parquet file whose pages are checked against their CRC checksums where the writer stored them
    (write_parquet does); a file whose footer cannot be read is a DataError naming it."""
    try:
        return pq.ParquetFile(path, page_checksum_verification=True)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e


def read_row_group(pf: pq.ParquetFile, g: int, path: str, first_row: int, columns: list[str] | None = None) -> pa.Table:
    """Row group `g` (its first row is `first_row`) of an open Parquet file. A damaged page (a page
    header that does not parse, data that does not decompress, a CRC mismatch) is a DataError naming
    file, row group and rows, never pyarrow's bare message."""
    try:
        return pf.read_row_group(g, columns=columns)
    except (pa.ArrowException, OSError) as e:
        last = first_row + pf.metadata.row_group(g).num_rows - 1
        raise DataError(
            f"{path}, row group {g} (rows {first_row}-{last}): damaged Parquet data ({e}); the file is "
            "corrupt: restore it from its source or write it again"
        ) from e


def _iter_parquet(path: str, vocab_size: int, problems: Problems | None = None) -> Iterator[Chunk]:
    pf = open_parquet(path)
    columns = parquet_columns(pf.schema_arrow, path)
    first_row, largest = 0, 0
    for g in range(pf.num_row_groups):
        try:
            table = read_row_group(pf, g, path, first_row, columns)
        except DataError as e:  # one damaged row group: the scan goes on to name every other one
            _report(problems, str(e))
            first_row += pf.metadata.row_group(g).num_rows
            continue
        chunk = parquet_chunk(table, path, first_row, vocab_size, problems)
        if chunk is not None:
            largest = max(largest, int(chunk.tokens.shape[0]))
            yield chunk
        first_row += table.num_rows
    if largest > LARGE_ROW_GROUP_TOKENS:
        logger.warning(
            "%s: row groups of up to %d tokens; loading a sample decodes its whole row group, so packed "
            "batches load slowly; rewrite the file with smaller row groups (write_parquet uses 256 rows)",
            path,
            largest,
        )


def iter_file(path: str, vocab_size: int, problems: Problems | None = None) -> Iterator[Chunk]:
    """The file's chunks of validated rows. With `problems`, bad rows are reported there and left out
    (the caller raises at the end); without, the first bad row raises."""
    if path.endswith(".parquet"):
        return _iter_parquet(path, vocab_size, problems)
    return _iter_jsonl(path, vocab_size, problems)
