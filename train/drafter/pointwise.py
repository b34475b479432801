"""Compiled pointwise regions of the training drafter (TrainConfig.compile_pointwise).

Eagerly, each RMSNorm is ~6 float32 passes over its input forward and more backward, SwiGLU two bf16
passes and RoPE five; at 27B width (32K block tokens x 5120, 49K context tokens) that memory traffic,
not the matmuls, is most of the step's elementwise time. torch.compile turns each region into one
fused kernel forward and one or two backward (AOTAutograd). Shapes are fixed (dynamic=False): each
call site's shape is one compile, done in the warm-up before CUDA-graph capture; the kernels are
plain launches, captured with the rest of the step. Inductor's emulate_precision_casts keeps eager's
intermediate roundings (silu(gate) rounded to bf16 before the product, as eager does).

With --fp8 the FP8 linears' forwards are compiled as well: their amax, scale and cast are pointwise
work of the same kind around each GEMM (train/drafter/fp8.py).

Only the training model's modules get the compiled twins (model.py's norm_fn / act_fn / rope_fn
class attributes, set per instance); evaluation twins and exported drafters run eagerly.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from train.drafter.attention import with_raised_recompile_limit
from train.drafter.dflash2 import BlockConv, causal_block_conv
from train.drafter.fp8 import float8_modules
from train.drafter.model import DFlashAttention, RMSNorm, SwiGLU, apply_rope, rms_norm, swiglu

log = logging.getLogger(__name__)

# Dynamo keys its compile cache by the function's code object, so every model compiled in one process
# shares each function's cache entries: rms_norm alone has 5 shapes per training model (hidden_norm,
# block norms, q/k norms of block and context), and a DFlash 1 then a DFlash 2 model in one process
# (bench_train --sizes 27b,27b2, the GPU test session) passed dynamo's default limit of 8, where
# fullgraph=True fails hard (H200 run, December 2026). So the compiled functions run under the compiled
# flex's raised limit, failing loudly only past it.


def compile_pointwise_(model: nn.Module, backend: str = "inductor") -> None:
    """Give every RMSNorm, SwiGLU and attention module of `model` compiled pointwise functions.

    backend: "inductor" (fused kernels); tests pass "aot_eager" (the same AOTAutograd graphs, run by
    aten, no compiler) to check the wiring and the decomposed backward on CPU."""
    options = None
    if backend == "inductor":
        from torch._inductor import config as inductor_config

        # Older torch has no such option (and rounds intermediates its own way): compile without it.
        options = {"emulate_precision_casts": True} if hasattr(inductor_config, "emulate_precision_casts") else None
    fns = {
        name: with_raised_recompile_limit(
            torch.compile(fn, dynamic=False, fullgraph=True, backend=backend, options=options)
        )
        for name, fn in (("norm", rms_norm), ("act", swiglu), ("rope", apply_rope), ("conv", causal_block_conv))
    }
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.norm_fn = fns["norm"]
        elif isinstance(module, SwiGLU):
            module.act_fn = fns["act"]
        elif isinstance(module, DFlashAttention):
            module.rope_fn = fns["rope"]
        elif isinstance(module, BlockConv):  # DFlash 2's block convolutions
            module.conv_fn = fns["conv"]
    for linear in float8_modules(model):  # --fp8: the casts around each FP8 GEMM fuse (train/drafter/fp8.py)
        linear.forward = with_raised_recompile_limit(
            torch.compile(linear.forward, dynamic=False, fullgraph=True, backend=backend, options=options)
        )
    log.info("pointwise: RMSNorm, SwiGLU, RoPE (and DFlash 2's block convolution) compiled (%s, fixed shapes)", backend)
