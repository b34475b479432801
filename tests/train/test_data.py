"""The loop's data walk (train/data.py): this rank's shards in epoch order from a resume point, each
skipped shard either carried to the next batch (one process) or replaced by a stand-in step (ranks)."""

from __future__ import annotations

import pytest

from shards import ShardReader, epoch_shard_order
from shards.format import shard_path
from tests.helpers.train import tiny_cache
from train.data import rank_batches


def walk(cache, *, world_size=1, rank=0, epoch=0, cursor=0, epochs=2):
    """(epoch, cursor, batch id or None, skipped ids, end) per batch, releasing each shard as the loop does."""
    out = []
    for b in rank_batches(
        ShardReader(cache),
        list(range(6)),
        epoch=epoch,
        cursor=cursor,
        epochs=epochs,
        seed=5,
        rank=rank,
        world_size=world_size,
        num_buffers=2,
        pin_memory=False,
        verify_checksum=True,
        skip_bad_shards=True,
    ):
        out.append((b.epoch, b.cursor, None if b.shard is None else b.shard.batch_id, [i for i, _ in b.skipped], b.end))
        if b.shard is not None:
            assert b.num_tokens == b.shard.info.num_tokens > 0
            b.shard.release()
    return out


@pytest.mark.parametrize("world_size,rank", [(1, 0), (2, 1)])
def test_walk_follows_the_epoch_order_from_the_cursor(tmp_path, world_size, rank):
    cache = tiny_cache(tmp_path / "cache", num_batches=6)
    orders = [epoch_shard_order(list(range(6)), e, 5, rank, world_size) for e in range(3)]
    want = [(1, c + 1, orders[1][c], [], False) for c in range(1, len(orders[1]))]
    want += [(2, c + 1, orders[2][c], [], False) for c in range(len(orders[2]))]
    assert walk(cache, world_size=world_size, rank=rank, epoch=1, cursor=1, epochs=3) == want + [(3, 0, None, [], True)]


def test_skipped_shards_cost_no_step_alone_and_a_stand_in_step_under_ranks(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=6)
    order = epoch_shard_order(list(range(6)), 0, 5, 0, 1)
    bad_first, bad_last = order[1], order[-1]  # one inside the epoch, one at its end
    shard_path(cache, bad_first).unlink()
    shard_path(cache, bad_last).unlink()
    alone = walk(cache, epochs=1)
    assert alone == (
        [(0, 1, order[0], [], False), (0, 3, order[2], [bad_first], False)]
        + [(0, c + 1, order[c], [], False) for c in range(3, 5)]
        + [(1, 0, None, [bad_last], True)]
    )

    ranked = walk(cache, world_size=2, rank=0, epochs=1)
    order2 = epoch_shard_order(list(range(6)), 0, 5, 0, 2)
    bad = {bad_first, bad_last}
    want = [(0, c + 1, None if b in bad else b, [b] if b in bad else [], False) for c, b in enumerate(order2)]
    assert ranked == want + [(1, 0, None, [], True)], "every shard of the order is one step on every rank"
