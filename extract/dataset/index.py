"""Dataset input for dflash-extract: find, validate, index and load tokenised samples.

Input is a Parquet or JSON Lines file, a directory holding such files, or a glob (finding the files,
in an order that is the same on every run and rank: files.py).

Each row carries
    input_ids   list of ints in [0, vocab_size)           required
    loss_mask   list of 0/1, as long as input_ids         optional; all ones when absent
    id          string or int                             optional; "<file stem>:<row>" when absent
                (at most MAX_SAMPLE_ID_BYTES bytes of UTF-8, no control characters: shards/sample_ids.py)
Rows are counted from 0 within their file (a JSONL row is a line, so row r is line r + 1).

scan_dataset() reads every row once, before any model loads, and raises one DataError naming file,
row and reason of every bad row (the first MAX_REPORTED_PROBLEMS listed, all counted). It returns a DatasetIndex: per non-empty sample its id, length,
loss tokens, file and row; small enough to plan the packing of millions of samples. Empty samples
are skipped and counted in the index's ScanReport. load_samples() / SampleLoader fetch the token data
of chosen samples later, one packed batch at a time, reading only the Parquet row groups or JSONL
lines they need. Parsing and validating the rows of each file format is rows.py's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from extract.dataset.files import derived_id_prefixes, find_data_files
from extract.dataset.rows import (
    DataError,
    Problems,
    iter_file,
    open_parquet,
    parquet_chunk,
    parquet_columns,
    parse_json_row,
    read_row_group,
    row_location,
)
from shards.anchors import valid_anchors
from shards.common.crc import crc32
from shards.sample_ids import preview, sample_id_problem

logger = logging.getLogger(__name__)

# What happens to a sample longer than the token budget (see PackingConfig.long_seqs).
LongSeqPolicy = Literal["truncate", "skip", "error"]
LONG_SEQ_POLICIES = get_args(LongSeqPolicy)
_NUM_EMPTY_EXAMPLES = 5  # empty sample ids kept for the report line


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
    # Supervised tokens whose next token in the same sample is supervised too: the positions a drafter
    # can anchor a block at (shards/anchors.py). 0 means nothing to learn from, whatever the mask count.
    num_anchor_positions: int = 0
    # Of those, the ones packing keeps (--long-seqs truncate cuts a sample at token_budget, skip drops
    # it); equal to num_anchor_positions without token_budget.
    num_packed_anchor_positions: int = 0
    # The longest run of consecutive supervised tokens packing keeps (a reply, as the drafter sees it in
    # training): a drafter has never drafted past it (cache.json dataset.longest_response).
    longest_response: int = 0

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
    sample_crc32: np.ndarray  # [N] uint32, sample_crc32() of each sample as scanned
    content_sha256: str  # sha256 of all tokens (int32 LE) and masks (uint8), in index order
    report: ScanReport
    # The serving modes the samples were rendered in, as mode_text (shards/common/chat_mode.py), in order
    # of first appearance; None = unknown (a row and its file state none). mode_ids[i] indexes it.
    modes: list[str | None] = field(default_factory=lambda: [None])
    mode_ids: np.ndarray | None = None  # [N] int32; None = every sample in modes[0]

    def __len__(self) -> int:
        return len(self.sample_ids)

    def location(self, i: int) -> str:
        """Human-readable place of sample i, for error messages."""
        return row_location(self.files[int(self.file_index[i])], int(self.rows[i]))


def scan_dataset(
    path: str | os.PathLike,
    *,
    vocab_size: int,
    token_budget: int | None = None,
    long_seqs: str = "truncate",
    limit_flag: str = "--token-budget",
    file_mode: Callable[[str], str | None] | None = None,
) -> DatasetIndex:
    """Read and validate every row of the dataset at `path`; return its index.

    Raises one DataError after the whole scan, naming every bad row (file, row and reason) and
    duplicate id (both places), the first MAX_REPORTED_PROBLEMS of them listed and all counted. With
    `token_budget`, samples longer than it are counted, and with long_seqs="error" they are refused
    here, before any model loads, naming `limit_flag` (the flag that set the limit). `file_mode(file)`:
    the mode (mode_text) of a file's rows that state none in their chat_mode column.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if long_seqs not in LONG_SEQ_POLICIES:
        raise ValueError(f"long_seqs must be one of {LONG_SEQ_POLICIES}, got {long_seqs!r}")
    files = find_data_files(path)
    seen: dict[str, tuple[int, int]] = {}  # sample id -> (file index, row), for duplicate reports
    ids: list[str] = []
    parts: dict[str, list[np.ndarray]] = {"lengths": [], "loss": [], "file": [], "rows": [], "offsets": [], "crc": []}
    token_hash, mask_hash = hashlib.sha256(), hashlib.sha256()
    num_rows, empty, anchors, packed_anchors, longest_response = 0, [], 0, 0, 0
    problems = Problems()  # every bad row of every file, reported together at the end
    prefixes = derived_id_prefixes(files)
    modes: dict[str | None, int] = {}
    mode_ids: list[np.ndarray] = []
    for fi, file in enumerate(files):
        stem = prefixes[file]
        default = file_mode(file) if file_mode is not None else None
        try:
            for chunk in iter_file(file, vocab_size, problems):
                given = chunk.modes or [None] * len(chunk.rows)
                kept = [m if m is not None else default for m, n in zip(given, chunk.lengths.tolist()) if n > 0]
                mode_ids.append(np.array([modes.setdefault(m, len(modes)) for m in kept], dtype=np.int32))
                num_rows += _index_chunk(
                    chunk,
                    fi,
                    files,
                    stem,
                    seen,
                    ids,
                    parts,
                    empty,
                    problems,
                    (token_budget, limit_flag) if long_seqs == "error" else None,
                )
                anchors += anchor_positions(chunk.lengths, chunk.mask)
                packed_anchors += anchor_positions(chunk.lengths, chunk.mask, token_budget, long_seqs)
                longest_response = max(
                    longest_response, longest_supervised_run(chunk.lengths, chunk.mask, token_budget, long_seqs)
                )
                token_hash.update(chunk.tokens.astype("<i4").tobytes())
                mask_hash.update(chunk.mask.tobytes())
        except DataError as e:  # the file itself (unreadable, wrong columns): its other rows are unknown
            problems.add(str(e))
    problems.raise_if_any(str(path))
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
        num_anchor_positions=anchors,
        num_packed_anchor_positions=packed_anchors,
        longest_response=longest_response,
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
        sample_crc32=cat["crc"].astype(np.uint32),
        content_sha256=hashlib.sha256(token_hash.digest() + mask_hash.digest()).hexdigest(),
        report=report,
        modes=list(modes) or [None],
        mode_ids=np.concatenate(mode_ids) if len(modes) > 1 else None,
    )


