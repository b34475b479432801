"""The elementwise cuts of the training step against the plain step: working weight copies
(precision.WorkingWeights), the fused loss gradient (fused_loss.py) and the compiled pointwise
regions (pointwise.py; CPU tests compile with the aot_eager backend: the same AOTAutograd graphs,
no C++ compiler). Model level in float64 (loss and every parameter's gradient, ignored labels, KL and
CAP on and off, with and without activation checkpointing); step level on tiny caches."""

import pytest
import torch

import train.step
from tests.helpers.drafter import blocks_and_layout, forward_blocks, make_batch, tiny_config, tiny_model_and_head
from tests.helpers.train import run_steps, tiny_cache
from train.drafter.dflash2 import BlockConv
from train.drafter.model import Linear, rms_norm
from train.drafter.pointwise import compile_pointwise_
from train.loss.chunked import block_loss
from train.loss.config import LossConfig
from train.precision import WorkingWeights

KT = 5


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Each test compiles the pointwise functions for its own shapes; earlier tests' entries would count
    # towards dynamo's per-function recompile limit.
    torch._dynamo.reset()
    yield


def compile_for_cpu_tests(model):
    compile_pointwise_(model, backend="aot_eager")


def model_loss_and_grads(cfg, batch, blocks, layout, loss_cfg, topk, *, cuts: bool, checkpoint_layers: bool):
    model, head = tiny_model_and_head(cfg, dtype=torch.float64)
    if cuts:
        WorkingWeights([m for m in model.modules() if isinstance(m, Linear)], torch.float64)
        compile_for_cpu_tests(model)
        assert model.norm.norm_fn is not rms_norm
    out = forward_blocks(model, head, batch, blocks, layout, checkpoint_layers=checkpoint_layers)
    parts = block_loss(out, head, blocks, loss_cfg, *topk)
    parts.total.backward()
    return parts, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("checkpoint_layers", [False, True])
@pytest.mark.parametrize("lambdas", [(0.0, 0.0), (0.6, 0.9)])
def test_cut_model_equals_eager_model_in_float64(lambdas, checkpoint_layers):
    cfg = tiny_config()
    batch = make_batch([9, 14, 3, 11], 48, 6, cfg.num_taps, cfg.hidden_size, unsupervised=(20, 30))
    batch["hidden_TKH"] = batch["hidden_TKH"].double()
    blocks, layout = blocks_and_layout(cfg, batch, num_blocks=12)
    assert not blocks.label_valid_NB[:, 1:].all()  # ignored labels are covered
    g = torch.Generator().manual_seed(3)
    topk = (
        torch.stack([torch.randperm(cfg.vocab_size, generator=g)[:KT] for _ in range(48)]).int(),
        torch.log_softmax(torch.randn(48, KT, generator=g, dtype=torch.float64), -1),
    )
    results = []
    for cuts in (False, True):
        loss_cfg = LossConfig(kl_lambda=lambdas[0], cap_lambda=lambdas[1], chunk_blocks=5, fused=cuts)
        results.append(
            model_loss_and_grads(
                cfg, batch, blocks, layout, loss_cfg, topk, cuts=cuts, checkpoint_layers=checkpoint_layers
            )
        )
    (plain, grads_plain), (cut, grads_cut) = results
    for name in ("total", "ce", "kl", "cap"):
        a, b = float(getattr(plain, name).detach()), float(getattr(cut, name).detach())
        assert abs(a - b) <= 1e-12 * max(1.0, abs(a)), f"{name}: plain {a}, cut {b}"
    assert float(plain.cap) != 0 or lambdas[1] == 0
    for name, want in grads_plain.items():
        err = (grads_cut[name] - want).abs().max().item() / want.abs().max().clamp_min(1e-30).item()
        assert err < 1e-10, f"{name}: relative max grad diff {err:.3e}"


