"""Compute precision of training and evaluation, in one place.

Training keeps fp32 master weights and runs activations in bf16 under autocast (or everything in
fp32). Autocast's weight-cast cache is off: cached casts would be captured once by the CUDA graph
and go stale across replays (the weights change every step).

WorkingWeights (TrainConfig.weight_copies) replaces the per-use cast of the linear weights: one
compute-dtype copy of each, refreshed in place once per step inside the captured step, used by every
forward and recompute through `use_working_copy`, whose backward casts the gradient to the master's
dtype exactly as the backward of autocast's cast does. One autograd node per use, so a weight used
twice (each layer's k/v projections: context and block) still sums its two gradients in fp32: the
step is bitwise the autocast step (tests/train/test_fused_paths.py).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
import torch.nn as nn

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # compute dtype names -> torch dtypes


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a TrainConfig.compute_dtype value ('bfloat16' or 'float32')."""
    if name not in DTYPES:
        raise ValueError(f"compute dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def autocast_dtype(compute_dtype: torch.dtype) -> torch.dtype | None:
    """The autocast dtype over fp32 weights for this compute dtype; None = no autocast (fp32)."""
    return None if compute_dtype == torch.float32 else compute_dtype


def compute_autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager:
    """autocast to `dtype` on `device` (weight-cast cache off), or nothing when dtype is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


class _UseWorkingCopy(torch.autograd.Function):
    """Forward: the working copy itself (no kernel); backward: the gradient cast to the master's dtype."""

    @staticmethod
    def forward(ctx, master: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.master_dtype = master.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.master_dtype), None


def use_working_copy(master: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    """`copy` (== master rounded to the compute dtype) in the forward; its gradient reaches `master`."""
    return _UseWorkingCopy.apply(master, copy)


class WorkingWeights:
    """Compute-dtype working copies of the weights of `modules` (each with a `weight_copy` slot, see
    model.Linear), one flat buffer at a fixed address; refresh() rounds the masters into it in place."""

    def __init__(self, modules: list[nn.Module], dtype: torch.dtype):
        self.masters = [m.weight for m in modules]
        self.flat = torch.empty(sum(w.numel() for w in self.masters), dtype=dtype, device=self.masters[0].device)
        self.copies, offset = [], 0
        for module, w in zip(modules, self.masters):
            module.weight_copy = self.flat[offset : offset + w.numel()].view_as(w)
            self.copies.append(module.weight_copy)
            offset += w.numel()
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        for copy, master in zip(self.copies, self.masters):
            copy.copy_(master)
