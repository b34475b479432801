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
from bisect import bisect_left
from pathlib import Path

from shards import CacheConfig, ShardReader
from shards.common.errors import UserError
from shards.manifest import header_rows, pieced_samples

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
    spans = _long_sample_spans(all_ids, cache_cfg, cache)
    cut = next(((sample_id, lo, hi) for sample_id, (lo, hi) in spans.items() if lo < requested < hi), None)
    if cut is None:
        return all_ids[:requested], all_ids[requested:]
    inside = {k for lo, hi in spans.values() for k in range(lo + 1, hi)}
    usable = [k for k in range(1, len(all_ids)) if k not in inside]  # both sides keep a shard
    sample_id, lo, hi = cut
    where = (
        f"{asked} would split long sample {sample_id!r} (shards {all_ids[lo]}..{all_ids[hi - 1]}, stored as "
        f"{hi - lo} pieces) between training and held-out"
    )
    if not usable and keep_training:
        raise UserError(
            f"{where}, and cache {cache} is that one sample's pieces: no split leaves whole samples on both "
            "sides; pass --eval-shards 0 (no held-out set) and evaluate on a cache of other samples "
            "(dflash-train eval --cache)"
        )
    # Nearest the count asked; on a tie the smaller boundary: the sample held out whole.
    boundary = min(usable, key=lambda k: (abs(k - requested), k)) if usable else 0
    log.warning(
        "%s: holding out %d shards instead of %d, so that held-out samples are whole and never trained on",
        where,
        len(all_ids) - boundary,
        num_held_out,
    )
    return all_ids[:boundary], all_ids[boundary:]


def _long_sample_spans(all_ids: list[int], cache_cfg: CacheConfig, cache: str | Path) -> dict[str, tuple[int, int]]:
    """Each long sample's [first, last + 1) indices into all_ids, from the shard headers (nothing to read
    for a cache without pieces). A sample's pieces are consecutive batch ids, so a shard missing between
    two of its pieces is counted as one of them."""
    pieces = cache_cfg.pieces
    if pieces is None or pieces.num_pieced_samples == 0:
        return {}
    # An unreadable header names no sample: training refuses or skips (--skip-bad-shards) that shard itself.
    batches = pieced_samples(header_rows(ShardReader(cache), skip_unreadable=True))
    return {
        sample_id: (bisect_left(all_ids, ids[0]), bisect_left(all_ids, ids[-1]) + 1)
        for sample_id, ids in batches.items()
    }
