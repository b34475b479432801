"""The drafter's bias-free linear layer, which computes with a working copy of its weight when training
set one (train/precision.py); its own module so that model.py and dflash2.py both build on it."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from train.precision import use_working_copy


class Linear(nn.Linear):
    """nn.Linear without bias that computes with a working copy of its weight when training set one.

    weight_copy: the fp32 master weight rounded to the compute dtype (precision.WorkingWeights, refreshed
    once per step); its gradient reaches the master through use_working_copy. None = the weight itself
    (the default, and every model outside the training step)."""

    weight_copy: torch.Tensor | None = None

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_copy is None:
            return F.linear(x, self.weight)
        return F.linear(x, use_working_copy(self.weight, self.weight_copy))
