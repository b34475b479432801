"""Pointwise: the table through which the target's layers run their pointwise ops (extract/target/ops.py).

On CUDA each op is wrapped in torch.compile, so it runs as one or two fused kernels instead of up to ten
eager passes over [T, H]-sized fp32 temporaries; on CPU it runs eager. Under FP8 compute `feed` runs the
op's FP8 twin (extract/target/fp8/feeds.py), which also quantises the output the next linear layers
read, and hands that on as an Fp8Input; where the kernel choice has them, the twins run as Triton kernels.
"""

from __future__ import annotations

import logging

import torch

from extract.target import ops
from extract.target.fp8 import feeds
from extract.target.fp8 import kernels as fp8_kernels
from extract.target.fp8.linear import Fp8Input
from extract.target.options import ForwardOptions

logger = logging.getLogger(__name__)


def compile_for_tokens(fn):
    """torch.compile(fn) with the token dimension (dim 0 of every tensor argument of 2+ dims)
    dynamic from the first call: batches differ in length, and a first graph specialised on one
    length would be compiled again, dynamic, on the second."""
    compiled = torch.compile(fn, fullgraph=True)

    def run(*args):
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.ndim >= 2:
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return compiled(*args)

    return run


class Pointwise:
    """The pointwise functions of extract/target/ops.py, eager or each wrapped in torch.compile (one
    fused kernel or two per call instead of up to ten eager passes over [T, H]-sized fp32 temporaries).

    With fp8 on, `feed` runs the feeds.FP8_VARIANTS function of an op, which also quantises its output
    per token, or per token per `fp8_group` channels in block mode (and keeps the dense output too when
    keep_dense): as a feeds.FEED_KERNELS Triton kernel when `feed_kernels` (the kernel choice has them)
    and options.feed_kernels, else the function."""

    NAMES = (
        "zero_centred_rmsnorm",
        "add_zero_centred_rmsnorm",
        "gated_rmsnorm",
        "gdn_gates",
        "qk_norm_rope",
        "sigmoid_gate",
        "silu_mul",
    )

    def __init__(self, compiled: bool, feed_kernels: bool = False, options: ForwardOptions | None = None):
        self.compiled = compiled
        self.fp8 = False  # set by TargetModel.use_fp8_compute
        # Channels per activation scale under FP8 compute: 0 = one per token (rowwise mode), else the
        # weights' block_k (block mode); set by TargetModel.use_fp8_compute.
        self.fp8_group = 0
        self.options = ForwardOptions() if options is None else options  # shared with the model
        self.feed_kernels = dict(feeds.FEED_KERNELS) if feed_kernels else {}  # a shape a kernel refuses drops it
        wrap = compile_for_tokens if compiled else (lambda fn: fn)
        for name in self.NAMES:
            setattr(self, name, wrap(getattr(ops, name)))
        for name in feeds.FP8_VARIANTS:
            setattr(self, name, wrap(getattr(feeds, name)))

    def _fp8_variant(self, variant: str, args):
        kernel = self.feed_kernels.get(variant) if self.options.feed_kernels else None
        if kernel is not None:
            try:
                return kernel(*args)
            except fp8_kernels.UnsupportedShape as e:
                logger.info("kernel fp8 feeds: %s falls back to the torch function (%s)", variant, e)
                del self.feed_kernels[variant]
        return getattr(self, variant)(*args)

    def feed(self, name: str, *args, keep_dense: bool = False):
        """Run pointwise op `name` whose (last) output feeds linear layers: that output as a tensor,
        or under FP8 compute as an Fp8Input (other outputs, like the residual, unchanged)."""
        if not self.fp8:
            return getattr(self, name)(*args)
        out = self._fp8_variant(f"{name}_fp8_dense" if keep_dense else f"{name}_fp8", (*args, self.fp8_group))
        if keep_dense:
            *rest, dense, x8, scale = out
        else:
            (*rest, x8, scale), dense = out, None
        fed = Fp8Input(x8, scale, dense)
        return (*rest, fed) if rest else fed
