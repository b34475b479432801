"""Storage encodings of the hidden states: bf16 as is, or fp8 e4m3 with a per-token-per-tap scale.

fp8: scale_TK = amax over H of |hidden_TKH| / 448 (1 where the row is all zero), stored in fp32;
hidden_fp8 = hidden / scale. Decoding multiplies back. Rows are scaled independently because tapped
layers differ in magnitude by orders (deep layers of Qwen-style models carry outlier channels).
"""

from __future__ import annotations

import torch

from shards.format import FP8_E4M3_MAX


def encode_hidden(hidden_TKH: torch.Tensor, storage_dtype: str) -> dict[str, torch.Tensor]:
    """Hidden states in the cache's storage dtype; run it on the GPU to halve the copy for fp8."""
    if storage_dtype == "bf16":
        return {"hidden": hidden_TKH.to(torch.bfloat16)}
    if storage_dtype != "fp8":
        raise ValueError(f"unknown storage dtype {storage_dtype!r}")
    # One fp32 temporary instead of four (float copy, abs, quotient, clamp): a 49152-token batch of 5
    # taps at 5120 is 5 GB in fp32. The abs-max is exact in any dtype, and bf16 / fp32 promotes to
    # the same fp32 quotient as float(x) / scale, so the bits are those of the plain formula.
    amax_TK = torch.linalg.vector_norm(hidden_TKH, ord=float("inf"), dim=-1, dtype=torch.float32)
    scale_TK = torch.where(amax_TK > 0, amax_TK / FP8_E4M3_MAX, torch.ones_like(amax_TK))
    q = torch.div(hidden_TKH, scale_TK.unsqueeze(-1)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return {"hidden": q.to(torch.float8_e4m3fn), "hidden_scale": scale_TK}


def decode_hidden(hidden: torch.Tensor, hidden_scale: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 hidden states from either storage encoding."""
    if hidden.dtype == torch.bfloat16:
        return hidden
    if hidden_scale is None:
        raise ValueError("fp8 hidden states need hidden_scale to decode")
    return (hidden.float() * hidden_scale.unsqueeze(-1)).to(torch.bfloat16)
