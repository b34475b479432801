"""One process per GPU under torchrun.

Extraction needs no collective math, only agreement on when the cache exists and when every rank is
done, so it coordinates over gloo (CPU) on every platform.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from shards.common.runtime import DistInfo, init_process_group, rank_info


def init_distributed() -> DistInfo:
    info = rank_info()
    if info.world_size > 1 and not dist.is_initialized():
        # Extraction ranks can differ in work by a batch or two of a long run: a generous timeout.
        init_process_group("gloo", timeout=timedelta(hours=6))
    return info


def run_on_main(info: DistInfo, fn: Callable[[], None]) -> None:
    """Run fn on rank 0 only; if it raises, every rank raises (instead of waiting at a barrier for hours).

    Rank 0 re-raises its own exception; the others raise a RuntimeError carrying its message.
    """
    error: BaseException | None = None
    if info.is_main:
        try:
            fn()
        except BaseException as e:  # shared with the other ranks, then re-raised
            error = e
    if info.world_size > 1 and dist.is_initialized():
        message = [f"{type(error).__name__}: {error}" if error is not None else None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is not None and error is None:
            raise RuntimeError(f"rank 0 failed: {message[0]}")
    if error is not None:
        raise error
