"""GPU (SM 8.9+, torchao): --fp8 at 27B width against the bf16 step, and inside the captured step (run by
the lead: pytest -m gpu tests/train/test_fp8_gpu.py).

The reference is the same FP8 step emulated: torchao's emulate mode (and, for the head, the same casts with
the products dequantised and multiplied in float32) rounds inputs, weights and output gradients exactly as
the FP8 GEMMs do, without the FP8 kernels. How far FP8 gradients are from bf16 ones is the formats' doing,
and large: e4m3 keeps 3 mantissa bits, e5m2 (the output gradients) 2, and the backward compounds them over
five layers, so on a random-weight drafter each parameter's gradient is 0.2-0.4 (relative L2) from the bf16
one (H200 at 27B width; emulated on the CPU at widths 1024 and 2048: 0.16-0.32 and 0.18-0.36). A fixed
tolerance on that distance says little; the real kernels must simply add nothing to it: every parameter's
gradient no farther from bf16 than the emulated one's, within ROUNDING_SLACK (fast accumulation and another
summation order flip some roundings downstream), the loss within 2% of bf16, and FP8 visibly ran. The CPU
tests (tests/train/test_fp8_training.py) hold the float64 comparisons; these check the real GEMMs.
"""

import copy

import pytest
import torch

from tests.helpers.drafter import QWEN36_27B_TARGET, forward_blocks
from tests.helpers.train import read_records, tiny_cache, tiny_config
from tests.train.drafter.test_drafter_gpu import build, cuda_batch, rel_err, run_step, seeded_blocks
from train.drafter.attention import BlockAttentionLayout
from train.drafter.config import DrafterConfig
from train.drafter.fp8 import float8_linears_
from train.loop import run_training
from train.loss.chunked import block_loss
from train.loss.config import LossConfig
from train.loss.head_gemms import FORWARD_DTYPE, GRAD_DTYPE, Fp8HeadGemms, to_fp8

pytestmark = pytest.mark.gpu
ROUNDING_SLACK = (1.25, 0.02)  # real FP8 gradient error <= 1.25 x the emulated one's + 0.02 (module docstring)
FP8_LOSS_TOL = 2e-2  # relative
FP8_SHOWS = 1e-3  # the least gradient difference FP8 must show somewhere


class EmulatedFp8HeadGemms(Fp8HeadGemms):
    """Fp8HeadGemms' casts (the same e4m3 head, per-tensor scales), the products dequantised in float32."""

    def fp8_logits(self, hidden_XH):
        h8_XH, h_scale = to_fp8(hidden_XH.detach(), FORWARD_DTYPE)
        w_VH = self.w_VH.float() * self.w_scale
        return ((h8_XH.float() * h_scale) @ w_VH.T).to(hidden_XH.dtype)

    def input_grad(self, grad_XV):
        g8_XV, g_scale = to_fp8(grad_XV, GRAD_DTYPE)
        return ((g8_XV.float() * g_scale) @ (self.w_VH.float() * self.w_scale)).to(grad_XV.dtype)


