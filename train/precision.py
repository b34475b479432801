"""Compute precision of training and evaluation, in one place.

Training keeps fp32 master weights and runs activations in bf16 under autocast (or everything in
fp32). Autocast's weight-cast cache is off: cached casts would be captured once by the CUDA graph
and go stale across replays (the weights change every step).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

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
