"""Storage encodings of what a shard holds of the target: its taps, or a projected cache's codes.

Taps (hidden [T, K, H]): bf16 as is, or fp8 e4m3 with a per-token-per-tap scale: scale_TK = amax over H
of |hidden_TKH| / 448 (1 where the row is all zero), stored in fp32; hidden_fp8 = hidden / scale.
Decoding multiplies back. Rows are scaled independently because tapped layers differ in magnitude by
orders (deep layers of Qwen-style models carry outlier channels).

Codes (codes [T, R], shards/projection.py): bf16 as is, or fp8 e4m3 with one fp32 scale per group of G
consecutive codes of a token (the last group may be shorter). Codes come ordered by variance and the
leading ones carry the outlier channels: one scale per token would flush the tail components to zero.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from shards.format import FP8_E4M3_MAX, CacheConfig


def encode_hidden(hidden_TKH: torch.Tensor, storage_dtype: str) -> dict[str, torch.Tensor]:
    """Hidden states in the cache's storage dtype; run it on the GPU to halve the copy for fp8."""
    if storage_dtype == "bf16":
        return {"hidden": hidden_TKH.to(torch.bfloat16)}
    if storage_dtype != "fp8":
        raise ValueError(f"unknown storage dtype {storage_dtype!r}")
    q, scale_TK = _fp8_rows(hidden_TKH)
    return {"hidden": q, "hidden_scale": scale_TK}


def decode_hidden(hidden: torch.Tensor, hidden_scale: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 hidden states from either storage encoding."""
    if hidden.dtype == torch.bfloat16:
        return hidden
    if hidden_scale is None:
        raise ValueError("fp8 hidden states need hidden_scale to decode")
    return (hidden.float() * hidden_scale.unsqueeze(-1)).to(torch.bfloat16)


def encode_codes(codes_TR: torch.Tensor, storage_dtype: str, group_size: int) -> dict[str, torch.Tensor]:
    """A projected cache's codes in its storage dtype (fp8: per group of `group_size` codes)."""
    if storage_dtype == "bf16":
        return {"codes": codes_TR.to(torch.bfloat16)}
    if storage_dtype != "fp8":
        raise ValueError(f"unknown storage dtype {storage_dtype!r}")
    T, R = codes_TR.shape
    q_TgG, scale_Tg = _fp8_rows(_grouped(codes_TR, group_size))
    return {"codes": q_TgG.flatten(1)[:, :R].contiguous(), "code_scale": scale_Tg}


def decode_codes(codes_TR: torch.Tensor, code_scale_Tg: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """bf16 codes [T, R] from either storage encoding."""
    if codes_TR.dtype == torch.bfloat16:
        return codes_TR
    if code_scale_Tg is None:
        raise ValueError("fp8 codes need code_scale to decode")
    R = codes_TR.shape[1]
    values_TgG = _grouped(codes_TR.float(), group_size) * code_scale_Tg.unsqueeze(-1)
    return values_TgG.flatten(1)[:, :R].to(torch.bfloat16)


def decode_context(tensors: Mapping[str, torch.Tensor], cfg: CacheConfig) -> torch.Tensor:
    """What the drafter's fc reads of a shard, bf16: the taps [T, K, H], or a projected cache's codes as
    one "tap" of width R, [T, 1, R] (so fc's input, the flattened taps, is the codes)."""
    if cfg.projection is None:
        return decode_hidden(tensors["hidden"], tensors.get("hidden_scale"))
    return decode_codes(tensors["codes"], tensors.get("code_scale"), cfg.projection.group_size).unsqueeze(1)


def _fp8_rows(x_NF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and fp32 scales of x, one scale per row of the last dimension."""
    # One fp32 temporary instead of four (float copy, abs, quotient, clamp): a 49152-token batch of 5
    # taps at 5120 is 5 GB in fp32. The abs-max is exact in any dtype, and bf16 / fp32 promotes to
    # the same fp32 quotient as float(x) / scale, so the bits are those of the plain formula.
    amax = torch.linalg.vector_norm(x_NF, ord=float("inf"), dim=-1, dtype=torch.float32)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = torch.div(x_NF, scale.unsqueeze(-1)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


def _grouped(x_TR: torch.Tensor, group_size: int) -> torch.Tensor:
    """[T, R] -> [T, ceil(R / G), G], the last group padded with zeros (which change no amax)."""
    T, R = x_TR.shape
    pad = -R % group_size
    if pad:
        x_TR = F.pad(x_TR, (0, pad))
    return x_TR.reshape(T, -1, group_size)