def fp8_step(model, head, batch, blocks, layout, loss_cfg, fp8, recipe, *, emulate):
    """One FP8 step of `model` (converted in place); its loss and every parameter's gradient."""
    float8_linears_(model, recipe, emulate=emulate)
    gemms = None
    if fp8 == "linears+head":
        gemms = (EmulatedFp8HeadGemms if emulate else Fp8HeadGemms)(head.lm_head_VH)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        out = forward_blocks(model, head, batch, blocks, layout)
        parts = block_loss(out, head, blocks, loss_cfg, gemms=gemms)
    parts.total.backward()
    return parts.total.item(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "fp8,recipe", [("linears", "tensorwise"), ("linears", "rowwise"), ("linears+head", "tensorwise")]
)
def test_fp8_step_against_the_bf16_step_at_27b_width(fp8, recipe):
    """fp32 master weights under bf16 autocast (the trainer's setting), 64 blocks over a 2048-token batch."""
    cfg = DrafterConfig.for_target(**QWEN36_27B_TARGET)
    model, head = build(cfg, param_dtype=torch.float32)
    real_model, emulated_model = copy.deepcopy(model), copy.deepcopy(model)
    batch = cuda_batch(cfg, [700, 900, 300, 100], 2048, 8)
    blocks = seeded_blocks(cfg, batch, 64)
    layout = BlockAttentionLayout(num_ctx=2048, num_blocks=64, block_size=cfg.block_size, backend="flex", device="cuda")
    loss_cfg = LossConfig(chunk_blocks=16)
    bf16 = run_step(model, head, batch, blocks, layout, loss_cfg).total.item()
    step = (head, batch, blocks, layout, loss_cfg, fp8, recipe)
    real_loss, real = fp8_step(real_model, *step, emulate=False)
    emulated_loss, emulated = fp8_step(emulated_model, *step, emulate=True)
    assert abs(real_loss - bf16) <= FP8_LOSS_TOL * abs(bf16), f"loss bf16 {bf16} vs fp8 {real_loss}"
    assert abs(emulated_loss - bf16) <= FP8_LOSS_TOL * abs(bf16), f"loss bf16 {bf16} vs emulated {emulated_loss}"
    factor, margin = ROUNDING_SLACK
    errors = {}
    for name, p in model.named_parameters():
        errors[name] = (rel_err(real[name], p.grad), rel_err(emulated[name], p.grad))
    beyond = {name: e for name, e in errors.items() if e[0] > factor * e[1] + margin}
    assert not beyond, f"FP8 kernels add error beyond the formats' rounding (real, emulated vs bf16): {beyond}"
    worst = max(e[0] for e in errors.values())
    assert worst > FP8_SHOWS, f"FP8 gradients equal bf16 ones ({worst:.3e}): no FP8 ran"


GPU_CACHE = dict(hidden_size=256, vocab_size=2048, token_budget=1024, max_seqs=4, tap_layer_ids=(1, 3, 5))
GPU_RUN = dict(device="cuda", attention="flex", compute_dtype="bfloat16", num_blocks=16, block_size=16, num_layers=2)
GPU_RUN["mask_token_id"] = GPU_CACHE["vocab_size"] - 1


DFLASH2_RUN = dict(arch="dflash2", selector_gold="swap", selector_warmup_steps=4)


@pytest.mark.parametrize("fp8,arch", [("linears", "dflash"), ("linears+head", "dflash"), ("linears+head", "dflash2")])
def test_fp8_step_under_cuda_graphs_equals_the_eager_fp8_step(tmp_path, fp8, arch):
    """Capture and replay of the FP8 step (dynamic scales on the device, no host sync) give the eager FP8
    step's losses; and they stay within FP8's rounding of the bf16 run's. DFlash 2 too: its selector reads
    the FP8 head's logits."""
    cache = tiny_cache(tmp_path / "cache", num_batches=4, **GPU_CACHE)
    drafter = DFLASH2_RUN if arch == "dflash2" else {}
    runs = {}
    for name, options in {
        "eager": dict(fp8=fp8, cuda_graphs=False),
        "graphs": dict(fp8=fp8, cuda_graphs=True),
        "bf16": dict(fp8="off", cuda_graphs=True),
    }.items():
        run_training(tiny_config(cache, tmp_path / name, **GPU_RUN, **drafter, **options))
        runs[name] = {r["step"]: r["loss/total"] for r in read_records(tmp_path / name)}
    assert sorted(runs["eager"]) == sorted(runs["graphs"]) == list(range(1, 9))
    graphs = max(abs(runs["eager"][s] - runs["graphs"][s]) / abs(runs["eager"][s]) for s in runs["eager"])
    assert graphs <= 1e-2, f"max relative loss diff graphs vs eager under --fp8 {fp8}: {graphs:.3e}"
    vs_bf16 = max(abs(runs["bf16"][s] - runs["graphs"][s]) / abs(runs["bf16"][s]) for s in runs["bf16"])
    assert 0 < vs_bf16 <= 5e-2, f"max relative loss diff --fp8 {fp8} vs bf16: {vs_bf16:.3e} (0: no FP8 ran)"
