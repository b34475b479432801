"""The Triton kernels that feed FP8 matmuls (extract/target/fp8/kernels.py) against the torch functions they
replace (the *_fp8 twins of extract/target/fp8/feeds.py) and against float64 math. On CPU they run under Triton's
interpreter (tests/conftest.py turns it on); the `gpu` tests run them compiled at 27B widths."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from extract.target.config import TargetConfig
from extract.target.fp8 import feeds
from extract.target.fp8 import kernels as K
from extract.target.fp8.quantization import Fp8BlockFormat
from extract.target.kernels import select_kernels
from extract.target.model import TargetModel
from extract.target.options import ForwardOptions
from shards.format import FP8_E4M3_MAX
from tools.fixtures.tiny_target import random_weights, tiny_config_dict

EPS = 1e-6


def spread(*shape, seed=0, device="cpu"):
    """bf16 values over six decades (every e4m3 binade, subnormals included, after scaling)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 10.0 ** (torch.rand(*shape, generator=g) * 6 - 3)
    return x.to(torch.bfloat16).to(device)


def rows_view(T, X, seed, device="cpu"):
    """[T, X] as the second column slice of a [T, 2X] tensor (a concatenated matmul's output)."""
    return spread(T, 2 * X, seed=seed, device=device)[:, X:]


def assert_same_quantised(got, want):
    """e4m3 codes equal but for rare one-step differences (another summation order), scales to fp32
    rounding, dense outputs to one bf16 step."""
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        if g.dtype == torch.float8_e4m3fn:
            diff = g.float() != w.float()
            assert diff.float().mean().item() <= 1e-3
            step = w.float().abs().clamp(min=2**-6) / 8  # one e4m3 step at that magnitude
            assert ((g.float() - w.float()).abs() <= step * 1.01).all()
        else:
            torch.testing.assert_close(g.float(), w.float(), rtol=2**-7, atol=1e-30)


def feed_cases(device="cpu", T=5, H=320, F_=300, heads=6, D=16, attn_heads=3, attn_D=32):
    h, d = spread(T, H, seed=1, device=device), spread(T, H, seed=2, device=device)
    w = (0.1 * spread(H, seed=3)).to(device)
    o = spread(T, heads, D, seed=4, device=device)
    z = rows_view(T, heads * D, seed=5, device=device).view(T, heads, D)
    wg = spread(D, seed=6).to(device)
    gate, up = rows_view(T, F_, seed=7, device=device), rows_view(T, F_, seed=8, device=device)
    # attention: o [T, N, D]; the gate a strided view of q_proj's per-head [q | gate] rows
    o_attn = spread(T, attn_heads, attn_D, seed=12, device=device)
    gate_attn = spread(T, attn_heads, 2 * attn_D, seed=13, device=device)[..., attn_D:]
    return {
        "sigmoid_gate_fp8": (o_attn, gate_attn),
        "zero_centred_rmsnorm_fp8": (h, w, EPS),
        "zero_centred_rmsnorm_fp8_dense": (h, w, EPS),
        "add_zero_centred_rmsnorm_fp8": (h, d, w, EPS),
        "add_zero_centred_rmsnorm_fp8_dense": (h, d, w, EPS),
        "gated_rmsnorm_fp8": (o, z, wg, EPS),
        "silu_mul_fp8": (gate, up),
    }


@pytest.mark.parametrize("variant", sorted(feeds.FEED_KERNELS))
@pytest.mark.parametrize("group", [0, 16])  # rowwise, and per 16 channels (block mode at tiny width)
def test_feed_kernel_equals_the_torch_function(variant, group):
    """Under the interpreter the kernels and the eager functions are the same arithmetic: bit for bit."""
    args = (*feed_cases(F_=320)[variant], group)  # F = 320: whole groups of 16 for silu-mul too
    got, want = feeds.FEED_KERNELS[variant](*args), getattr(feeds, variant)(*args)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(_bits(g), _bits(w)), (variant, g.dtype)


