"""Packing: samples into fixed-size batches of exactly token_budget tokens.

A batch holds at most max_seqs whole sequences back to back, then padding up to token_budget;
a sequence never spans two batches. The plan is made from the DatasetIndex alone (ids and lengths),
before any model loads, and is a pure function of (dataset order, lengths, PackingConfig): the same
dataset and settings give the same batches under the same batch ids on every run and every rank,
which is what makes resume exact.

Algorithm (pack_lengths), samples always taken longest first, ties in dataset order:
1. best-fit decreasing: each sample goes into the open batch with the least free space that still
   fits it, else opens a new batch; a batch closes when full or holding max_seqs sequences. Near
   optimal while max_seqs does not bind, but when it does (short samples) the shortest samples end
   up last, max_seqs to a batch, in batches that close half empty.
2. balanced fit, searched: for a number of batches B between the lower bound
   ceil(max(tokens / token_budget, samples / max_seqs)) and best fit's count, put each sample into
   the least-loaded of B batches (longest-processing-time scheduling), which spreads short samples
   over all batches; B is binary-searched for the smallest that fits.
The fewer batches win (best fit on a tie). Batch ids follow the batch order of the winning method;
inside a batch, samples are in dataset order.

Long samples (longer than token_budget, at most max_seq_len): each goes through the target whole, alone,
and is stored as pieces of exactly token_budget tokens, one batch each, after the packed batches
(plan_pieces; shards/format.py describes the layout). A piece holds `piece_context` tokens before its own
part and `piece_label_reach` after it; the own parts tile the sample, the first starting at 0 and the
last ending at the sample's end (the last piece takes more context instead of padding).

One packed batch as arrays (assemble_batch, or assemble_piece for a piece), T = token_budget, S = max_seqs,
n = samples in it:
    input_ids     [T]      int32   tokens, pad_token_id on padding
    position_ids  [T]      int32   0, 1, ... restarting at every sequence (a piece: its absolute positions); 0 on padding
    loss_mask     [T]      uint8   sample's loss mask; 0 on padding
    anchor_mask   [T]      uint8   1 on every real token (a piece: on its own part only); 0 on padding
    cu_seqlens    [S + 1]  int32   sequence boundaries, padded by repeating the real-token total
    sample_offsets, sample_lengths, sample_loss_tokens   [n] int64 (per sample, for the manifest)
"""

from __future__ import annotations

import heapq
import logging
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from extract.dataset.index import LONG_SEQ_POLICIES, DatasetIndex, LongSeqPolicy, Sample, SampleLoader

logger = logging.getLogger(__name__)

# Names the packing algorithm for cache.json: a change of algorithm changes batch ids, so a cache
# made by another version must not be resumed with this one.
PACKING_ALGORITHM = "bfd+balanced-search/1"
# The published DFlash 2 drafters' sliding window: the context a piece keeps for its first anchors.
PUBLISHED_SLIDING_WINDOW = 2048