def anchor_positions(
    lengths: np.ndarray, mask: np.ndarray, token_budget: int | None = None, long_seqs: str = "truncate"
) -> int:
    """How many positions of these samples (rows back to back in `mask`, each its own sequence) may
    hold a training block's anchor, by the rule training samples with (shards/anchors.py). With
    token_budget, only what packing keeps of samples longer than it: their first token_budget tokens
    (long_seqs "truncate"), nothing (any other policy: skipped, or refused by the scan)."""
    if mask.size == 0:
        return 0
    supervised, cu_seqlens = _packed_supervision(lengths, mask, token_budget, long_seqs)
    return int(valid_anchors(torch.from_numpy(supervised), torch.from_numpy(cu_seqlens)).sum())


def longest_supervised_run(
    lengths: np.ndarray, mask: np.ndarray, token_budget: int | None = None, long_seqs: str = "truncate"
) -> int:
    """The longest run of consecutive supervised tokens within one sample (a reply), of what packing keeps
    (as anchor_positions counts); 0 when nothing is supervised."""
    if mask.size == 0:
        return 0
    supervised, cu_seqlens = _packed_supervision(lengths, mask, token_budget, long_seqs)
    # Run length at each position: supervised tokens so far minus those before the run's start, the
    # start being the last unsupervised token or the sample's first position, whichever is later.
    counted = np.cumsum(supervised, dtype=np.int64)
    before_run = np.where(supervised, 0, counted)
    starts = cu_seqlens[:-1][lengths > 0]
    before_run[starts] = np.maximum(before_run[starts], counted[starts] - supervised[starts])
    return int((counted - np.maximum.accumulate(before_run)).max())


def _packed_supervision(
    lengths: np.ndarray, mask: np.ndarray, token_budget: int | None, long_seqs: str
) -> tuple[np.ndarray, np.ndarray]:
    """(supervised [total] bool, cu_seqlens [N + 1]) of samples back to back, a token packing drops
    counted as unsupervised."""
    kept = lengths if token_budget is None else np.minimum(lengths, token_budget)
    if token_budget is not None and long_seqs != "truncate":
        kept = np.where(lengths > token_budget, 0, kept)
    ends = np.cumsum(lengths)
    # A token packing drops counts as unsupervised: no anchor at it, and none before it (its successor).
    supervised = mask != 0
    for start, end in zip((ends - lengths + kept)[kept < lengths].tolist(), ends[kept < lengths].tolist()):
        supervised[start:end] = False  # only the samples packing cuts: few, so a loop beats a per-token map
    return supervised, np.concatenate([[0], ends])