def test_silu_mul_over_several_chunks_and_a_partial_one():
    # F = 17408 (the 27B MLP) is walked in chunks of CHUNK_CHANNELS: 8.5 chunks, the last one partial.
    gate, up = rows_view(2, 17408, seed=9), rows_view(2, 17408, seed=10)
    assert_same_quantised(K.silu_mul_quant(gate, up), feeds.silu_mul_fp8(gate, up, 0))


def float64_feed(variant, args):
    """The op in float64 (no intermediate roundings): what the quantised output approximates."""
    a = [x.double() if isinstance(x, torch.Tensor) else x for x in args]
    if variant == "silu_mul_fp8":
        return F.silu(a[0]) * a[1]
    if variant == "sigmoid_gate_fp8":
        return (a[0] * torch.sigmoid(a[1])).reshape(a[0].shape[0], -1)
    if variant == "gated_rmsnorm_fp8":
        o, z, w, eps = a
        y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * w * F.silu(z)
        return y.reshape(y.shape[0], -1)
    h, w, eps = (a[0] + a[1], a[2], a[3]) if variant.startswith("add") else (a[0], a[1], a[2])
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


@pytest.mark.parametrize("group", [0, 16])
@pytest.mark.parametrize(
    "variant", ["add_zero_centred_rmsnorm_fp8", "gated_rmsnorm_fp8", "sigmoid_gate_fp8", "silu_mul_fp8"]
)
def test_quantised_output_against_float64(variant, group):
    """x8 * scale is the float64 op to e4m3's half step plus the bf16 roundings on the way, each
    scale maps its row's (or group's) amax onto 448."""
    args = feed_cases(H=320, F_=320, D=16)[variant]
    kernel = {
        "add_zero_centred_rmsnorm_fp8": lambda h, d, w, eps: K.add_rmsnorm_quant(h, d, w, eps, group)[1:],
        "gated_rmsnorm_fp8": lambda o, z, w, eps: K.gated_rmsnorm_quant(o, z, w, eps, group),
        "sigmoid_gate_fp8": lambda o, gate: K.sigmoid_gate_quant(o, gate, group),
        "silu_mul_fp8": lambda g, u: K.silu_mul_quant(g, u, group),
    }[variant]
    x8, scale = kernel(*args)
    want = float64_feed(variant, args)
    T, X = want.shape
    G = X // group if group else 1
    assert scale.shape == (T, G) and scale.dtype == torch.float32
    want_g = want.view(T, G, -1)
    amax = want_g.abs().amax(-1)
    torch.testing.assert_close(scale.double(), amax / FP8_E4M3_MAX, rtol=2e-2, atol=0)
    got_g = x8.double().view(T, G, -1) * scale.double()[..., None]
    # e4m3 keeps 3 mantissa bits (half step 2^-4 relative); subnormals a fixed 2^-10 of the scale's 448.
    bound = want_g.abs() * (2**-4 + 3 * 2**-8) + scale.double()[..., None] * 2**-10 + 1e-12
    assert ((got_g - want_g).abs() <= bound).all()


def test_an_all_zero_row_gets_the_floor_scale_and_zero_codes():
    gate = torch.zeros(3, 256, dtype=torch.bfloat16)
    x8, scale = K.silu_mul_quant(gate, spread(3, 256, seed=11))
    assert (x8.float() == 0).all()
    torch.testing.assert_close(scale, torch.full((3, 1), 1e-12 / FP8_E4M3_MAX))


@pytest.mark.parametrize(
    "call",
    [
        lambda: K.silu_mul_quant(spread(2, 96).float(), spread(2, 96).float()),  # not bf16
        lambda: K.silu_mul_quant(spread(2, 96), spread(2, 96), group=64),  # group does not divide 96
        lambda: K.gated_rmsnorm_quant(spread(2, 3, 12), spread(2, 3, 12), spread(12), EPS),  # head dim 12
        lambda: K.add_rmsnorm_quant(spread(2, 9000), None, spread(9000), EPS),  # wider than one tile
        lambda: K.add_rmsnorm_quant(spread(2, 64, 2)[..., 0], None, spread(64), EPS),  # strided channels
    ],
)
def test_inputs_a_kernel_does_not_cover_are_refused_by_name(call):
    with pytest.raises(K.UnsupportedShape):
        call()