@dataclass(kw_only=True)
class PackingConfig:
    """How samples are packed into batches; recorded in the cache (a change means a new plan)."""

    token_budget: int = 49152  # tokens per batch, real plus padding (the shard's T)
    # Most sequences per batch (cu_seqlens has max_seqs + 1 entries). Fill is capped at
    # max_seqs * mean_length / token_budget: 128 leaves full batches down to a mean sample length of
    # 384 tokens at the default budget (chat data with a ~1.5K median packs ~25-35 per batch).
    max_seqs: int = 128
    # Samples longer than token_budget: "truncate" keeps the first token_budget tokens, "skip" drops
    # the sample, "error" refuses the dataset; truncated and skipped samples are counted in the plan.
    long_seqs: LongSeqPolicy = "truncate"
    pad_token_id: int = 0  # token id written on padding positions
    # Longest sample run through the target whole and stored as pieces (longer ones follow long_seqs
    # at this length); None = token_budget: no pieces, every sample fits one batch.
    max_seq_len: int | None = None
    # Tokens a piece holds before its own part: a drafter whose layers all slide with a window up to this
    # sees in a piece all it sees in the whole sample (it needs window - 1).
    piece_context: int = PUBLISHED_SLIDING_WINDOW
    # Tokens a piece holds after its own part: the labels of a block of piece_label_reach + 1 tokens.
    piece_label_reach: int = 15

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PackingConfig.{name} must be a positive integer, got {value!r}")
        if self.long_seqs not in LONG_SEQ_POLICIES:
            raise ValueError(f"PackingConfig.long_seqs must be one of {LONG_SEQ_POLICIES}, got {self.long_seqs!r}")
        if isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, int) or self.pad_token_id < 0:
            raise ValueError(f"PackingConfig.pad_token_id must be a non-negative integer, got {self.pad_token_id!r}")
        if self.max_seq_len is not None and self.max_seq_len < self.token_budget:
            raise ValueError(
                f"PackingConfig.max_seq_len {self.max_seq_len} must be >= token_budget {self.token_budget}"
            )
        if min(self.piece_context, self.piece_label_reach) < 0:
            raise ValueError("PackingConfig.piece_context and piece_label_reach must be >= 0")
        if self.pieced and self.piece_context + self.piece_label_reach >= self.token_budget:
            raise ValueError(
                f"PackingConfig.piece_context {self.piece_context} + piece_label_reach {self.piece_label_reach} "
                f"leave no own part in a piece of token_budget {self.token_budget}"
            )

    @property
    def longest(self) -> int:
        """Tokens of the longest sample kept whole; long_seqs applies past it."""
        return self.max_seq_len or self.token_budget

    @property
    def pieced(self) -> bool:
        """Whether samples longer than token_budget are stored as pieces."""
        return self.longest > self.token_budget


@dataclass(frozen=True)
class Piece:
    """One token_budget-long piece of a long sample: tokens [start, start + token_budget), of which
    [own_start, own_end) may hold anchors; positions are the sample's (absolute)."""

    start: int
    own_start: int
    own_end: int
    first_batch: int  # batch id of the sample's first piece: its pieces go to one rank, one forward


def plan_pieces(length: int, cfg: PackingConfig, first_batch: int) -> list[Piece]:
    """The pieces of a sample of `length` > token_budget tokens: own parts tile [0, length)."""
    T, context, reach = cfg.token_budget, cfg.piece_context, cfg.piece_label_reach
    pieces, own_start = [], 0
    while own_start < length:
        start = max(0, own_start - context)
        if start + T >= length:  # the last piece: ends at the sample's end, more context instead of padding
            pieces.append(Piece(length - T, own_start, length, first_batch))
            break
        own_end = start + T - reach
        pieces.append(Piece(start, own_start, own_end, first_batch))
        own_start = own_end
    return pieces


@dataclass
class PackedBatch:
    """The samples of one batch, in packing order (their offsets follow from the lengths)."""

    batch_id: int
    rows: list[int]  # positions in the DatasetIndex, for load_samples / SampleLoader.load
    sample_ids: list[str]
    lengths: list[int]  # tokens packed per sample (after any truncation); a piece: token_budget
    piece: Piece | None = None  # set when the batch is one piece of a long sample (its only sample)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class PackingPlan:
    """All batches of a dataset, plus what packing did to samples that did not fit as they were."""

    config: PackingConfig
    batches: list[PackedBatch]
    num_samples: int  # samples packed (truncated ones included)
    num_tokens: int  # real tokens packed
    num_truncated: int  # samples cut to token_budget (long_seqs="truncate")
    num_truncated_tokens: int  # tokens cut off those samples
    num_skipped: int  # samples dropped for being longer than token_budget (long_seqs="skip")
    num_skipped_tokens: int  # tokens of the dropped samples
    num_empty: int  # empty samples the scan skipped (never packed)
    num_pieced: int = 0  # samples longer than token_budget stored as pieces (their tokens counted per piece)
    longest_packed: int = 0  # tokens of the longest sample kept (after truncation)

    @property
    def padding_efficiency(self) -> float:
        """Real tokens / (batches * token_budget); 0.0 for an empty plan."""
        capacity = len(self.batches) * self.config.token_budget
        return self.num_tokens / capacity if capacity else 0.0

    def summary(self) -> str:
        c = self.config
        return (
            f"{self.num_samples} samples, {self.num_tokens} tokens in {len(self.batches)} batches of "
            f"{c.token_budget} tokens (max {c.max_seqs} seqs): padding efficiency {self.padding_efficiency:.2%}; "
            f"{self.num_pieced} long kept whole in pieces, {self.num_truncated} truncated (-{self.num_truncated_tokens} "
            f"tokens), {self.num_skipped} long skipped (-{self.num_skipped_tokens} tokens), {self.num_empty} empty skipped"
        )


