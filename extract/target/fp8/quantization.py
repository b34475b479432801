"""Quantized checkpoints: which formats the loader reads, and the FP8 arithmetic.

Implemented: the fine-grained FP8 format of Qwen's "-FP8" releases (and DeepSeek-V3's), as HF
transformers' `finegrained_fp8` integration and vLLM's `fp8` method read it:
  config.json  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
               "activation_scheme": "dynamic", "weight_block_size": [128, 128],
               "modules_to_not_convert": [...]}  (top level, or inside text_config)
  tensors      `X.weight` float8_e4m3fn [N, K] and `X.weight_scale_inv` fp32 [ceil(N/bn), ceil(K/bk)]:
               W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk] (the "inverse" scale is a
               multiplier: amax of the block / 448). Modules the checkpoint leaves unquantised (norms,
               embeddings, lm_head, the small GatedDeltaNet a/b projections, the conv) are stored in
               bf16 and have no scale. A weight is read as FP8 exactly when its stored dtype is e4m3.
Any other quantization (GPTQ, AWQ, bitsandbytes, compressed-tensors, per-tensor or static FP8, ...)
is refused before any work, naming the method.

Also here: the activation quantisation for `--compute fp8`: rowwise (one scale per token, the layout
torch._scaled_mm's rowwise mode takes; also per row of a weight) or per group of channels (one scale
per token per `group` input channels, matching a block-scaled weight's block_k: extract/target/fp8/linear.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from extract.target.config import CONFIG_FILE, read_config_json
from shards.common.errors import UserError
from shards.common.schema import typed
from shards.format import FP8_E4M3_MAX

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
FP8_DTYPE = torch.float8_e4m3fn
# Smallest amax a row or block is scaled for: an all-zero row gets a finite scale, not 0/0.
MIN_AMAX = 1e-12
IMPLEMENTED = (
    "unquantised checkpoints (bf16 / fp16 / fp32) and fine-grained FP8 (quant_method 'fp8', e4m3 weights "
    "with weight_scale_inv per block, weight_block_size [128, 128], activation_scheme 'dynamic')"
)


class UnsupportedQuantizationError(UserError, ValueError):
    """The checkpoint is quantized in a way this loader does not implement."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class Fp8BlockFormat:
    """A fine-grained FP8 checkpoint's quantization, from its config.json."""

    block_n: int  # output rows per scale block (weight_block_size[0])
    block_k: int  # input columns per scale block (weight_block_size[1])
    modules_to_not_convert: tuple[str, ...] = ()  # modules the checkpoint keeps unquantised (names as given)

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"Fp8BlockFormat.{name} must be a positive int, found {getattr(self, name)!r}")

    def describe(self) -> str:
        """The record in cache.json and the kernel report, e.g. 'fp8 e4m3, 128x128 blocks'."""
        return f"fp8 e4m3, {self.block_n}x{self.block_k} blocks"

    def scale_shape(self, shape_NK: tuple[int, ...]) -> tuple[int, int]:
        n, k = shape_NK
        return math.ceil(n / self.block_n), math.ceil(k / self.block_k)


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def _method(q: Any) -> str:
    return repr(q.get("quant_method")) if isinstance(q, dict) else repr(q)


def _format_of(q: Any) -> Any:
    """What decides how weights are stored (a repeated config may differ in other keys, e.g. ignore lists)."""
    return (q.get("quant_method"), q.get("fmt"), q.get("weight_block_size")) if isinstance(q, dict) else q


