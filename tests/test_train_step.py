"""The step's pieces: the on-device warmup-cosine schedule against a float64 loop, and the optimizer
set-up that must leave the weights untouched."""
from __future__ import annotations

import math

import pytest
import torch

from train.step import WarmupCosine, make_optimizer


def naive_lr(s: int, peak: float, warmup: int, total: int, floor: float) -> float:
    if s < warmup:
        return peak * (s + 1) / warmup
    progress = min(max((s - warmup) / max(total - warmup, 1), 0.0), 1.0)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("warmup,total,floor_ratio", [(4, 100, 0.0), (0, 10, 0.1), (3, 3, 0.0), (40, 1000, 0.05)])
def test_schedule_matches_naive_formula_step_by_step(warmup, total, floor_ratio):
    sched = WarmupCosine(peak_lr=6e-4, warmup_steps=warmup, total_steps=total, min_lr_ratio=floor_ratio,
                         device=torch.device("cpu"))
    worst = 0.0
    for s in range(total + 2):
        want = naive_lr(s, 6e-4, warmup, total, 6e-4 * floor_ratio)
        worst = max(worst, abs(float(sched.lr_t) - want), abs(sched.host_lr(s) - want))
        sched.step()
    assert worst <= 1e-9, f"max abs lr diff {worst}"
    sched.set_step(warmup)
    assert float(sched.lr_t) == pytest.approx(naive_lr(warmup, 6e-4, warmup, total, 6e-4 * floor_ratio), abs=1e-9)


def test_make_optimizer_leaves_weights_unchanged_and_state_zero():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.zeros_like(p)
    before = [p.detach().clone() for p in params]
    sched = WarmupCosine(peak_lr=1e-3, warmup_steps=2, total_steps=10, min_lr_ratio=0.0, device=torch.device("cpu"))
    opt = make_optimizer(params, sched, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert float(sched.lr_t) == pytest.approx(5e-4)
    for p in params:
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(float(t.abs().sum()) == 0 for t in opt.state[p].values())