def best_fit_decreasing(lengths: np.ndarray, *, token_budget: int, max_seqs: int) -> list[list[int]]:
    """Bins of positions into `lengths` (each <= token_budget), in the order the bins were opened.

    Open bins are kept in buckets by free space, with a sorted list of the free-space values that
    have a bucket, so finding the tightest bin is one bisect: O(N log B) for N items, B <= budget.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > token_budget):
        raise ValueError(f"lengths must lie in [1, {token_budget}], found [{lengths.min()}, {lengths.max()}]")
    order = np.argsort(-lengths, kind="stable")  # longest first; stable keeps dataset order on ties
    bins: list[list[int]] = []
    buckets: dict[int, list[int]] = {}  # free tokens -> open bins with exactly that much free
    free_values: list[int] = []  # sorted keys of buckets
    for i, length in zip(order.tolist(), lengths[order].tolist()):
        k = bisect_left(free_values, length)
        if k == len(free_values):
            b, free = len(bins), token_budget
            bins.append([])
        else:
            free = free_values[k]
            bucket = buckets[free]
            b = bucket.pop()
            if not bucket:
                del buckets[free]
                del free_values[k]
        bins[b].append(i)
        free -= length
        if free > 0 and len(bins[b]) < max_seqs:  # otherwise the bin is closed for good
            if free in buckets:
                buckets[free].append(b)
            else:
                buckets[free] = [b]
                insort(free_values, free)
    return bins


def balanced_fit(lengths: np.ndarray, *, num_bins: int, token_budget: int, max_seqs: int) -> list[list[int]] | None:
    """Longest first, each item into the least-loaded of num_bins bins; None when one does not fit."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    # Heap of bins below max_seqs keyed by load << 32 | bin: one int per entry (faster than tuples);
    # equal loads go to the lower bin.
    heap = list(range(num_bins))
    mask = (1 << 32) - 1
    for i, length in zip(order.tolist(), lengths[order].tolist()):
        if not heap:
            return None
        key = heap[0]
        if (key >> 32) + length > token_budget:
            return None  # the least-loaded bin cannot take it, so none can
        b = key & mask
        bins[b].append(i)
        if len(bins[b]) == max_seqs:
            heapq.heappop(heap)
        else:
            heapq.heapreplace(heap, key + (length << 32))
    return bins


