"""GPU (SM 8.9+, torchao): --fp8 at 27B width against the bf16 step, and inside the captured step (run by
the lead: pytest -m gpu tests/train/test_fp8_gpu.py).

Tolerances. A step's gradients in FP8 differ from bf16 ones by the formats' rounding: e4m3 inputs and
weights (3 mantissa bits: 2^-4 relative at most, ~2^-4/sqrt(3) rms per element), e5m2 output gradients
(2^-3 at most), the forward GEMM's fast accumulation; per element that is ~8% rms, and a sum of many
such products keeps about that relative error, compounded over five layers. So: every parameter's
gradient within 0.25 of its norm (relative L2 error), the loss within 2% (through the e4m3 head its
logits are off by ~2^-4/sqrt(H)), and at least 1e-3 apart from bf16 somewhere (FP8 ran). The CPU tests
(tests/train/test_fp8_training.py) hold the float64 comparisons; these check the real GEMMs.
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
from train.loss.head_gemms import Fp8HeadGemms

pytestmark = pytest.mark.gpu
FP8_GRAD_TOL = 0.25  # relative L2 error of each parameter's gradient (module docstring)
FP8_LOSS_TOL = 2e-2  # relative
FP8_SHOWS = 1e-3  # the least gradient difference FP8 must show somewhere


@pytest.mark.parametrize(
    "fp8,recipe", [("linears", "tensorwise"), ("linears", "rowwise"), ("linears+head", "tensorwise")]
)
def test_fp8_step_against_the_bf16_step_at_27b_width(fp8, recipe):
    """fp32 master weights under bf16 autocast (the trainer's setting), 64 blocks over a 2048-token batch."""
    cfg = DrafterConfig.for_target(**QWEN36_27B_TARGET)
    model, head = build(cfg, param_dtype=torch.float32)
    fp8_model = copy.deepcopy(model)
    float8_linears_(fp8_model, recipe)
    batch = cuda_batch(cfg, [700, 900, 300, 100], 2048, 8)
    blocks = seeded_blocks(cfg, batch, 64)
    layout = BlockAttentionLayout(num_ctx=2048, num_blocks=64, block_size=cfg.block_size, backend="flex", device="cuda")
    loss_cfg = LossConfig(chunk_blocks=16)
    bf16 = run_step(model, head, batch, blocks, layout, loss_cfg)
    gemms = Fp8HeadGemms(head.lm_head_VH) if fp8 == "linears+head" else None
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        out = forward_blocks(fp8_model, head, batch, blocks, layout)
        parts = block_loss(out, head, blocks, loss_cfg, gemms=gemms)
    parts.total.backward()
    a, b = bf16.total.item(), parts.total.item()
    assert abs(a - b) <= FP8_LOSS_TOL * abs(a), f"loss bf16 {a} vs fp8 {b}"
    grads = dict(fp8_model.named_parameters())
    errors = {name: rel_err(grads[name].grad, p.grad) for name, p in model.named_parameters()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < FP8_GRAD_TOL, f"{worst}: relative grad error {errors[worst]:.3e} (all: {errors})"
    assert errors[worst] > FP8_SHOWS, f"FP8 gradients equal bf16 ones ({errors[worst]:.3e}): no FP8 ran"


GPU_CACHE = dict(hidden_size=256, vocab_size=2048, token_budget=1024, max_seqs=4, tap_layer_ids=(1, 3, 5))
GPU_RUN = dict(device="cuda", attention="flex", compute_dtype="bfloat16", num_blocks=16, block_size=16, num_layers=2)
GPU_RUN["mask_token_id"] = GPU_CACHE["vocab_size"] - 1


@pytest.mark.parametrize("fp8", ["linears", "linears+head"])
def test_fp8_step_under_cuda_graphs_equals_the_eager_fp8_step(tmp_path, fp8):
    """Capture and replay of the FP8 step (dynamic scales on the device, no host sync) give the eager FP8
    step's losses; and they stay within FP8's rounding of the bf16 run's."""
    cache = tiny_cache(tmp_path / "cache", num_batches=4, **GPU_CACHE)
    runs = {}
    for name, options in {
        "eager": dict(fp8=fp8, cuda_graphs=False),
        "graphs": dict(fp8=fp8, cuda_graphs=True),
        "bf16": dict(cuda_graphs=True),
    }.items():
        run_training(tiny_config(cache, tmp_path / name, **GPU_RUN, **options))
        runs[name] = {r["step"]: r["loss/total"] for r in read_records(tmp_path / name)}
    assert sorted(runs["eager"]) == sorted(runs["graphs"]) == list(range(1, 9))
    graphs = max(abs(runs["eager"][s] - runs["graphs"][s]) / abs(runs["eager"][s]) for s in runs["eager"])
    assert graphs <= 1e-2, f"max relative loss diff graphs vs eager under --fp8 {fp8}: {graphs:.3e}"
    vs_bf16 = max(abs(runs["bf16"][s] - runs["graphs"][s]) / abs(runs["bf16"][s]) for s in runs["bf16"])
    assert vs_bf16 <= 5e-2, f"max relative loss diff --fp8 {fp8} vs bf16: {vs_bf16:.3e}"
