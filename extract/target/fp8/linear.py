"""FP8 linear layers for `--compute fp8`: how the weights are held, the e4m3 matmuls, and the
groups of layers that read one input run as one matmul (TargetModel.use_fp8_compute converts).

Two scalings, one per model (chosen by the checkpoint, announced in the kernel line):
- rowwise (a bf16 checkpoint): each weight quantised once at load, one scale per output channel:
  `weight_fp8` e4m3 [N, K] and `weight_scale_1N` fp32 [1, N]; each activation one scale per token
  ([T, 1]); torch._scaled_mm's rowwise kernel with fast accumulation.
- block (an FP8 checkpoint): the checkpoint's own e4m3 weights and block scales, kept as stored:
  `weight_fp8` [N, K], `weight_scale_nk` fp32 [ceil(N/bn), ceil(K/bk)] and `weight_block` (the
  Fp8BlockFormat), W[n, k] = w8[n, k] * s_w[n // bn, k // bk]; the activations quantised per token
  per bk input channels, x[t, k] ~= x8[t, k] * s_x[t, k // bk] (the DeepSeek-V3 / vLLM "w8a8 block
  fp8" recipe). On CUDA torch.nn.functional.scaled_mm with BlockWise1x128 x BlockWise128x128 scaling
  and fp32 accumulation (that kernel refuses fast accumulation); on CPU (no blockwise scaled_mm there),
  and on CUDA for N or K not a multiple of 128 (tiny models), the same math in fp32: both operands
  dequantised per block, one fp32 matmul, rounded to bf16. A FP8_LINEARS layer the checkpoint keeps
  in bf16 is quantised by us into blocks of the checkpoint's format, so every group is uniform.
Concatenating a group concatenates the weights along N and, in block mode, the scales along n:
only when every layer's N is a multiple of bn (else the group runs one matmul per layer).

Legend: T tokens, K input channels, N output channels, G = ceil(K / bk) activation scales per token,
n / k scale blocks of a weight along N / K.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import nn

from extract.target.fp8.quantization import (
    FP8_DTYPE,
    Fp8BlockFormat,
    dequantize_fp8_blocks,
    dequantize_groups_fp8,
    quantize_fp8_blocks,
    quantize_rows_fp8,
)
from extract.target.options import ForwardOptions

logger = logging.getLogger(__name__)

# Linear layers that run on e4m3 matmuls; the GatedDeltaNet a/b projections (48 rows feeding the
# decay and beta, 0.6% of the layer's FLOPs) and the LM head stay dense.
FP8_LINEARS = (
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
# Hopper's FP8 tensor cores accumulate in a reduced-precision (~22-bit) accumulator; without fast
# accumulation CUTLASS copies the partial sums to fp32 registers every 128 elements of K, which costs
# the rowwise kernel its fast ping-pong schedule (pytorch/ao#1325, pytorch/pytorch#147971). The dropped
# low bits are an error of ~1e-3 relative per product, small beside the ~3% of the e4m3 operands
# themselves; inference FP8 GEMMs (FBGEMM's f8f8bf16_rowwise, torchao's inference linear) default to it.
# CPU _scaled_mm ignores the flag (it accumulates in fp32). Rowwise mode only: the 128x128 blockwise
# kernel refuses it ("doesn't support fast accum with 128x128 blockwise scaling").
FP8_FAST_ACCUM = True
# The one block shape scaled_mm's blockwise kernels take (BlockWise1x128 activations, 128x128 weights).
GPU_BLOCK = 128


@dataclasses.dataclass
class Fp8Input:
    """The input of a group of linear layers under FP8 compute: e4m3 rows with their scales, plus
    the dense tensor when a dense layer (in_proj_a/b) reads the same input."""

    x8_TX: torch.Tensor  # [T, X] float8_e4m3fn
    # [T, 1] fp32 in rowwise mode, [T, G] in block mode (G = ceil(X / bk)): x ~= x8 * scale per group
    scale_TG: torch.Tensor
    dense: torch.Tensor | None = None  # [T, ...] in the model dtype, or None when no dense layer reads it


# ---- the matmuls --------------------------------------------------------------------------------
def blockwise_kernel_fits(device: torch.device, block: Fp8BlockFormat, n: int, k: int) -> bool:
    """Whether scaled_mm's blockwise CUDA kernel runs an [N, K] weight of `block` on `device`: CUDA,
    128x128 blocks, N and K multiples of 128 (whole blocks only), and K / 128 a multiple of 4 (torch
    checks the weight scales' leading dimension against that: K = 640 is refused, 5120 taken); else
    block_fp8_matmul_fp32 runs. The GPU itself is checked once, by check_blockwise_device."""
    return (
        device.type == "cuda"
        and (block.block_n, block.block_k) == (GPU_BLOCK, GPU_BLOCK)
        and n % GPU_BLOCK == 0
        and k % GPU_BLOCK == 0
        and (k // GPU_BLOCK) % 4 == 0
    )


def check_blockwise_device(device: torch.device) -> None:
    """Refuse block-scaled FP8 on a CUDA GPU torch has no blockwise kernel for: its 1x128 x 128x128
    scaled_mm runs on Hopper (sm_90) only, and the fp32 fallback is far too slow for a real target."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        raise ValueError(
            f"--compute fp8 on an FP8 checkpoint keeps its 128x128 block scales and needs torch's blockwise "
            f"FP8 matmul, which runs on Hopper (sm_90) only; {torch.cuda.get_device_name(device)} is "
            f"sm_{major}{minor}: use --compute dense (the FP8 weights dequantised to bf16), or the bf16 "
            f"release with --compute fp8 (rowwise FP8)"
        )