def pack_lengths(lengths: np.ndarray, *, token_budget: int, max_seqs: int) -> list[list[int]]:
    """Bins of positions into `lengths` (each in [1, token_budget]): the fewer of best fit and balanced fit."""
    lengths = np.asarray(lengths, dtype=np.int64)
    best = best_fit_decreasing(lengths, token_budget=token_budget, max_seqs=max_seqs)
    lo = int(max(-(-int(lengths.sum()) // token_budget), -(-lengths.size // max_seqs)))  # no packing needs fewer
    hi = len(best)  # best fit already achieves this many
    while lo < hi:
        mid = (lo + hi) // 2
        bins = balanced_fit(lengths, num_bins=mid, token_budget=token_budget, max_seqs=max_seqs)
        if bins is None:
            lo = mid + 1
        else:
            best, hi = bins, mid
    return best


def plan_batches(index: DatasetIndex, cfg: PackingConfig) -> PackingPlan:
    """Pack every sample of `index` into batches, the long ones' pieces after them; raises ValueError on
    a sample longer than cfg.longest under "error"."""
    lengths = index.lengths.astype(np.int64)
    long = lengths > cfg.longest
    if long.any() and cfg.long_seqs == "error":
        i = int(np.argmax(long))
        more = "--max-seq-len" if cfg.pieced else "--token-budget (or --max-seq-len to keep it whole in pieces)"
        raise ValueError(
            f"sample {index.sample_ids[i]!r} ({index.location(i)}) has {lengths[i]} tokens, more than "
            f"{'max_seq_len' if cfg.pieced else 'token_budget'} {cfg.longest}; use --long-seqs truncate or skip, "
            f"or a larger {more}"
        )
    keep = ~long if cfg.long_seqs == "skip" else np.ones_like(long)
    packed = np.minimum(lengths, cfg.longest)  # truncation keeps the first `longest` tokens
    pieced = keep & (packed > cfg.token_budget)
    positions = np.flatnonzero(keep & ~pieced)
    bins = pack_lengths(packed[positions], token_budget=cfg.token_budget, max_seqs=cfg.max_seqs)
    batches = []
    for batch_id, members in enumerate(bins):
        rows = sorted(positions[members].tolist())  # dataset order inside a batch
        batches.append(
            PackedBatch(
                batch_id=batch_id,
                rows=rows,
                sample_ids=[index.sample_ids[r] for r in rows],
                lengths=packed[rows].tolist(),
            )
        )
    for row in np.flatnonzero(pieced).tolist():
        for piece in plan_pieces(int(packed[row]), cfg, first_batch=len(batches)):
            batches.append(PackedBatch(len(batches), [row], [index.sample_ids[row]], [cfg.token_budget], piece=piece))
    truncated = long & keep
    skipped = long & ~keep
    plan = PackingPlan(
        config=cfg,
        batches=batches,
        num_samples=int(keep.sum()),
        num_tokens=sum(b.num_tokens for b in batches),
        num_truncated=int(truncated.sum()),
        num_truncated_tokens=int((lengths - packed)[truncated].sum()),
        num_skipped=int(skipped.sum()),
        num_skipped_tokens=int(lengths[skipped].sum()),
        num_empty=index.report.num_empty,
        num_pieced=int(pieced.sum()),
        longest_packed=int(packed[keep].max()) if keep.any() else 0,
    )
    logger.info("packing plan: %s", plan.summary())
    return plan


def assemble_batch(samples: Sequence[Sample], cfg: PackingConfig) -> dict[str, np.ndarray]:
    """The fixed-shape arrays of one packed batch (see the module docstring), samples in the order given.

    Samples longer than token_budget are cut to their first token_budget tokens under
    long_seqs="truncate" and refused otherwise (the plan should have skipped or refused them).
    """
    T, S = cfg.token_budget, cfg.max_seqs
    if len(samples) > S:
        raise ValueError(f"{len(samples)} samples exceed max_seqs {S}")
    for s in samples:
        if len(s) > T and cfg.long_seqs != "truncate":
            raise ValueError(
                f"sample {s.sample_id!r} has {len(s)} tokens, more than token_budget {T} (long_seqs={cfg.long_seqs!r})"
            )
    lengths = np.array([min(len(s), T) for s in samples], dtype=np.int64)  # [n]
    total = int(lengths.sum())
    if total > T:
        ids = [s.sample_id for s in samples]
        raise ValueError(f"samples {ids} hold {total} tokens, more than token_budget {T}")
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(samples) else lengths
    input_ids = np.full(T, cfg.pad_token_id, dtype=np.int32)  # [T]
    loss_mask = np.zeros(T, dtype=np.uint8)  # [T]
    for s, start, n in zip(samples, offsets.tolist(), lengths.tolist()):
        input_ids[start : start + n] = s.input_ids[:n]
        loss_mask[start : start + n] = s.loss_mask[:n]
    position_ids = np.zeros(T, dtype=np.int32)  # [T]
    # Position of token t of the sample starting at o is t - o.
    position_ids[:total] = np.arange(total) - np.repeat(offsets, lengths)
    cu_seqlens = np.full(S + 1, total, dtype=np.int32)  # [S + 1]
    cu_seqlens[: len(samples) + 1] = np.concatenate([[0], np.cumsum(lengths)])
    anchor_mask = (np.arange(T) < total).astype(np.uint8)  # [T]
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
        "anchor_mask": anchor_mask,
        "cu_seqlens": cu_seqlens,
        "sample_offsets": offsets,
        "sample_lengths": lengths,
        "sample_loss_tokens": np.array(
            [int(loss_mask[o : o + n].sum()) for o, n in zip(offsets, lengths)], dtype=np.int64
        ),
    }


def load_batch(loader: SampleLoader, batch: PackedBatch, cfg: PackingConfig) -> dict[str, np.ndarray]:
    """Load the samples of `batch` and assemble them; checks ids and lengths against the plan."""
    samples = loader.load(batch.rows)
    got = [(s.sample_id, min(len(s), cfg.token_budget)) for s in samples]
    want = list(zip(batch.sample_ids, batch.lengths))
    if got != want:
        raise ValueError(f"batch {batch.batch_id}: loaded samples {got} differ from the plan's {want}; plan again")
    return assemble_batch(samples, cfg)


def load_long_sample(loader: SampleLoader, batch: PackedBatch, cfg: PackingConfig) -> Sample:
    """The whole sample a piece batch was cut from (its first cfg.longest tokens); checked against the plan."""
    (sample,) = loader.load(batch.rows)
    if sample.sample_id != batch.sample_ids[0] or len(sample) < batch.piece.start + cfg.token_budget:
        raise ValueError(
            f"batch {batch.batch_id}: loaded sample {sample.sample_id!r} of {len(sample)} tokens, the plan's piece "
            f"of {batch.sample_ids[0]!r} ends at {batch.piece.start + cfg.token_budget}; plan again"
        )
    n = min(len(sample), cfg.longest)
    return Sample(sample.sample_id, sample.input_ids[:n], sample.loss_mask[:n])


def assemble_piece(sample: Sample, piece: Piece, cfg: PackingConfig) -> dict[str, np.ndarray]:
    """The fixed-shape arrays of one piece of `sample` (as assemble_batch's, for one sequence of T tokens)."""
    T, start = cfg.token_budget, piece.start
    loss_mask = np.asarray(sample.loss_mask[start : start + T], dtype=np.uint8)
    anchor_mask = np.zeros(T, dtype=np.uint8)
    anchor_mask[piece.own_start - start : piece.own_end - start] = 1
    cu_seqlens = np.full(cfg.max_seqs + 1, T, dtype=np.int32)
    cu_seqlens[0] = 0
    return {
        "input_ids": np.asarray(sample.input_ids[start : start + T], dtype=np.int32),
        "position_ids": np.arange(start, start + T, dtype=np.int32),  # absolute: RoPE sees the true positions
        "loss_mask": loss_mask,
        "anchor_mask": anchor_mask,
        "cu_seqlens": cu_seqlens,
        "sample_offsets": np.zeros(1, dtype=np.int64),
        "sample_lengths": np.full(1, T, dtype=np.int64),
        "sample_loss_tokens": np.full(1, int(loss_mask.sum()), dtype=np.int64),
    }


def shard_batches_for_rank(plan: PackingPlan, rank: int, world_size: int) -> list[PackedBatch]:
    """This rank's batches: batch b goes to rank b % world_size (disjoint, together complete); the pieces
    of a long sample all go where its first piece goes, so one forward serves them."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} must lie in [0, world_size) with world_size >= 1, got world_size {world_size}")
    return [b for b in plan.batches if (b.piece.first_batch if b.piece else b.batch_id) % world_size == rank]