def tiny_fp8_model(feed_kernels: bool, block: int | None = None, **cfg):
    """The tiny target under FP8 compute: rowwise, or block-scaled with block x block blocks (an FP8
    checkpoint's mode; the feeds then quantise per `block` channels)."""
    target = TargetConfig.from_hf_dict(tiny_config_dict(num_hidden_layers=4, **cfg))
    state = random_weights(target, seed=0, dtype=torch.bfloat16)
    kernels = select_kernels("cpu", gated_delta="torch", conv="torch", attention="sdpa", fp8_feed_kernels=feed_kernels)
    model = TargetModel.from_state_dict(target, state, kernels, dtype=torch.bfloat16)
    return model.use_fp8_compute(block=None if block is None else Fp8BlockFormat(block_n=block, block_k=block))


def packed_batch(vocab, lengths=(7, 12, 5)):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    return ids, pos, cu


@pytest.mark.parametrize("block", [None, 16])  # 16: every tiny width is whole groups, as 128 at 27B width
def test_fp8_forward_with_the_kernels_equals_the_torch_functions(block):
    """The tiny target under --compute fp8 (rowwise, and block-scaled), every feed through the Triton
    kernels vs through the torch functions (ForwardOptions.feed_kernels off): the same taps but for rounding."""
    model = tiny_fp8_model(feed_kernels=True, block=block)
    ids, pos, cu = packed_batch(model.config.vocab_size)
    taps = [3]  # untapped layers 1-2 take the residual add inside their input norm
    calls = {}
    for name, fn in list(model.pw.feed_kernels.items()):
        model.pw.feed_kernels[name] = lambda *a, _fn=fn, _n=name: calls.__setitem__(_n, 1) or _fn(*a)
    with_kernels = model.forward_packed(ids, pos, cu, taps)
    assert set(calls) == set(feeds.FEED_KERNELS) - {"zero_centred_rmsnorm_fp8"}  # layer 0 is GatedDeltaNet
    model.set_forward_options(ForwardOptions(feed_kernels=False))
    calls.clear()
    without = model.forward_packed(ids, pos, cu, taps)
    assert not calls
    rel = (with_kernels.float() - without.float()).norm() / without.float().norm()
    assert math.isfinite(rel.item()) and rel.item() < 2e-2, rel  # a rare e4m3 step, carried through 4 layers


def test_a_head_dim_the_kernel_does_not_cover_falls_back_once(caplog):
    model = tiny_fp8_model(feed_kernels=True)
    ids, pos, cu = packed_batch(model.config.vocab_size)
    model.pw.feed_kernels["gated_rmsnorm_fp8"] = lambda o, z, w, eps, group: K.gated_rmsnorm_quant(
        o, z, w, eps, group=8
    )  # refuses
    with caplog.at_level("INFO", logger="extract.target.pointwise"):
        first = model.forward_packed(ids, pos, cu, [3])
        second = model.forward_packed(ids, pos, cu, [3])
    lines = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
    assert len(lines) == 1 and "gated_rmsnorm_fp8" in lines[0] and "group 8" in lines[0]
    assert "gated_rmsnorm_fp8" not in model.pw.feed_kernels
    assert torch.equal(first, second)


