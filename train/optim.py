"""The optimizer and the learning-rate schedule of a run: their settings (OptimConfig: dflash-train's
--lr, --warmup-ratio, --min-lr-ratio, --weight-decay, --betas, --adam-eps, --grad-clip), the schedule as a
device tensor the captured step reads, and fused AdamW with its state allocated before capture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from shards.common.cli_options import config_error


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW, its warmup-cosine schedule and the gradient clip; each field is a dflash-train option."""

    lr: float = 6e-4
    """Peak AdamW learning rate (recipe: 6e-4)."""
    warmup_ratio: float = 0.04
    """Fraction of the steps in linear warmup from 0 to --lr (recipe: 0.04)."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of --lr, reached at the last step (unless the warmup lasts to the end)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (recipe: 0)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW beta1,beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this; 0 = off."""

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # the CLI passes a list
        if not self.lr > 0:
            raise config_error(self, "lr", "must be > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise config_error(self, "warmup_ratio", "must be in [0, 1), a fraction of the steps")
        if not 0 <= self.min_lr_ratio <= 1:
            raise config_error(self, "min_lr_ratio", "must be in [0, 1], a fraction of --lr")
        if self.weight_decay < 0:
            raise config_error(self, "weight_decay", "must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise config_error(self, "betas", "must be two values in [0, 1), e.g. --betas 0.9,0.999")
        if not self.adam_eps > 0:
            raise config_error(self, "adam_eps", "must be > 0")
        if self.grad_clip < 0:
            raise config_error(self, "grad_clip", "must be >= 0 (0 = off)")

    def warmup_steps(self, total_steps: int) -> int:
        """Steps of linear warmup in a run of `total_steps`."""
        return int(math.ceil(self.warmup_ratio * total_steps))


class WarmupCosine:
    """lr(s) = lr * (s+1)/W for s < W, then min + (lr - min) * (1 + cos(pi * (s-W)/(N-1-W))) / 2.

    s is the 0-based index of the step about to run; `lr_t` always holds lr(step_t). The last step
    (s = N-1) runs at the floor min = lr * --min-lr-ratio, as its help says, whenever the warmup ends
    before it (W <= N-1; a warmup that lasts to the end leaves no cosine step).
    """

    def __init__(
        self, *, peak_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float, device: torch.device
    ):
        self.peak_lr, self.warmup_steps, self.total_steps = peak_lr, warmup_steps, total_steps
        self.min_lr = peak_lr * min_lr_ratio
        self.step_t = torch.zeros((), dtype=torch.float64, device=device)
        self.lr_t = torch.zeros((), dtype=torch.float32, device=device)
        self._refresh()

    def lr_at(self, s: torch.Tensor) -> torch.Tensor:
        warm = self.peak_lr * (s + 1) / max(self.warmup_steps, 1)
        span = self.total_steps - 1 - self.warmup_steps  # 0: the warmup ends at N-2, the last step is the floor
        progress = ((s - self.warmup_steps) / span).clamp(0, 1) if span > 0 else torch.ones_like(s)
        cosine = self.min_lr + (self.peak_lr - self.min_lr) * 0.5 * (1 + torch.cos(math.pi * progress))
        return torch.where(s < self.warmup_steps, warm, cosine)

    def host_lr(self, s: int) -> float:
        """lr of 0-based step s, computed on the host (for logs)."""
        return float(self.lr_at(torch.tensor(float(s), dtype=torch.float64)))

    def host_lrs(self, num_steps: int) -> list[float]:
        """lr of every step 1..num_steps (0-based s = step - 1), as host_lr gives each: the schedule as it ran."""
        return self.lr_at(torch.arange(num_steps, dtype=torch.float64)).tolist()

    def _refresh(self) -> None:
        self.lr_t.copy_(self.lr_at(self.step_t))

    def step(self) -> None:
        self.step_t += 1
        self._refresh()

    def set_step(self, step: int) -> None:
        self.step_t.fill_(step)
        self._refresh()


def build_optimizer(
    cfg: OptimConfig, params: list[nn.Parameter], *, warmup_steps: int, total_steps: int, device: torch.device
) -> tuple[WarmupCosine, torch.optim.AdamW]:
    """The schedule of a run of `total_steps` and the AdamW that reads its learning rate."""
    schedule = WarmupCosine(
        peak_lr=cfg.lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=cfg.min_lr_ratio, device=device
    )
    optimizer = make_optimizer(params, schedule, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    return schedule, optimizer


def make_optimizer(
    params: list[nn.Parameter], schedule: WarmupCosine, *, betas: tuple[float, float], eps: float, weight_decay: float
) -> torch.optim.AdamW:
    """Fused AdamW (graph-capturable on CUDA) reading lr from the schedule's device tensor.

    Its state is created here by one zero-lr step on zero gradients (parameters unchanged) and then
    zeroed, so every state tensor exists before capture and checkpoints can be loaded into it in place.
    """
    # capturable: step() refuses graph capture without it; the fused kernel itself is graph-safe.
    opt = torch.optim.AdamW(
        params,
        lr=schedule.lr_t,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        fused=True,
        capturable=params[0].device.type == "cuda",
    )
    saved_lr = schedule.lr_t.clone()
    schedule.lr_t.zero_()
    for p in params:
        p.grad.zero_()
    opt.step()
    for state in opt.state.values():
        for t in state.values():
            t.zero_()
    schedule.lr_t.copy_(saved_lr)
    return opt


def optimizer_state_tensors(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[torch.Tensor]:
    return [t for p in params for _, t in sorted(opt.state[p].items())]


def load_optimizer_state_(opt: torch.optim.Optimizer, params: list[nn.Parameter], saved: dict) -> None:
    """Copy a saved optimizer.state_dict() into the live state tensors (addresses kept for the graph)."""
    saved_state = saved["state"]
    if len(saved_state) != len(params):
        raise ValueError(f"optimizer state holds {len(saved_state)} parameters, the model has {len(params)}")
    for i, p in enumerate(params):
        live = opt.state[p]
        if set(saved_state[i]) != set(live):
            raise ValueError(
                f"optimizer state of parameter {i} has keys {sorted(saved_state[i])}, expected {sorted(live)}"
            )
        for key, t in live.items():
            t.copy_(saved_state[i][key])
