"""Background shard loading into reusable (pinned) host buffers.

The thread only reads files and copies bytes into host memory: it never touches the GPU, so the
trainer's CUDA graphs replay undisturbed. The consumer copies a buffer to the device and then calls
`release()`, handing the buffer back for the next read.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from shards.reader import ShardError, ShardInfo, ShardReader, allocate_shard_buffers

log = logging.getLogger(__name__)


@dataclass
class LoadedShard:
    batch_id: int
    tensors: dict[str, torch.Tensor]  # host buffers; valid until release()
    info: ShardInfo
    release: Callable[[], None]


class ShardLoader:
    """Iterate over `batch_ids` in order, reading ahead `num_buffers - 1` shards on one thread.

    skip_bad_shards: a shard that fails its checks is skipped and counted in `skipped` (with the reason
    logged) instead of stopping the run.
    """

    def __init__(
        self,
        reader: ShardReader,
        batch_ids: list[int],
        num_buffers: int = 2,
        pin_memory: bool = False,
        verify_checksum: bool = False,
        skip_bad_shards: bool = False,
    ):
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {num_buffers}")
        self.reader = reader
        self.batch_ids = list(batch_ids)
        self.verify_checksum = verify_checksum
        self.skip_bad_shards = skip_bad_shards
        self.skipped: list[tuple[int, str]] = []
        self._free: queue.Queue = queue.Queue()
        for _ in range(num_buffers):
            self._free.put(allocate_shard_buffers(reader.config, pin_memory=pin_memory))
        self._ready: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-loader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for batch_id in self.batch_ids:
                buffers = self._free.get()
                if self._stop.is_set():
                    return
                try:
                    tensors, info = self.reader.read(batch_id, out=buffers, verify_checksum=self.verify_checksum)
                except ShardError as e:
                    self._free.put(buffers)
                    if not self.skip_bad_shards:
                        raise
                    log.warning("skipping bad shard (%s)", e)
                    self.skipped.append((batch_id, str(e)))
                    continue
                self._ready.put(LoadedShard(batch_id, tensors, info, lambda b=buffers: self._free.put(b)))
            self._ready.put(None)
        except BaseException as e:  # handed to the consumer, who raises it with the shard's name
            self._ready.put(e)

    def __iter__(self) -> Iterator[LoadedShard]:
        while True:
            item = self._ready.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        self._free.put(None)  # wake the thread if it waits for a buffer
        self._thread.join(timeout=10)