def _index_chunk(
    chunk,
    fi: int,
    files: list[str],
    stem: str,
    seen: dict[str, tuple[int, int]],
    ids: list[str],
    parts: dict[str, list[np.ndarray]],
    empty: list[str],
    problems: Problems,
    refuse_longer_than: tuple[int, str] | None,
) -> int:
    """Add one chunk's good rows to the index being built; returns the rows it held."""
    rows, row_ids, lengths, mask = chunk.rows, chunk.ids, chunk.lengths, chunk.mask
    file = files[fi]
    names = [f"{stem}:{r}" if i is None else str(i) for i, r in zip(row_ids, rows.tolist())]
    for name, given, row in zip(names, row_ids, rows.tolist()):
        problem = sample_id_problem(name)
        if problem is not None:
            fix = (
                "fix the row's id"
                if given is not None
                else "give the row an id, or rename the file (its name makes the id)"
            )
            problems.add(f"{row_location(file, row)}: id {problem}; {fix}")
        if name in seen:
            pf, prow = seen[name]
            problems.add(
                f"duplicate sample id {preview(name)}: {row_location(files[pf], prow)} and {row_location(file, row)}"
            )
        else:
            seen[name] = (fi, row)
    if refuse_longer_than is not None:
        limit, flag = refuse_longer_than
        for k in np.flatnonzero(lengths > limit).tolist():
            problems.add(
                f"{row_location(file, int(rows[k]))}: sample {names[k]!r} has {lengths[k]} tokens, more than "
                f"{flag[2:].replace('-', '_')} {limit}; use --long-seqs truncate or skip, or a larger {flag}"
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
    offsets = chunk.byte_offsets
    parts["offsets"].append(offsets[keep] if offsets is not None else np.full(int(keep.sum()), -1, np.int64))
    starts = ends - lengths
    crcs = [sample_crc32(chunk.tokens[a:b], mask[a:b]) for a, b, k in zip(starts, ends, keep.tolist()) if k]
    parts["crc"].append(np.array(crcs, dtype=np.uint32))
    return len(rows)


def sample_crc32(tokens: np.ndarray, mask: np.ndarray) -> int:
    """crc32 of one sample's tokens (int32 LE) and mask: a row edited in place after the scan, same
    length and id, still differs from its index entry."""
    return crc32(mask.astype(np.uint8).tobytes(), crc32(tokens.astype("<i4").tobytes()))


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
    if index.mode_ids is not None:  # only then: single-mode datasets keep the fingerprint they always had
        h.update(json.dumps(index.modes).encode() + index.mode_ids.astype("<i4").tobytes())
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
        self._parquet: dict[
            int, tuple[pq.ParquetFile, list[str], np.ndarray]
        ] = {}  # file -> (file, columns, row-group starts)
        self._cache: OrderedDict[tuple[int, int], tuple[list, np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self._id_prefixes = derived_id_prefixes(index.files)
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
                raw_id, tokens, mask = parse_json_row(f.readline(), path, row, index.vocab_size)
        sample_id = f"{self._id_prefixes[path]}:{row}" if raw_id is None else str(raw_id)
        if sample_id != index.sample_ids[i]:
            raise DataError(
                f"{row_location(path, row)}: id is {sample_id!r}, the scan found {index.sample_ids[i]!r}; "
                f"the file changed, scan it again"
            )
        if tokens.shape[0] != index.lengths[i]:
            raise DataError(
                f"{row_location(path, row)}: sample {sample_id!r} has {tokens.shape[0]} tokens, the scan found "
                f"{index.lengths[i]}; the file changed, scan it again"
            )
        if sample_crc32(tokens, mask) != int(index.sample_crc32[i]):
            raise DataError(
                f"{row_location(path, row)}: sample {sample_id!r} holds other tokens or loss mask than the scan "
                "found; the file changed after the scan: restore it and run again"
            )
        return Sample(sample_id, tokens, mask)

    def _parquet_row(self, fi: int, row: int) -> tuple[object, np.ndarray, np.ndarray]:
        """(raw id, tokens, mask) of one Parquet row, via a small LRU of parsed row groups."""
        path = self.index.files[fi]
        if fi not in self._parquet:
            pf = open_parquet(path)
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            self._parquet[fi] = (pf, parquet_columns(pf.schema_arrow, path), np.cumsum([0] + sizes))
        pf, columns, starts = self._parquet[fi]
        g = int(np.searchsorted(starts, row, side="right")) - 1
        key = (fi, g)
        if key not in self._cache:
            table = read_row_group(pf, g, path, int(starts[g]), columns)
            chunk = parquet_chunk(table, path, int(starts[g]), self.index.vocab_size)
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


def write_parquet(
    path: str | os.PathLike, samples: Iterable[Sample], with_ids: bool = True, row_group_size: int = 256
) -> None:
    """Write samples as Parquet; small row groups keep load_samples' reads per batch small."""
    samples = list(samples)
    columns = {
        "input_ids": pa.array([s.input_ids for s in samples], type=pa.list_(pa.int32())),
        "loss_mask": pa.array([s.loss_mask for s in samples], type=pa.list_(pa.uint8())),
    }
    if with_ids:
        columns = {"id": pa.array([s.sample_id for s in samples], type=pa.string()), **columns}
    # Page checksums: a damaged page is then refused by name (rows.read_row_group), never read as other tokens.
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size, write_page_checksum=True)
