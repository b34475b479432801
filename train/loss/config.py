"""The loss settings of a run (dflash-train's --gamma, --kl-lambda, --cap-lambda, --loss-chunk-blocks,
--fused-loss): the one owner of every loss default. No torch import, so the sampler, the metrics and
the evaluation can take their defaults from here without importing the loss (train/loss/chunked.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shards.common.cli_options import at_least, cli_field, config_error


@dataclass(kw_only=True)
class LossConfig:
    """Loss weights and chunking; each field is a dflash-train option (the docstring is its --help)."""

    gamma: float = 7.0
    """Loss decay: slot k is weighted exp(-(k-1)/gamma) (recipe: 7 for block 16)."""
    kl_lambda: float = 0.0
    """Weight of KL(target || drafter) on the cache's stored target top-k; 0 = off."""
    cap_lambda: float = 0.0
    """Weight of the CAP term (minus expected accepted length / (block_size-1)); 0 = off."""
    chunk_blocks: int = cli_field(32, name="loss_chunk_blocks")
    """Blocks per LM-head chunk of the loss and metrics (memory: blocks x block size x vocab x 4 bytes
    per live copy)."""
    # A kernel choice, not a setting of the trajectory (the same loss to float32 rounding): a resume may change it.
    fused: bool = cli_field(True, name="fused_loss", identity=False)
    """Loss chunks take a hand-written gradient (train/loss/fused.py): one reduction and one pointwise
    pass over the bf16 logits (two compiled kernels on CUDA) instead of float32 log-softmax under
    autograd; the same loss and gradients to float32 rounding."""

    selector_weight: float = 1.0
    """DFlash 2: weight of the selector loss (K-way CE over each slot's top-K, teacher-forced predecessor)."""
    selector_warmup_steps: int = 0
    """DFlash 2: the selector weight ramps linearly from 1/N to its value over the first N steps; 0 = none."""
    selector_gold: Literal["drop", "swap"] = "swap"
    """DFlash 2, a slot whose gold token is outside the top-K: swap (the gold token replaces the weakest
    candidate, speculators') or drop (no selector loss there: the strict top-K, SpecForge's best served).
    swap is the default: on the acceptance testbed its drafters accepted 2.50 tokens per step against drop's
    2.08 on the held-out replies, beyond the seed spread (BENCHMARKS.md, "Acceptance by numerics choice")."""

    def __post_init__(self) -> None:
        at_least(self, 1, "chunk_blocks")
        at_least(self, 0, "selector_warmup_steps")
        if self.selector_weight < 0:
            raise config_error(self, "selector_weight", "must be >= 0 (0 = off)")
        if self.selector_gold not in ("drop", "swap"):
            raise config_error(self, "selector_gold", "must be drop or swap")
        if not self.gamma > 0:
            raise config_error(self, "gamma", "must be > 0")
        for name in ("kl_lambda", "cap_lambda"):
            if getattr(self, name) < 0:
                raise config_error(self, name, "must be >= 0 (0 = off)")