# cuBLAS's blockwise kernel refuses token counts off a multiple of 16 (CUBLAS_STATUS_NOT_SUPPORTED at
# T = 1021 on the H200): rows are padded to this multiple.
BLOCKWISE_TOKEN_MULTIPLE = 128


def block_fp8_matmul(
    x8_TK: torch.Tensor, scale_TG: torch.Tensor, w8_NK: torch.Tensor, scale_nk: torch.Tensor, block: Fp8BlockFormat
) -> torch.Tensor:
    """x @ W.T in bf16 [T, N] from e4m3 operands with block scales: x per token per bk channels
    (scale_TG), W per bn x bk block (scale_nk). scaled_mm on CUDA where blockwise_kernel_fits, else fp32."""
    N, K = w8_NK.shape
    if not blockwise_kernel_fits(x8_TK.device, block, N, K):
        return block_fp8_matmul_fp32(x8_TK, scale_TG, w8_NK, scale_nk, block)
    from torch.nn.functional import ScalingType, scaled_mm

    T = x8_TK.shape[0]
    pad = -T % BLOCKWISE_TOKEN_MULTIPLE
    if pad:  # the forward pads its batches (TargetModel._run); other callers pay a copy here
        x8_TK = torch.cat([x8_TK, x8_TK.new_zeros(pad, K)])
        scale_TG = torch.cat([scale_TG, scale_TG.new_ones(pad, scale_TG.shape[1])])
    # The layout the kernel takes (measured on the H200, torch 2.11): mat_b the [K, N] column-major
    # view of the row-major weight (no copy, also for a row slice of a concatenated weight); scale_a
    # [T, G] outer-dim-major, strides (1, T) (a row-major one is refused; the copy is free when the
    # scales already are); scale_b the [k, n] view of the contiguous [n, k] block scales (a copied,
    # column-major one is refused).
    y_TN = scaled_mm(
        x8_TK,
        w8_NK.t(),
        scale_TG.t().contiguous().t(),
        ScalingType.BlockWise1x128,
        scale_nk.t(),
        ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
        use_fast_accum=False,
    )
    return y_TN[:T] if pad else y_TN


def block_fp8_matmul_fp32(
    x8_TK: torch.Tensor, scale_TG: torch.Tensor, w8_NK: torch.Tensor, scale_nk: torch.Tensor, block: Fp8BlockFormat
) -> torch.Tensor:
    """block_fp8_matmul's math in fp32: dequantise both operands per block, one fp32 matmul, bf16 out."""
    x_TK = dequantize_groups_fp8(x8_TK, scale_TG, block.block_k)
    w_NK = dequantize_fp8_blocks(w8_NK, scale_nk, block, torch.float32)
    return (x_TK @ w_NK.t()).to(torch.bfloat16)


