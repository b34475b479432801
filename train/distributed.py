"""Data parallelism for training: one process per GPU under torchrun, gradients averaged by hand.

Every parameter's .grad is a view into one flat fp32 buffer (`FlatGrads`), so the gradient sync is a
single all_reduce of that buffer: no DDP hooks, nothing that depends on autograd's order, and it
can sit inside the captured CUDA graph (NCCL supports capture; gloo runs it eagerly on CPU).
Backward accumulates into the existing .grad views in place, which keeps their addresses fixed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from shards.common.errors import UserError
from shards.common.runtime import DistInfo, init_process_group, rank_info


def init_distributed(device_type: str) -> DistInfo:
    """Join the torchrun process group (nccl for CUDA, gloo for CPU); a lone process needs none."""
    info = rank_info()
    if info.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"timeout": timedelta(minutes=30)}
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", info.local_rank)
        init_process_group(backend, **kwargs)
    return info


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_sum_(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def same_on_every_rank(value: str, what: str, device: torch.device) -> None:
    """Refuse (UserError on every rank) a setting that each rank resolved on its own machine and that came
    out differently: a job of mixed machines would otherwise train different steps on different ranks."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    if device.type == "cuda":  # NCCL gathers the pickled values through the rank's current device
        torch.cuda.set_device(device)
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if len(set(values)) > 1:
        per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise UserError(f"{what} came out differently on the ranks ({per_rank})")


def broadcast_parameters(model: nn.Module) -> None:
    """Make every rank start from rank 0's weights (one broadcast per tensor, once)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)


class FlatGrads:
    """One contiguous gradient buffer; each parameter's .grad is a view of its slice."""

    def __init__(self, params: list[nn.Parameter]):
        numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(numel, dtype=torch.float32, device=params[0].device)
        offset = 0
        for p in params:
            if p.dtype != torch.float32:
                raise ValueError(f"FlatGrads needs fp32 master parameters, got {p.dtype}")
            p.grad = self.flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def average_across_ranks(self) -> None:
        """Mean of the ranks' gradients, in place (a no-op for one process)."""
        n = world_size()
        if n > 1:
            dist.all_reduce(self.flat, op=dist.ReduceOp.SUM)
            self.flat.div_(n)

    def zero(self) -> None:
        self.flat.zero_()
