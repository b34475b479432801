"""Triton kernels for the pointwise ops that feed FP8 matmuls (--compute fp8): each reads its inputs
once, does the op in fp32 with the same bf16 roundings as the plain functions in extract/target/ops.py,
and writes the e4m3 output with its per-token scale (rowwise, or per `group` channels).

Why hand-written: torch.compile turns "op, then the row's amax, then divide" into a looped reduction
that reads the row twice and ran at ~2 TB/s on the H200 (silu-mul over F = 17408 took 3.7 ms per
layer, 9% of the FP8 forward; tools/bench/fp8_feeds.py measures each against it). Here a program
owns one token: rows up to 8192 channels are one register tile (one read); wider rows (the MLP's F)
are walked in chunks, the second walk finding the row in L2.

Kernels (T tokens, X channels, G scale groups per token):
  add_rmsnorm_quant    [h + delta ->] h, zero-centred RMSNorm, (dense copy), e4m3 + scale
  gated_rmsnorm_quant  per-head RMSNorm of o, * w, * silu(z), flattened, e4m3 + scale
  sigmoid_gate_quant   attention output * sigmoid(gate), flattened, e4m3 + scale
  silu_mul_quant       silu(gate) * up, e4m3 + scale
They run on CUDA tensors; on CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1, the
CPU tests), whose float casts truncate: there the roundings to bf16 and e4m3 are done on the fp32 bits
first (to nearest even, as the hardware), so the interpreter checks the same numbers, bit for bit. On
sm_90+ the e4m3 conversion is the hardware's (cvt.rn.satfinite: round to nearest even, saturating at
448, NaN kept); on sm_89 Triton converts through fp16 (rounding twice), so there too the value is
rounded on its fp32 bits first. The quantisation multiplies by 448 / amax (one IEEE division per row
or group, as quantize_rows_fp8 does eagerly), so kernel and eager function give the same code for the
same bf16 value; the pointwise math before it (exp, rsqrt, silu's division) is the GPU's fast fp32,
whose last-bit differences from torch's reach the bf16 values rarely (tests/extract/target/fp8/test_fp8_kernels.py).
"""

from __future__ import annotations

import functools
import os

import torch

from extract.target.fp8.quantization import MIN_AMAX
from shards.format import FP8_E4M3_MAX as FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: the compiled or eager functions are used instead
    triton = None

TILE_CHANNELS = 8192  # rows up to this width are one register tile (one read of the inputs)
CHUNK_CHANNELS = 2048  # wider rows are walked in chunks (under the interpreter; on the GPU: tuned)


class UnsupportedShape(ValueError):
    """The kernel does not cover these inputs (layout, dtype or width): use the torch function."""