def fp8_matmul(
    x: Fp8Input, w8_NK: torch.Tensor, scale: torch.Tensor, block: Fp8BlockFormat | None = None
) -> torch.Tensor:
    """x @ w.T in bf16 from e4m3 operands: rowwise scales (x per token, `scale` [1, N] per output
    row) when block is None, else block scales (`scale` [n, k], x per token per block.block_k)."""
    if block is not None:
        return block_fp8_matmul(x.x8_TX, x.scale_TG, w8_NK, scale, block)
    # mat2 is the [K, N] column-major view of the row-major [N, K] weight, as _scaled_mm requires:
    # no copy, also for a row slice of a concatenated weight.
    return torch._scaled_mm(
        x.x8_TX,
        w8_NK.t(),
        scale_a=x.scale_TG,
        scale_b=scale,
        out_dtype=torch.bfloat16,
        use_fast_accum=FP8_FAST_ACCUM,
    )


def _scale(holder: nn.Module, prefix: str) -> tuple[torch.Tensor, Fp8BlockFormat | None]:
    """The scale of the e4m3 weight `holder` keeps under `prefix` ("weight" for a layer, the group
    name for a concatenated group) and its block format (None: rowwise)."""
    block = getattr(holder, f"{prefix}_block", None)
    return getattr(holder, f"{prefix}_scale_1N" if block is None else f"{prefix}_scale_nk"), block


def linear(layer: nn.Linear, x: torch.Tensor | Fp8Input) -> torch.Tensor:
    """layer(x): an FP8 matmul (bf16 out) when the layer holds FP8 weights, else the dense matmul
    (of x.dense under FP8 compute)."""
    w8_NK = getattr(layer, "weight_fp8", None)
    if w8_NK is None:
        return layer(x.dense if isinstance(x, Fp8Input) else x)
    if not isinstance(x, Fp8Input):
        raise TypeError("an FP8 linear layer needs an Fp8Input (quantised by the preceding pointwise op)")
    return fp8_matmul(x, w8_NK, *_scale(layer, "weight"))


def grouped_linears(module: nn.Module, group: str, x: torch.Tensor | Fp8Input, options: ForwardOptions):
    """The outputs of the linear layers `module.LINEAR_GROUPS[group]` (all reading x), in order: column
    slices of one matmul when use_fp8_compute concatenated the group and options.concat_linears, else
    one matmul per layer (each layer's weight is then a row slice of the concatenation)."""
    layers = [getattr(module, name) for name in module.LINEAR_GROUPS[group]]
    w_NK = getattr(module, f"{group}_weight", None)
    if w_NK is None or not options.concat_linears:
        return [linear(layer, x) for layer in layers]
    if w_NK.dtype == FP8_DTYPE:
        y_TN = fp8_matmul(x, w_NK, *_scale(module, group))
    else:  # a dense group under FP8 compute reads the dense copy of the input
        y_TN = F.linear(x.dense if isinstance(x, Fp8Input) else x, w_NK)
    return list(torch.split(y_TN, [layer.out_features for layer in layers], dim=-1))


# ---- conversion (TargetModel.use_fp8_compute) ---------------------------------------------------
def check_fp8_compute(
    device: torch.device,
    dtype: torch.dtype,
    block: Fp8BlockFormat | None,
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]] | None,
) -> None:
    """Refuse FP8 compute for a model in `dtype` on `device` where it cannot run: it needs bf16
    weights, on CUDA an sm_89+ GPU, and for block mode (`block` set) torch's blockwise scaled_mm on Hopper."""
    if dtype != torch.bfloat16:
        raise ValueError(
            f"FP8 compute needs the model in bfloat16 (its matmuls write bf16), found {dtype}: use --dtype bfloat16"
        )
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            f"FP8 compute needs an FP8 GPU (sm_89+: L4, L40, H100, H200, B200), "
            f"{torch.cuda.get_device_name(device)} is sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}: "
            f"use --compute dense"
        )
    if block is not None and device.type == "cuda" and not hasattr(F, "scaled_mm"):
        raise ValueError(
            f"FP8 compute on an FP8 checkpoint runs block-scaled matmuls, which need "
            f"torch.nn.functional.scaled_mm (torch {torch.__version__} has none): upgrade torch, "
            f"or use --compute dense"
        )
    if stored and block is None:
        raise ValueError("use_fp8_compute: FP8 weights kept as stored need their block format (block=)")
    if block is not None:
        check_blockwise_device(device)