def test_weight_copies_give_the_autocast_step_bit_for_bit(tmp_path):
    """bf16 autocast on CPU: two steps with working copies == two steps casting at every use, exactly
    (weights after both optimizer updates, so the refresh at the top of each step is covered)."""
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    common = dict(compute_dtype="bfloat16", num_layers=2, fused_loss=False, compile_pointwise=False)
    plain = run_steps(cache, tmp_path / "a", 2, weight_copies=False, **common)
    copies = run_steps(cache, tmp_path / "b", 2, weight_copies=True, **common)
    assert plain["state"].working_weights is None and copies["state"].working_weights is not None
    assert torch.equal(plain["sums"], copies["sums"])
    for step, (a, b) in enumerate(zip(plain["grads"], copies["grads"])):
        assert torch.equal(a, b), f"step {step + 1}: max abs gradient diff {(a - b).abs().max():.3e}"
    for name, p in plain["params"].items():
        assert torch.equal(p, copies["params"][name]), name


@pytest.mark.parametrize("lambdas", [(0.0, 0.0), (0.0, 0.7)])
def test_step_with_the_cuts_equals_the_plain_step_to_fp32_rounding(tmp_path, monkeypatch, lambdas):
    monkeypatch.setattr(train.step, "compile_pointwise_", compile_for_cpu_tests)
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    common = dict(num_layers=2, compute_dtype="float32", cap_lambda=lambdas[1], checkpoint_layers=True)
    plain = run_steps(cache, tmp_path / "a", 2, fused_loss=False, compile_pointwise=False, **common)
    cut = run_steps(cache, tmp_path / "b", 2, fused_loss=True, compile_pointwise=True, **common)
    assert cut["state"].model.norm.norm_fn is not rms_norm
    assert torch.allclose(plain["sums"], cut["sums"], rtol=1e-5, atol=1e-6), (plain["sums"] - cut["sums"]).abs().max()
    for step, (a, b) in enumerate(zip(plain["grads"], cut["grads"])):
        err = (a - b).abs().max().item() / a.abs().max().item()
        assert err < 1e-5, f"step {step + 1}: relative max gradient diff {err:.3e}"
    # Not the weights themselves: Adam divides by sqrt(v), so a gradient entry near 0 turns a rounding
    # difference into a different update of up to lr; step 2's gradients, taken at step 1's weights,
    # show the updates agree.


def test_compiled_block_convolutions_equal_eager_ones_in_float64():
    """DFlash 2: the compiled twin of the block convolution gives the eager model's output and gradients."""
    cfg = tiny_config(arch="dflash2", conv_group_size=8, selector_rank=4, selector_top_k=8)
    batch = make_batch([9, 14, 3, 11], 48, 6, cfg.num_taps, cfg.hidden_size)
    batch["hidden_TKH"] = batch["hidden_TKH"].double()
    blocks, layout = blocks_and_layout(cfg, batch, num_blocks=12)
    results = []
    for compiled in (False, True):
        model, head = tiny_model_and_head(cfg, dtype=torch.float64)
        with torch.no_grad():  # away from the identity start, so the convolutions do something
            for name, p in model.named_parameters():
                if "conv" in name:
                    p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype))
        if compiled:
            compile_for_cpu_tests(model)
            assert model.layers[0].mlp_conv.conv_fn is not BlockConv.conv_fn
        out = forward_blocks(model, head, batch, blocks, layout)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (eager, grads_eager), (comp, grads_comp) = results
    assert torch.allclose(eager, comp, atol=1e-12)
    for name, want in grads_eager.items():
        assert torch.allclose(grads_comp[name], want, atol=1e-10), name


def test_compiled_norm_takes_more_shapes_than_dynamos_default_limit():
    # Dynamo shares a function's compile cache across models, so one process training a DFlash 1 and
    # then a DFlash 2 model sees more than its default 8 shapes of rms_norm; fullgraph must not fail there.
    cfg = tiny_config()
    model, _ = tiny_model_and_head(cfg, dtype=torch.float64)
    compile_for_cpu_tests(model)
    for rows in range(1, 13):
        x = torch.randn(rows, cfg.hidden_size, dtype=torch.float64)
        torch.testing.assert_close(model.norm(x), rms_norm(x, model.norm.weight, model.norm.eps))
