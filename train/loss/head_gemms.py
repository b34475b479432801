"""The two GEMMs of the chunked loss over the frozen LM head, in bf16 or in FP8 (TrainConfig.fp8
"linears+head").

Per chunk of X rows the loss computes logits = h W^T ([X, H] x [H, V]) and, for the backward, the
input gradient dh = g W ([X, V] x [V, H]), W the frozen [V, H] lm_head: at 27B width (V = 248320) about a
third of the step's FLOPs. `HeadGemms` is the bf16 pair (plain matmuls, autograd as before);
`Fp8HeadGemms` runs both on torch._scaled_mm:
    logits = (h8 s_h) (W8 s_W)^T     h8 = e4m3(h / s_h),   W8 = e4m3(W / s_W)
    dh     = (g8 s_g) (W8 s_W)       g8 = e5m2(g / s_g)    (e5m2: the softmax tail spans ~2^20)
one scale per tensor (amax / the format's max), fp32 accumulation, the result in the input's dtype.

Why our own _scaled_mm rather than torchao's Float8Linear here: the head is frozen, so it is cast to
e4m3 once when the step state is built (and kept twice: [V, H] for the logits and its transpose [H, V]
for dh, as the FP8 GEMM takes its second operand column-major), while a Float8Linear would recompute
the weight's amax and cast the whole 248K x 5120 head in every chunk of every step; and the loss calls
the two GEMMs from its own chunk loop (the input gradient is computed in the forward, chunk by chunk),
not through an nn.Linear's autograd. The activation scales are device reductions: no host sync, fixed
shapes, captured with the step. On CUDA the casts are compiled (one fused amax and one cast kernel).

The lm_head rows that DFlash 2's selector reads (embedding_bag) and the monitoring metrics' logits stay
bf16: they are no GEMM of the loss.

Legend: X rows of a chunk, H hidden, V vocab.
"""

from __future__ import annotations

import torch

from shards.common.errors import UserError
from train.drafter.attention import with_raised_recompile_limit

FORWARD_DTYPE = torch.float8_e4m3fn  # h and W
GRAD_DTYPE = torch.float8_e5m2  # the logits' gradient


class HeadGemms:
    """logits and input gradient over the frozen lm_head [V, H] in its own dtype (the default)."""

    def __init__(self, lm_head_VH: torch.Tensor):
        self.lm_head_VH = lm_head_VH

    def logits(self, hidden_XH: torch.Tensor) -> torch.Tensor:
        """[X, V] logits, differentiable in hidden_XH."""
        return hidden_XH @ self.lm_head_VH.T

    def input_grad(self, grad_XV: torch.Tensor) -> torch.Tensor:
        """[X, H] gradient of the hidden states given the logits' gradient."""
        return grad_XV @ self.lm_head_VH


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / s in `dtype`, row-major, as _scaled_mm's first operand must be; s = amax(|x|) / max(dtype), a
    float32 device scalar (all-zero x: s tiny))."""
    scale = x.abs().amax().float().clamp_min(1e-30) / torch.finfo(dtype).max
    return (x.float() / scale).to(dtype).contiguous(), scale


_compiled_to_fp8 = None


def _cast(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    global _compiled_to_fp8
    if not x.is_cuda:
        return to_fp8(x, dtype)
    if _compiled_to_fp8 is None:
        # Under the step's raised limit: each chunk shape, dtype and stride is one more cache entry.
        _compiled_to_fp8 = with_raised_recompile_limit(torch.compile(to_fp8, dynamic=False, fullgraph=True))
    return _compiled_to_fp8(x, dtype)


def require_fp8_head(vocab_size: int, hidden_size: int) -> None:
    """Refuse --fp8 linears+head for a head whose sizes no FP8 GEMM takes (multiples of 16)."""
    if vocab_size % 16 or hidden_size % 16:
        raise UserError(
            f"--fp8 linears+head: the LM head is {vocab_size} x {hidden_size}; FP8 GEMMs need both multiples of "
            "16: use --fp8 linears"
        )


class Fp8HeadGemms(HeadGemms):
    """Both GEMMs in FP8 (module docstring); the head is cast once, here."""

    def __init__(self, lm_head_VH: torch.Tensor):
        super().__init__(lm_head_VH)
        if lm_head_VH.is_cuda:
            require_fp8_head(*lm_head_VH.shape)
        self.w_VH, self.w_scale = to_fp8(lm_head_VH, FORWARD_DTYPE)
        self.w_HV = self.w_VH.t().contiguous()  # the same values, row-major transposed: dh's operand

    def logits(self, hidden_XH: torch.Tensor) -> torch.Tensor:
        return _Fp8Logits.apply(hidden_XH, self)

    def fp8_logits(self, hidden_XH: torch.Tensor) -> torch.Tensor:
        h8_XH, h_scale = _cast(hidden_XH.detach(), FORWARD_DTYPE)
        return torch._scaled_mm(h8_XH, self.w_VH.t(), scale_a=h_scale, scale_b=self.w_scale, out_dtype=hidden_XH.dtype)

    def input_grad(self, grad_XV: torch.Tensor) -> torch.Tensor:
        g8_XV, g_scale = _cast(grad_XV, GRAD_DTYPE)
        return torch._scaled_mm(g8_XV, self.w_HV.t(), scale_a=g_scale, scale_b=self.w_scale, out_dtype=grad_XV.dtype)


class _Fp8Logits(torch.autograd.Function):
    """Fp8HeadGemms' logits under autograd (the loss's unfused path): backward is its input_grad."""

    @staticmethod
    def forward(ctx, hidden_XH: torch.Tensor, gemms: Fp8HeadGemms) -> torch.Tensor:
        ctx.gemms, ctx.hidden_dtype = gemms, hidden_XH.dtype
        return gemms.fp8_logits(hidden_XH)

    @staticmethod
    def backward(ctx, grad_XV: torch.Tensor):
        return ctx.gemms.input_grad(grad_XV).to(ctx.hidden_dtype), None