def available() -> bool:
    """Triton is importable (the kernels can run on CUDA tensors, or on CPU under its interpreter)."""
    return triton is not None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:
    _FP8_MAX = tl.constexpr(FP8_MAX)
    _MIN_AMAX = tl.constexpr(MIN_AMAX)

    @triton.jit
    def _round_bits(x, drop: tl.constexpr):
        """x rounded to nearest even after dropping `drop` low mantissa bits of its fp32 pattern."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) & ~((1 << drop) - 1)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _to_bf16(x, EXACT_CASTS: tl.constexpr):
        """x rounded to the nearest bf16, kept in fp32 (all the math here is fp32)."""
        if EXACT_CASTS:
            return x.to(tl.bfloat16).to(tl.float32)
        return _round_bits(x, 16)

    @triton.jit
    def _to_e4m3(x, HW_E4M3: tl.constexpr):
        """x to float8_e4m3fn as torch's x.clamp(-448, 448).to(float8_e4m3fn): nearest even, NaN kept.
        HW_E4M3 (sm_90+): the hardware conversion does exactly that. Otherwise (the interpreter, which
        truncates; sm_89, where Triton goes through fp16) x is clamped and rounded on its fp32 bits
        first, so the conversion itself is exact: normal e4m3 keeps 3 mantissa bits; below 2^-6
        (subnormal) the step is 2^-9, and adding and removing 1.5 * 2^14 rounds an fp32 to it."""
        if HW_E4M3:
            return x.to(tl.float8e4nv)
        x = tl.minimum(_nan_max(x, -_FP8_MAX), _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        small = tl.abs(x) < 0.015625
        rounded = tl.where(small, (x + 24576.0) - 24576.0, _round_bits(x, 20))
        rounded = tl.where(rounded == 0.0, x * 0.0, rounded)  # keep the sign of zero, as torch's cast
        return rounded.to(tl.float8e4nv)

    @triton.jit
    def _silu(x):
        return x / (1.0 + tl.exp(-x))

    @triton.jit
    def _nan_max(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _amax(y_abs, axis: tl.constexpr):
        """max over `axis`, NaN when any element is NaN (as torch's amax; tl.max would skip it)."""
        return tl.reduce(y_abs, axis, _nan_max)

    @triton.jit
    def _scales_of(amax):
        """(amax / 448, 448 / amax) with amax raised to MIN_AMAX (NaN kept): the scale the matmul
        multiplies back and the factor that quantises, each one IEEE division (as quantize_rows_fp8
        computes them), once per row or group."""
        amax = _nan_max(amax, _MIN_AMAX)
        fp8_max = tl.zeros_like(amax) + _FP8_MAX
        return tl.div_rn(amax, fp8_max), tl.div_rn(fp8_max, amax)

    @triton.jit
    def _store_quantised(y, offs, mask, group_ids, x8_row, scale_row, GROUPED: tl.constexpr, HW_E4M3: tl.constexpr):
        """Write y (fp32, already rounded to bf16 values) as e4m3 with its scale: one per row, or per
        group (`group_ids` gives each element's group; a [P, C] tile holds whole groups per row)."""
        y_abs = tl.where(mask, tl.abs(y), 0.0)
        if GROUPED:
            scale, inv = _scales_of(_amax(y_abs, 1))  # [P]: the tile's rows are the groups
            tl.store(scale_row + group_ids, scale, mask=tl.max(mask.to(tl.int32), axis=1) > 0)
            tl.store(x8_row + offs, _to_e4m3(y * inv[:, None], HW_E4M3), mask=mask)
        else:
            scale, inv = _scales_of(_amax(_amax(y_abs, 1), 0))
            tl.store(scale_row, scale)
            tl.store(x8_row + offs, _to_e4m3(y * inv, HW_E4M3), mask=mask)

    @triton.jit
    def _add_rmsnorm_quant_kernel(
        h_ptr, delta_ptr, w_ptr, h_out_ptr, dense_ptr, x8_ptr, scale_ptr,
        stride_h, stride_delta, G, eps, X: tl.constexpr,
        HAS_DELTA: tl.constexpr, KEEP_DENSE: tl.constexpr, GROUPED: tl.constexpr,
        P: tl.constexpr, C: tl.constexpr, EXACT_CASTS: tl.constexpr, HW_E4M3: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        p = tl.arange(0, P)[:, None]
        c = tl.arange(0, C)[None, :]
        offs = p * C + c  # the row as a [P, C] tile; with groups, C is the group width
        mask = offs < X
        h = tl.load(h_ptr + t * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:  # the residual add rounds to bf16, as h + delta in bf16 does
            h = _to_bf16(
                h + tl.load(delta_ptr + t * stride_delta + offs, mask=mask, other=0.0).to(tl.float32), EXACT_CASTS
            )
            tl.store(h_out_ptr + t * X + offs, h.to(tl.bfloat16), mask=mask)
        inv_rms = tl.rsqrt(tl.sum(tl.sum(h * h, axis=1), axis=0) * (1.0 / X) + eps)  # as torch: mean, rsqrt
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = _to_bf16(h * inv_rms * (1.0 + w), EXACT_CASTS)
        if KEEP_DENSE:
            tl.store(dense_ptr + t * X + offs, y.to(tl.bfloat16), mask=mask)
        _store_quantised(y, offs, mask, tl.arange(0, P), x8_ptr + t * X, scale_ptr + t * G, GROUPED, HW_E4M3)

    @triton.jit
    def _gated_rmsnorm_quant_kernel(
        o_ptr, z_ptr, w_ptr, x8_ptr, scale_ptr,
        stride_o, stride_z, G, eps, M: tl.constexpr,
        GROUPED: tl.constexpr, P: tl.constexpr, D: tl.constexpr, EXACT_CASTS: tl.constexpr, HW_E4M3: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        m = tl.arange(0, P)[:, None]
        d = tl.arange(0, D)[None, :]
        offs = m * D + d  # the row as [heads, head dim]; with groups, the group is the head
        mask = (m < M) & (d < D)
        o = tl.load(o_ptr + t * stride_o + offs, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + t * stride_z + offs, mask=mask, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(o * o, axis=1) * (1.0 / D) + eps)  # [P]: one per head
        normed = _to_bf16(o * inv_rms[:, None], EXACT_CASTS)
        w = tl.load(w_ptr + d).to(tl.float32)
        y = _to_bf16(w * normed, EXACT_CASTS)
        y = _to_bf16(y * _silu(z), EXACT_CASTS)
        _store_quantised(y, offs, mask, tl.arange(0, P), x8_ptr + t * M * D, scale_ptr + t * G, GROUPED, HW_E4M3)

    @triton.jit
    def _sigmoid_gate_quant_kernel(
        o_ptr, gate_ptr, x8_ptr, scale_ptr,
        stride_o, stride_gate, stride_gate_head, G,
        N: tl.constexpr, D: tl.constexpr, GROUPED: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
        EXACT_CASTS: tl.constexpr, HW_E4M3: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, R)[:, None]
        c = tl.arange(0, C)[None, :]
        offs = r * C + c  # flattened [N * D] channel; a tile row is C channels of one head
        mask = offs < N * D
        head, within = offs // D, offs % D
        o = tl.load(o_ptr + t * stride_o + offs, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + t * stride_gate + head * stride_gate_head + within, mask=mask, other=0.0)
        sig = 1.0 / (1.0 + tl.exp(-gate.to(tl.float32)))
        y = _to_bf16(o * _to_bf16(sig, EXACT_CASTS), EXACT_CASTS)
        _store_quantised(y, offs, mask, tl.arange(0, R), x8_ptr + t * N * D, scale_ptr + t * G, GROUPED, HW_E4M3)

    @triton.jit
    def _silu_mul_chunk(gate_row, up_row, offs, mask, EXACT_CASTS: tl.constexpr):
        """silu(gate) * up as the bf16 ops round it: silu to bf16, then the product to bf16."""
        g = tl.load(gate_row + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_row + offs, mask=mask, other=0.0).to(tl.float32)
        s = _to_bf16(_silu(g), EXACT_CASTS)
        return _to_bf16(s * u, EXACT_CASTS)

    @triton.jit
    def _silu_mul_quant_kernel(
        gate_ptr, up_ptr, x8_ptr, scale_ptr,
        stride_gate, stride_up, G, X: tl.constexpr,
        GROUPED: tl.constexpr, P: tl.constexpr, C: tl.constexpr, EXACT_CASTS: tl.constexpr, HW_E4M3: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        gate_row, up_row = gate_ptr + t * stride_gate, up_ptr + t * stride_up
        x8_row, scale_row = x8_ptr + t * X, scale_ptr + t * G
        tile = tl.arange(0, P)[:, None] * C + tl.arange(0, C)[None, :]  # P groups of C (or one chunk)
        if GROUPED:  # every chunk holds whole groups: one walk
            for start in range(0, X, P * C):
                offs = start + tile
                mask = offs < X
                y = _silu_mul_chunk(gate_row, up_row, offs, mask, EXACT_CASTS)
                group_ids = start // C + tl.arange(0, P)
                _store_quantised(y, offs, mask, group_ids, x8_row, scale_row, GROUPED, HW_E4M3)
        else:  # the row's amax first, then the quantised row (the second walk reads L2)
            amax = tl.zeros([P, C], dtype=tl.float32)
            for start in range(0, X, P * C):
                offs = start + tile
                mask = offs < X
                y = _silu_mul_chunk(gate_row, up_row, offs, mask, EXACT_CASTS)
                amax = _nan_max(amax, tl.where(mask, tl.abs(y), 0.0))
            scale, inv = _scales_of(_amax(_amax(amax, 1), 0))
            tl.store(scale_row, scale)
            for start in range(0, X, P * C):
                offs = start + tile
                mask = offs < X
                y = _silu_mul_chunk(gate_row, up_row, offs, mask, EXACT_CASTS)
                tl.store(x8_row + offs, _to_e4m3(y * inv, HW_E4M3), mask=mask)


# Launch configurations tried once per row width (triton.autotune, on the GPU): warps per program,
# and for silu-mul the channels per chunk (P groups of C). The interpreter runs the first.
WARPS = (4, 8, 16)
SILU_CHUNK_GROUPS = (8, 16, 32)
_TUNED: dict[str, object] = {}


def _launch(kernel, T: int, args: tuple, consts: dict, key: list[str], chunk_groups: int | None = None) -> None:
    """kernel[(T,)](*args, **consts): one program per token, with the tuned launch configuration."""
    if _interpreted():
        extra = {} if chunk_groups is None else {"P": chunk_groups}
        kernel[(T,)](*args, **consts, **extra, EXACT_CASTS=False, HW_E4M3=False, num_warps=8)
        return
    name = kernel.fn.__name__
    if name not in _TUNED:
        if chunk_groups is None:
            configs = [triton.Config({}, num_warps=w) for w in WARPS]
        else:
            configs = [triton.Config({"P": p}, num_warps=w) for p in SILU_CHUNK_GROUPS for w in WARPS]
        _TUNED[name] = triton.autotune(configs=configs, key=key)(kernel)
    _TUNED[name][(T,)](*args, **consts, EXACT_CASTS=True, HW_E4M3=_hardware_e4m3(args[0].device.index))


@functools.cache
def _hardware_e4m3(device_index: int | None) -> bool:
    """sm_90+: Triton's fp32 -> e4m3 cast is the hardware's single rounding (on sm_89 it goes through fp16)."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _check_rows(name: str, *tensors: torch.Tensor) -> None:
    for x in tensors:
        if x.stride(-1) != 1:
            raise UnsupportedShape(f"{name}: the channel dimension must be contiguous, found strides {x.stride()}")
        if x.dtype != torch.bfloat16:
            raise UnsupportedShape(f"{name}: the FP8 feed kernels take bfloat16 inputs, found {x.dtype}")


def _check_group(name: str, group: int, X: int) -> None:
    """A scale group must be a power of two that divides the row (0: one scale per row)."""
    if group and (group & (group - 1) or X % group):
        raise UnsupportedShape(f"{name}: group {group} must be a power of two dividing {X} channels")


def _tile(X: int, group: int) -> tuple[int, int]:
    """(P, C): a [P, C] tile covering a row of X channels; C is the group width when grouped."""
    C = group if group else min(128, triton.next_power_of_2(X))
    return triton.next_power_of_2(triton.cdiv(X, C)), C


def _outputs(T: int, X: int, group: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    G = triton.cdiv(X, group) if group else 1
    return (
        torch.empty(T, X, dtype=torch.float8_e4m3fn, device=device),
        torch.empty(T, G, dtype=torch.float32, device=device),
    )


def add_rmsnorm_quant(
    h_TX: torch.Tensor,
    delta_TX: torch.Tensor | None,
    w_X: torch.Tensor,
    eps: float,
    group: int = 0,
    keep_dense: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(h + delta if delta is given, normed dense if keep_dense, e4m3 [T, X], scale [T, G]) of
    zero_centred_rmsnorm(h + delta, w) quantised per token (group 0) or per `group` channels."""
    T, X = h_TX.shape
    _check_rows("add_rmsnorm_quant", h_TX, *([] if delta_TX is None else [delta_TX]))
    _check_group("add_rmsnorm_quant", group, X)
    P, C = _tile(X, group)
    if P * C > TILE_CHANNELS:
        raise UnsupportedShape(f"add_rmsnorm_quant: rows of {X} channels exceed one tile ({TILE_CHANNELS})")
    x8_TX, scale_TG = _outputs(T, X, group, h_TX.device)
    h_out = torch.empty_like(h_TX, memory_format=torch.contiguous_format) if delta_TX is not None else None
    dense = torch.empty(T, X, dtype=torch.bfloat16, device=h_TX.device) if keep_dense else None
    d_TX = delta_TX if delta_TX is not None else h_TX  # an unused pointer when there is no delta
    args = (
        h_TX, d_TX, w_X, h_out if h_out is not None else h_TX, dense if dense is not None else h_TX, x8_TX, scale_TG,
        h_TX.stride(0), d_TX.stride(0), scale_TG.shape[1], eps,
    )  # fmt: skip
    consts = dict(X=X, HAS_DELTA=delta_TX is not None, KEEP_DENSE=keep_dense, GROUPED=bool(group), P=P, C=C)
    _launch(_add_rmsnorm_quant_kernel, T, args, consts, key=["X", "HAS_DELTA", "KEEP_DENSE", "GROUPED", "C"])
    return tuple(x for x in (h_out, dense, x8_TX, scale_TG) if x is not None)


def gated_rmsnorm_quant(
    o_TMD: torch.Tensor, z_TMD: torch.Tensor, w_D: torch.Tensor, eps: float, group: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [T, M*D], scale [T, G]) of gated_rmsnorm(o, z, w) flattened, per token or per group
    (a group must be one head: group == D)."""
    T, M, D = o_TMD.shape
    _check_rows("gated_rmsnorm_quant", o_TMD, z_TMD)
    if o_TMD.stride(1) != D or z_TMD.stride(1) != D:
        raise UnsupportedShape("gated_rmsnorm_quant: heads must lie end to end within a token")
    if D & (D - 1):
        raise UnsupportedShape(f"gated_rmsnorm_quant: head dim {D} must be a power of two")
    if group and group != D:
        raise UnsupportedShape(f"gated_rmsnorm_quant: group {group} must equal the head dim {D}")
    P = triton.next_power_of_2(M)
    if P * D > TILE_CHANNELS:
        raise UnsupportedShape(f"gated_rmsnorm_quant: {M} heads of {D} exceed one tile ({TILE_CHANNELS})")
    x8_TX, scale_TG = _outputs(T, M * D, group, o_TMD.device)
    args = (o_TMD, z_TMD, w_D, x8_TX, scale_TG, o_TMD.stride(0), z_TMD.stride(0), scale_TG.shape[1], eps)
    _launch(_gated_rmsnorm_quant_kernel, T, args, dict(M=M, GROUPED=bool(group), P=P, D=D), key=["M", "D", "GROUPED"])
    return x8_TX, scale_TG


def sigmoid_gate_quant(
    o_TND: torch.Tensor, gate_TND: torch.Tensor, group: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [T, N*D], scale [T, G]) of sigmoid_gate(o, gate): o * sigmoid(gate) flattened, per token
    or per `group` channels (within a head). gate may be a strided view (q_proj's [q | gate] rows)."""
    T, N, D = o_TND.shape
    _check_rows("sigmoid_gate_quant", o_TND, gate_TND)
    if not o_TND.is_contiguous():
        raise UnsupportedShape("sigmoid_gate_quant: the attention output must be contiguous")
    if D & (D - 1):
        raise UnsupportedShape(f"sigmoid_gate_quant: head dim {D} must be a power of two")
    _check_group("sigmoid_gate_quant", group, D)  # a group lies within one head
    C = group if group else min(D, 128)
    R = triton.next_power_of_2(N * D // C)
    if R * C > TILE_CHANNELS:
        raise UnsupportedShape(f"sigmoid_gate_quant: {N} heads of {D} exceed one tile ({TILE_CHANNELS})")
    x8_TX, scale_TG = _outputs(T, N * D, group, o_TND.device)
    args = (
        o_TND,
        gate_TND,
        x8_TX,
        scale_TG,
        o_TND.stride(0),
        gate_TND.stride(0),
        gate_TND.stride(1),
        scale_TG.shape[1],
    )
    consts = dict(N=N, D=D, GROUPED=bool(group), R=R, C=C)
    _launch(_sigmoid_gate_quant_kernel, T, args, consts, key=["N", "D", "GROUPED", "C"])
    return x8_TX, scale_TG


def silu_mul_quant(gate_TX: torch.Tensor, up_TX: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [T, X], scale [T, G]) of silu(gate) * up, per token or per `group` channels."""
    T, X = gate_TX.shape
    _check_rows("silu_mul_quant", gate_TX, up_TX)
    _check_group("silu_mul_quant", group, X)
    P, C = _tile(X, group)
    P = max(1, min(CHUNK_CHANNELS // C, P))  # the interpreter's chunk (the GPU's is tuned)
    x8_TX, scale_TG = _outputs(T, X, group, gate_TX.device)
    args = (gate_TX, up_TX, x8_TX, scale_TG, gate_TX.stride(0), up_TX.stride(0), scale_TG.shape[1])
    _launch(_silu_mul_quant_kernel, T, args, dict(X=X, GROUPED=bool(group), C=C), ["X", "GROUPED", "C"], P)
    return x8_TX, scale_TG
