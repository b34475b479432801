"""One process per GPU under torchrun.

Extraction needs no collective math, only agreement on when the cache exists and when every rank is
done, so it coordinates over gloo (CPU) on every platform.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from shards.runtime import DistInfo, rank_info


def init_distributed() -> DistInfo:
    info = rank_info()
    if info.world_size > 1 and not dist.is_initialized():
        # Extraction ranks can differ in work by a batch or two of a long run: a generous timeout.
        dist.init_process_group("gloo", timeout=timedelta(hours=6))
    return info