# ---- GPU: compiled kernels at the 27B widths -----------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("group", [0, 128])  # rowwise, and block mode's activations per 128 channels
@pytest.mark.parametrize("variant", sorted(feeds.FEED_KERNELS))
def test_feed_kernel_equals_the_torch_function_at_27b_width_on_cuda(variant, group):
    cases = feed_cases(device="cuda", T=512, H=5120, F_=17408, heads=48, D=128, attn_heads=24, attn_D=256)
    args = (*cases[variant], group)
    assert_same_quantised(feeds.FEED_KERNELS[variant](*args), getattr(feeds, variant)(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("group", [0, 128])
def test_grouped_quantisation_against_float64_on_cuda(group):
    args = feed_cases(device="cuda", T=256, H=5120, F_=17408, heads=48, D=128, attn_heads=24, attn_D=256)
    for variant, kernel in (
        ("sigmoid_gate_fp8", lambda o, gate: K.sigmoid_gate_quant(o, gate, group)),
        ("add_zero_centred_rmsnorm_fp8", lambda h, d, w, eps: K.add_rmsnorm_quant(h, d, w, eps, group)[1:]),
        ("gated_rmsnorm_fp8", lambda o, z, w, eps: K.gated_rmsnorm_quant(o, z, w, eps, group)),
        ("silu_mul_fp8", lambda g, u: K.silu_mul_quant(g, u, group)),
    ):
        x8, scale = kernel(*args[variant])
        want = float64_feed(variant, args[variant])
        T, X = want.shape
        G = X // group if group else 1
        got = (x8.double().view(T, G, -1) * scale.double()[..., None]).view(T, X)
        bound = want.abs() * (2**-4 + 3 * 2**-8) + scale.double().repeat_interleave(X // G, 1) * 2**-10
        assert ((got - want).abs() <= bound).all(), variant


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("variant", sorted(feeds.FEED_KERNELS))
def test_a_nan_makes_its_row_nan_as_in_torch(variant, device):
    """A NaN (a diverged attention or GatedDeltaNet output) must reach the writer's finite check: its
    token's scale NaN, as the torch function gives (the matmul then writes that row NaN), the other
    tokens untouched. On the GPU tl.max and tl.maximum drop NaNs unless told; the interpreter keeps
    them either way. (Codes are not compared: the interpreter's cast of NaN to e4m3 is not NaN.) The
    other rows are held to the kernel's own output on the clean input, bit for bit: against the torch
    function they may differ at e4m3 ties (1.6% of these values for the residual add; the GPU's rsqrt
    is not torch's to the last bit), which test_feed_kernel_equals_the_torch_function covers."""
    clean = list(feed_cases(device=device)[variant])
    poisoned = clean[0].clone()
    poisoned.view(poisoned.shape[0], -1)[2, 7] = float("nan")
    args = (poisoned, *clean[1:], 0)
    got, want = feeds.FEED_KERNELS[variant](*args), getattr(feeds, variant)(*args)
    assert torch.isnan(got[-1][2]).all() and torch.isnan(want[-1][2]).all()
    keep = [0, 1, 3, 4]
    unpoisoned = feeds.FEED_KERNELS[variant](*clean, 0)
    for g, u in zip(got, unpoisoned, strict=True):
        assert torch.equal(_bits(g[keep]), _bits(u[keep]))


def _bits(x: torch.Tensor) -> torch.Tensor:
    """e4m3 as its bytes (compared bit for bit, NaN codes included), other dtypes as they are."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def test_every_kernel_compiles_for_hopper_and_ada_without_a_gpu():
    """The GPU path (not the interpreter's) compiles: each kernel, rowwise and grouped, to sm_90 and
    sm_89 code, with two IEEE divisions per scale (448 / amax and amax / 448: an approximate one moved
    e4m3 ties on the H200) and no approximate one in the norm (silu and sigmoid may: their outputs
    are rounded to bf16), NaN-propagating maxima, and an e4m3 conversion that rounds once: on sm_90
    the hardware's from fp32; on sm_89, where Triton converts through fp16, after rounding the fp32
    bits (the software rounding's 1.5 * 2^14 constant is in the code)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("fp8_kernels_aot.py"))],
        env={**env, "PYTHONPATH": str(Path(__file__).parents[4])},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    kernels = ("add_rmsnorm_quant", "gated_rmsnorm_quant", "sigmoid_gate_quant", "silu_mul_quant")
    assert sorted((r["kernel"], r["arch"], r["grouped"]) for r in rows) == sorted(
        (f"_{name}_kernel", arch, grouped) for name in kernels for arch in (89, 90) for grouped in (False, True)
    )
    for r in rows:
        assert r["cubin"] and r["max.NaN.f32"] > 0, r
        assert r["div.rn.f32"] == 2 if not r["grouped"] else r["div.rn.f32"] >= 2, r
        if r["kernel"] == "_add_rmsnorm_quant_kernel":
            assert r["div.full.f32"] == 0, r
        if r["arch"] == 90:
            assert r["cvt.rn.satfinite.e4m3x2.f32"] > 0 and r["cvt.rz.f16.f32"] == 0 and r["0f46C00000"] == 0, r
        else:
            assert r["0f46C00000"] > 0, r
