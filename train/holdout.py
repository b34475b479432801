"""The held-out split of a cache's shards, on a sample boundary: training's --eval-shards and
`dflash-train eval`'s --eval-shards / --holdout-frac both take the last shards, through this one function.

A long sample stored as pieces (cache.json "pieces") fills consecutive shards at the end of the plan, and
its pieces share their context overlap: a split between two of them would train on states the held-out
figures then read. So a boundary that falls inside such a sample moves to whichever of its two ends keeps
the held-out count nearest the one asked (on a tie, the sample is held out whole), never leaving the
held-out side empty nor, for training, the training side; a cache without long samples splits as asked.
"""

from __future__ import annotations

import logging
from pathlib import Path

from shards import CacheConfig, ShardError, ShardReader
from shards.common.errors import UserError

log = logging.getLogger(__name__)


def split_held_out(
    all_ids: list[int],
    num_held_out: int,
    cache_cfg: CacheConfig,
    cache: str | Path,
    *,
    asked: str,
    keep_training: bool,
) -> tuple[list[int], list[int]]:
    """(training ids, held-out ids) of the ascending planned ids: the last num_held_out (>= 1), the split
    moved to a sample boundary when it would cut a long sample. asked: the flag and value that chose
    num_held_out, for the messages. keep_training: training must keep a shard (dflash-train train); else
    (dflash-train eval) holding out the whole cache is the answer of last resort. Raises UserError when
    no boundary leaves both sides some shards."""
    requested = len(all_ids) - num_held_out
    pieces = cache_cfg.pieces
    cut = None
    if pieces is not None and pieces.num_pieced_samples > 0 and 0 < requested < len(all_ids):
        cut = _long_sample_across(ShardReader(cache), all_ids, requested)
    if cut is None:
        return all_ids[:requested], all_ids[requested:]
    sample_id, lo, hi = cut
    where = (
        f"{asked} would split long sample {sample_id!r} (shards {all_ids[lo]}..{all_ids[hi - 1]}, stored as "
        f"{hi - lo} pieces) between training and held-out"
    )
    # Its two ends, where both sides keep a shard; nearest the count asked, on a tie the sample held out whole.
    ends = [k for k in (lo, hi) if 0 < k < len(all_ids)]
    if not ends and keep_training:
        raise UserError(
            f"{where}, and cache {cache} is that one sample's pieces: no split leaves whole samples on both "
            "sides; pass --eval-shards 0 (no held-out set) and evaluate on a cache of other samples "
            "(dflash-train eval --cache)"
        )
    boundary = min(ends, key=lambda k: (abs(k - requested), k)) if ends else 0
    log.warning(
        "%s: holding out %d shards instead of %d, so that held-out samples are whole and never trained on",
        where,
        len(all_ids) - boundary,
        num_held_out,
    )
    return all_ids[:boundary], all_ids[boundary:]


def _long_sample_across(reader: ShardReader, all_ids: list[int], boundary: int) -> tuple[str, int, int] | None:
    """(sample id, first, last + 1) indices into all_ids of the long sample with pieces on both sides of
    all_ids[:boundary] | all_ids[boundary:], else None; from the headers of the shards around it only. A
    shard whose header cannot be read (one --skip-bad-shards skips) between two pieces of a sample is one
    of its pieces, as a sample's pieces have consecutive batch ids."""
    before = _next_readable(reader, all_ids, range(boundary - 1, -1, -1))
    after = _next_readable(reader, all_ids, range(boundary, len(all_ids)))
    if before is None or after is None or before[1] is None or before[1] != after[1]:
        return None
    sample_id = before[1]
    lo, hi = before[0], after[0] + 1
    while (found := _next_readable(reader, all_ids, range(lo - 1, -1, -1))) and found[1] == sample_id:
        lo = found[0]
    while (found := _next_readable(reader, all_ids, range(hi, len(all_ids)))) and found[1] == sample_id:
        hi = found[0] + 1
    return sample_id, lo, hi


def _next_readable(reader: ShardReader, all_ids: list[int], indices: range) -> tuple[int, str | None] | None:
    """(index, the sample id a piece holds, None for a shard of whole samples) of the first shard in
    `indices` whose header reads; None when none does."""
    for i in indices:
        try:
            samples = reader.info(all_ids[i]).samples
        except ShardError:
            continue
        # A piece is its sample's only entry, T tokens long; a lone whole sample's id is in no other shard.
        return i, samples[0].sample_id if len(samples) == 1 else None
    return None
