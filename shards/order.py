"""Which shards each training rank reads in each epoch."""

from __future__ import annotations

import random


def epoch_shard_order(batch_ids: list[int], epoch: int, seed: int, rank: int = 0, world_size: int = 1) -> list[int]:
    """This rank's shards for `epoch`: one shuffle of all shards per (seed, epoch), dealt round-robin.

    Every rank gets the same number of shards (the last len % world_size of the shuffle are left out of
    this epoch; a different set each epoch), because ranks that run different step counts hang DDP.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    order = sorted(batch_ids)
    random.Random(f"{seed}:{epoch}").shuffle(order)
    per_rank = len(order) // world_size
    return order[rank : per_rank * world_size : world_size]