def read_quantization(config: dict[str, Any], source: str = "config.json") -> Fp8BlockFormat | None:
    """None for an unquantised checkpoint; the FP8 block format; or UnsupportedQuantizationError."""
    q = config.get("quantization_config")
    text = config.get("text_config")
    inner = text.get("quantization_config") if isinstance(text, dict) else None
    if q is not None and inner is not None and _format_of(q) != _format_of(inner):
        raise UnsupportedQuantizationError(
            f"{source}: quantization_config and text_config.quantization_config disagree "
            f"({_method(q)} vs {_method(inner)}); a checkpoint has one format: restore its config.json from the release"
        )
    q = q if q is not None else inner
    if q is None:
        return None
    fix = (
        "use the unquantised (bf16) release of the model, or dequantise this checkpoint first "
        "(e.g. transformers from_pretrained + save_pretrained in bfloat16)"
    )
    if not isinstance(q, dict):
        raise UnsupportedQuantizationError(f"{source}: quantization_config must be an object, found {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise UnsupportedQuantizationError(
            f"{source}: quantization_config.quant_method={method!r} is not implemented; this loader reads "
            f"{IMPLEMENTED}: {fix}"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedQuantizationError(f"{source}: FP8 fmt={fmt!r} is not implemented (e4m3 only): {fix}")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UnsupportedQuantizationError(
            f"{source}: FP8 activation_scheme={scheme!r} is not implemented (static activation scales; "
            f"only 'dynamic' is): {fix}"
        )
    block = q.get("weight_block_size")
    if block is None:
        raise UnsupportedQuantizationError(
            f"{source}: FP8 without weight_block_size (per-tensor or per-channel FP8) is not implemented; "
            f"fine-grained FP8 needs two positive block sizes such as [128, 128]: {fix}"
        )
    sizes_ok = isinstance(block, (list, tuple)) and len(block) == 2
    if not (sizes_ok and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise UnsupportedQuantizationError(
            f"{source}: FP8 weight_block_size={json.dumps(block)} is not two positive integers such as "
            f"[128, 128]: the config.json is damaged (restore it from the release)"
        )
    name = "modules_to_not_convert" if q.get("modules_to_not_convert") else "ignored_layers"
    skip = typed(list[str] | None, q.get(name), source, f"quantization_config.{name}") or ()
    return Fp8BlockFormat(block_n=block[0], block_k=block[1], modules_to_not_convert=tuple(skip))


def checkpoint_quantization(ckpt_dir: str | Path) -> Fp8BlockFormat | None:
    """read_quantization of `ckpt_dir`/config.json (the refusal runs before any model or data work)."""
    path = Path(ckpt_dir) / CONFIG_FILE
    config = read_config_json(ckpt_dir)
    return read_quantization(config, source=str(path))


# ---- block FP8 (the checkpoint format) ---------------------------------------------------------
def dequantize_fp8_blocks(
    w8_NK: torch.Tensor, scale_inv_nk: torch.Tensor, fmt: Fp8BlockFormat, dtype: torch.dtype
) -> torch.Tensor:
    """W = w8 * scale_inv broadcast over its block: the product (at most 4 + 24 significant bits) is
    rounded once to fp32, then cast to `dtype`; runs where the tensors are (the GPU when streaming)."""
    n, k = w8_NK.shape
    s_NK = scale_inv_nk.float().repeat_interleave(fmt.block_n, 0)[:n].repeat_interleave(fmt.block_k, 1)[:, :k]
    return (w8_NK.float() * s_NK).to(dtype)


def quantize_fp8_blocks(w_NK: torch.Tensor, fmt: Fp8BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], fp32 weight_scale_inv [ceil(N/bn), ceil(K/bk)]): each block's amax maps onto 448,
    as the official checkpoints are made (partial edge blocks are scaled by their own amax)."""
    n, k = w_NK.shape
    bn, bk = fmt.block_n, fmt.block_k
    sn, sk = fmt.scale_shape((n, k))
    padded = torch.zeros(sn * bn, sk * bk, dtype=torch.float32, device=w_NK.device)
    padded[:n, :k] = w_NK.float()
    amax_nk = padded.view(sn, bn, sk, bk).abs().amax(dim=(1, 3))
    scale_inv_nk = amax_nk.clamp(min=MIN_AMAX) / FP8_E4M3_MAX
    s_NK = scale_inv_nk.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    w8_NK = (w_NK.float() / s_NK).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return w8_NK, scale_inv_nk


# ---- rowwise FP8 (the --compute fp8 matmuls) ---------------------------------------------------
def _scale_and_inverse(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax / 448, 448 / amax) with amax raised to MIN_AMAX (an all-zero row gets a finite scale),
    each one IEEE division as the feed kernels compute them (torch
    divides by a Python number as a multiply by its reciprocal on CUDA, and a Python number by a
    tensor as reciprocal-then-multiply: two roundings, another scale or code now and then)."""
    amax = amax.clamp(min=MIN_AMAX)
    fp8_max = torch.full_like(amax, FP8_E4M3_MAX)
    return amax / fp8_max, fp8_max / amax


def quantize_rows_fp8(x_RX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [R, X], fp32 scale [R, 1]) with x ~= x8 * scale and each row's amax mapped onto 448.

    Written with plain torch ops so torch.compile fuses it into the pointwise op that produces x.
    x is multiplied by 448 / amax (one division per row, not per element: the Triton feed kernels
    do the same, so both give the same codes for the same x)."""
    x32 = x_RX.float()
    scale_R1, inverse_R1 = _scale_and_inverse(x32.abs().amax(dim=-1, keepdim=True))
    x8 = (x32 * inverse_R1).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return x8, scale_R1


# ---- per-group FP8 (the activations of block-scaled matmuls) -----------------------------------
def quantize_groups_fp8(x_RX: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [R, X], fp32 scale [R, G]) with G = ceil(X / group) and x[r, c] ~= x8[r, c] * scale[r, c // group]:
    each group of `group` channels of a row has its amax mapped onto 448 (a last group of X % group
    channels is scaled by its own amax). Plain torch ops, so torch.compile fuses it like quantize_rows_fp8."""
    if group <= 0:
        raise ValueError(f"quantize_groups_fp8: group must be a positive number of channels, found {group}")
    *lead, X = x_RX.shape
    G = -(-X // group)
    # Zero padding to whole groups leaves every amax unchanged; the padding is cut off again below.
    x32_RGC = F.pad(x_RX.float(), (0, G * group - X)).view(*lead, G, group)
    scale_RG, inverse_RG = _scale_and_inverse(x32_RGC.abs().amax(dim=-1))
    q_RGC = (x32_RGC * inverse_RG.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q_RGC.view(*lead, G * group)[..., :X].to(FP8_DTYPE), scale_RG


def dequantize_groups_fp8(x8_RX: torch.Tensor, scale_RG: torch.Tensor, group: int) -> torch.Tensor:
    """x8 * scale broadcast over its groups, in fp32 (the inverse of quantize_groups_fp8)."""
    X = x8_RX.shape[-1]
    return x8_RX.float() * scale_RG.float().repeat_interleave(group, dim=-1)[..., :X]


def quantize_activations_fp8(x_RX: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The --compute fp8 activation quantisation: rowwise (scale [R, 1]) when group is 0, else per
    `group` channels (scale [R, ceil(X / group)]). `group` is a Python int: under torch.compile the
    branch is resolved when the op is traced."""
    return quantize_groups_fp8(x_RX, group) if group else quantize_rows_fp8(x_RX)
