"""This rank's batches, epoch after epoch, from a resume point: what the loop trains on each step.

`rank_batches` walks epoch_shard_order(train_ids, epoch, seed, rank, world_size) from (epoch,
cursor), reads ahead on a ShardLoader thread (one per epoch) and yields one `Batch` per step. It only
reads the host side; the loop copies a batch to the device, counts its tokens and times the wait.

Shards refused by the loader (--skip-bad-shards) travel on the next Batch as `skipped`. Under one
process a skipped shard costs no step. Under several ranks each one becomes a stand-in Batch
(shard None: one more step on the batch already in the device buffers, with fresh anchors), so all
ranks keep the same step count (ranks that fall out of step hang the all-reduce). The last Batch
has `end` set: every epoch is used up (it may still carry skipped shards of the last epoch).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from shards import LoadedShard, ShardLoader, ShardReader, epoch_shard_order


@dataclass
class Batch:
    """One step's input as the loop receives it (host side)."""

    epoch: int  # epoch of this step (after the last epoch: the number of epochs)
    cursor: int  # shards of this epoch's order consumed once this step has run (the resume cursor)
    shard: LoadedShard | None  # host buffers to copy to the device; None = a stand-in or the end
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (batch id, reason) refused just before
    end: bool = False  # no more steps: every epoch is used up

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens this step adds to the count: 0 for a stand-in."""
        return 0 if self.shard is None else self.shard.info.num_tokens


def rank_batches(
    reader: ShardReader,
    train_ids: list[int],
    *,
    epoch: int,
    cursor: int,
    epochs: int,
    seed: int,
    rank: int,
    world_size: int,
    num_buffers: int,
    pin_memory: bool,
    verify_checksum: bool,
    skip_bad_shards: bool,
) -> Iterator[Batch]:
    """Batches from shard `cursor` of epoch `epoch` to the end of epoch `epochs - 1`, then an end Batch."""
    skipped: list[tuple[int, str]] = []
    for epoch in range(epoch, epochs):  # noqa: B020 (from the resumed epoch on)
        order = epoch_shard_order(train_ids, epoch, seed, rank, world_size)
        position_of = {batch_id: i for i, batch_id in enumerate(order)}
        loader = ShardLoader(
            reader,
            order[cursor:],
            num_buffers=num_buffers,
            pin_memory=pin_memory,
            verify_checksum=verify_checksum,
            skip_bad_shards=skip_bad_shards,
        )
        try:
            for shard in itertools.chain(loader, [None]):  # None: the epoch's shards are used up
                position = len(order) if shard is None else position_of[shard.batch_id]
                for missing in range(cursor, position):  # refused by the loader: its reason is recorded
                    reason = next((r for b, r in loader.skipped if b == order[missing]), "unreadable")
                    skipped.append((order[missing], reason))
                    if world_size > 1:
                        yield Batch(epoch, missing + 1, None, skipped)
                        skipped = []
                if shard is not None:
                    yield Batch(epoch, position + 1, shard, skipped)
                    skipped = []
                cursor = position + 1
        finally:
            loader.close()
        cursor = 0
    yield Batch(epochs, 0, None, skipped, end=True)