@dataclasses.dataclass(kw_only=True)
class Fp8Conversion:
    """What convert_linears did, for the kernel report."""

    num_layers: int = 0  # FP8_LINEARS layers now on e4m3 matmuls
    num_as_stored: int = 0  # block mode: of those, weights kept as the checkpoint stores them
    num_fp32_fallback: int = 0  # block mode on CUDA: layers blockwise_kernel_fits refuses (fp32 path)
    num_groups: int = 0  # LINEAR_GROUPS concatenated into one matmul each
    unconcatenated: list[str] = dataclasses.field(default_factory=list)  # groups left one matmul per layer


def fp8_weight_names(model: nn.Module) -> set[str]:
    """The parameter names of the weights use_fp8_compute puts on e4m3 ("layers.0.mlp.up_proj.weight", ...)."""
    return {f"{name}.weight" for name, layer in model.named_modules() if _is_fp8_linear(name, layer)}


def _is_fp8_linear(name: str, layer: nn.Module) -> bool:
    return isinstance(layer, nn.Linear) and name.rsplit(".", 1)[-1] in FP8_LINEARS


def convert_linears(
    model: nn.Module, block: Fp8BlockFormat | None, stored: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> Fp8Conversion:
    """Put every FP8_LINEARS layer of `model` on e4m3 weights, in place, and concatenate each
    LINEAR_GROUPS entry. block None: rowwise (weights quantised per output channel). Else block mode:
    a layer named in `stored` ("layers.0.mlp.up_proj.weight" -> (e4m3 [N, K], fp32 scales [n, k]))
    takes those tensors unchanged, the others are quantised into `block` blocks. Each dense copy is freed.
    `stored` is consumed (emptied): a caller's reference must not keep the kept tensors alive twice
    while the groups are concatenated (16.6 GB of device memory at 27B)."""
    done = Fp8Conversion()
    for name, layer in model.named_modules():
        if not _is_fp8_linear(name, layer):
            continue
        if block is None:
            w8_NK, scale_N1 = quantize_rows_fp8(layer.weight)
            layer.register_buffer("weight_fp8", w8_NK)
            layer.register_buffer("weight_scale_1N", scale_N1.t().contiguous())
        else:
            as_stored = stored.pop(f"{name}.weight", None)
            w8_NK, scale_nk = as_stored if as_stored is not None else quantize_fp8_blocks(layer.weight, block)
            layer.register_buffer("weight_fp8", w8_NK)
            layer.register_buffer("weight_scale_nk", scale_nk)
            layer.weight_block = block
            done.num_as_stored += as_stored is not None
            done.num_fp32_fallback += not blockwise_kernel_fits(w8_NK.device, block, *w8_NK.shape)
        layer.weight = None  # the dense copy is never read again: free it
        done.num_layers += 1
    if stored:
        raise ValueError(f"FP8 weights kept as stored for layers that are not FP8_LINEARS: {sorted(stored)[:4]}")
    for name, module in model.named_modules():
        for group in getattr(module, "LINEAR_GROUPS", {}):
            if concatenate_group(module, group):
                done.num_groups += 1
            else:
                done.unconcatenated.append(f"{name}.{group}")
    return done


def concatenate_group(module: nn.Module, group: str) -> bool:
    """Build `{group}_weight` (and its scales for FP8) from the group's layers, then make each layer's
    weight a row slice (a view) of it: one copy of the weights, both paths still run. False (nothing
    changed) for block-scaled layers whose N is not a multiple of the block's rows: their scales do
    not stack along N."""
    layers = [getattr(module, name) for name in module.LINEAR_GROUPS[group]]
    fp8 = [getattr(layer, "weight_fp8", None) is not None for layer in layers]
    if any(fp8) and not all(fp8):
        raise ValueError(f"{type(module).__name__} group {group}: {module.LINEAR_GROUPS[group]} mix FP8 and dense")
    block = getattr(layers[0], "weight_block", None)
    if block is not None and any(layer.out_features % block.block_n for layer in layers):
        return False
    bounds = [0]
    for layer in layers:
        bounds.append(bounds[-1] + layer.out_features)
    rows = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    if not all(fp8):
        w_NK = torch.cat([layer.weight for layer in layers])
        module.register_buffer(f"{group}_weight", w_NK, persistent=False)
        for layer, r in zip(layers, rows):
            layer.weight = nn.Parameter(w_NK[r], requires_grad=False)
        return True
    w8_NK = torch.cat([layer.weight_fp8 for layer in layers])
    module.register_buffer(f"{group}_weight", w8_NK, persistent=False)
    if block is None:
        scale_1N = torch.cat([layer.weight_scale_1N for layer in layers], dim=1)
        module.register_buffer(f"{group}_scale_1N", scale_1N, persistent=False)
        for layer, r in zip(layers, rows):
            layer.weight_fp8, layer.weight_scale_1N = w8_NK[r], scale_1N[:, r]
        return True
    # Each layer's N is whole blocks: its scale rows are a contiguous run of the stacked scales.
    scale_nk = torch.cat([layer.weight_scale_nk for layer in layers])
    module.register_buffer(f"{group}_scale_nk", scale_nk, persistent=False)
    setattr(module, f"{group}_block", block)
    for layer, r in zip(layers, rows):
        layer.weight_fp8 = w8_NK[r]
        layer.weight_scale_nk = scale_nk[r.start // block.block_n : r.stop // block.block_n]
    return True


def fp8_kernel_report(
    done: Fp8Conversion, block: Fp8BlockFormat | None, device: torch.device, compiled: bool, concat: bool
) -> list[tuple[int, str]]:
    """The kernel report of a conversion: (log level, line) pairs, the `kernel linear:` line first."""
    pointwise = "compiled" if compiled else "eager"
    groups = f"{done.num_groups} groups reading one input concatenated: " + (
        "one matmul each" if concat else "one matmul per layer (concat_linears off)"
    )
    if block is None:
        return [
            (
                logging.INFO,
                f"kernel linear: fp8 e4m3 torch._scaled_mm with rowwise scales, "
                f"{'fast' if FP8_FAST_ACCUM else 'fp32'} accumulation ({done.num_layers} layers: weights quantised "
                f"once per output channel, activations per token inside the {pointwise} pointwise ops; {groups}); "
                f"in_proj_a/b and lm_head dense",
            )
        ]
    bn, bk = block.block_n, block.block_k
    if device.type != "cuda":
        backend = "fp32 dequantise-and-matmul (torch has no blockwise scaled_mm off CUDA)"
    elif done.num_fp32_fallback == done.num_layers:
        backend = "fp32 dequantise-and-matmul (no layer fits scaled_mm's blockwise kernel)"
    else:
        backend = (
            f"torch scaled_mm blockwise (BlockWise1x{GPU_BLOCK} x BlockWise{GPU_BLOCK}x{GPU_BLOCK}), fp32 accumulation"
        )
    lines = [
        (
            logging.INFO,
            f"kernel linear: fp8 e4m3 with the checkpoint's {bn}x{bk} block scales ({done.num_layers} layers: "
            f"{done.num_as_stored} weights as stored, {done.num_layers - done.num_as_stored} stored unquantised and "
            f"quantised into the same blocks at load), activations per token per {bk} channels inside the "
            f"{pointwise} pointwise ops, {backend}; {groups}; in_proj_a/b and lm_head dense",
        )
    ]
    if device.type == "cuda" and done.num_fp32_fallback:
        lines.append(
            (
                logging.WARNING,
                f"kernel linear: {done.num_fp32_fallback} of {done.num_layers} block-scaled layers run the slow fp32 "
                f"dequantise-and-matmul path on CUDA: scaled_mm's blockwise kernel takes {GPU_BLOCK}x{GPU_BLOCK} "
                f"blocks with N and K multiples of {GPU_BLOCK} only (this checkpoint: {bn}x{bk} blocks; tiny models)",
            )
        )
    if done.unconcatenated:
        lines.append(
            (
                logging.INFO,
                f"kernel linear: {len(done.unconcatenated)} groups run one matmul per layer: block-scaled weights "
                f"concatenate along N only when each layer's N is a multiple of the block's {bn} rows "
                f"(e.g. {', '.join(done.unconcatenated[:3])})",
            )
        )
    return lines
