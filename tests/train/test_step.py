"""The step's pieces: the on-device warmup-cosine schedule against a float64 loop, and the optimizer
set-up that must leave the weights untouched."""

from __future__ import annotations

import math

import pytest
import torch

from train.optim import WarmupCosine, make_optimizer


def naive_lr(s: int, peak: float, warmup: int, total: int, floor: float) -> float:
    if s < warmup:
        return peak * (s + 1) / warmup
    span = total - 1 - warmup
    progress = min(max((s - warmup) / span, 0.0), 1.0) if span > 0 else 1.0  # the last step s = N-1 at 1
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize(
    "warmup,total,floor_ratio", [(4, 100, 0.0), (0, 10, 0.1), (3, 3, 0.0), (40, 1000, 0.05), (9, 10, 0.1), (2, 3, 0.1)]
)
def test_schedule_matches_naive_formula_step_by_step(warmup, total, floor_ratio):
    sched = WarmupCosine(
        peak_lr=6e-4, warmup_steps=warmup, total_steps=total, min_lr_ratio=floor_ratio, device=torch.device("cpu")
    )
    worst = 0.0
    for s in range(total + 2):
        want = naive_lr(s, 6e-4, warmup, total, 6e-4 * floor_ratio)
        worst = max(worst, abs(float(sched.lr_t) - want), abs(sched.host_lr(s) - want))
        sched.step()
    assert worst <= 1e-9, f"max abs lr diff {worst}"
    if warmup <= total - 1:  # --min-lr-ratio's help: the floor is reached at the last step
        assert sched.host_lr(total - 1) == pytest.approx(6e-4 * floor_ratio, abs=1e-12)
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


def test_checkpoint_layers_gives_the_plain_steps_loss_and_gradients(tmp_path):
    """--checkpoint-layers recomputes each layer in backward: the same loss and the same gradients
    (captured just before the optimizer step) as the plain step, from the same state and anchors."""
    from shards import LoadedShard, ShardReader, load_target_head
    from tests.helpers.train import tiny_cache, tiny_config
    from train.resolve import resolve_run
    from train.step import build_step_state, train_step

    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    reader = ShardReader(cache)
    results = []
    for checkpoint_layers in (False, True):
        cfg = tiny_config(cache, tmp_path / "run", num_layers=2, checkpoint_layers=checkpoint_layers)
        state = build_step_state(cfg, resolve_run(cfg), load_target_head(cache), torch.device("cpu"))
        tensors, info = reader.read(1)
        state.batch.load(LoadedShard(1, tensors, info, release=lambda: None))
        grads, layer_calls = [], []
        state.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs, grads=grads, state=state: grads.append(state.grads.flat.clone())
        )
        state.model.layers[0].register_forward_pre_hook(lambda module, args, calls=layer_calls: calls.append(1))
        train_step(state, with_metrics=True)
        # The recomputation in backward is the proof that checkpointing ran at all.
        assert len(layer_calls) == (2 if checkpoint_layers else 1), f"layer 0 ran {len(layer_calls)} times"
        results.append((state.totals.sums.flat.clone(), grads[0]))
    (sums_plain, grad_plain), (sums_ckpt, grad_ckpt) = results
    assert float(grad_plain.abs().max()) > 0
    assert torch.equal(sums_plain, sums_ckpt), f"loss/metric sums differ: {(sums_plain - sums_ckpt).abs().max()}"
    assert torch.equal(grad_plain, grad_ckpt), f"max abs gradient diff {(grad_plain - grad_ckpt).abs().max():.3e}"
