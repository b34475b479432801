"""--compute fp8: rowwise e4m3 quantisation, torch._scaled_mm linear layers, the fused pointwise
feeds, and extraction end to end (CPU: torch's CPU _scaled_mm runs the same code as the GPU)."""

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from extract.cli import main as extract_cli
from extract.config import ExtractConfig
from extract.data import Sample, write_jsonl
from extract.kernels import select_kernels
from extract.model import FP8_LINEARS, Fp8Input, Pointwise, TargetModel, linear, silu_mul, zero_centred_rmsnorm
from extract.quantization import quantize_rows_fp8
from extract.target_config import TargetConfig
from shards import read_cache_config
from tools.tiny_target import qwen35_27b_config_dict, random_weights, tiny_config_dict, write_random_checkpoint


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_rowwise_quantisation_error_is_within_half_an_e4m3_step():
    x = torch.randn(64, 96, dtype=torch.float64) * torch.logspace(-3, 3, 64, dtype=torch.float64)[:, None]
    x[3] = 0.0
    x8, scale = quantize_rows_fp8(x.to(torch.bfloat16))
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (64, 1) and scale.dtype == torch.float32
    xb = x.to(torch.bfloat16).double()
    amax = xb.abs().amax(1, keepdim=True)
    assert torch.allclose(scale.double()[amax > 0], (amax / 448.0)[amax > 0], rtol=1e-6)
    back = x8.double() * scale.double()
    # e4m3: 3 mantissa bits -> half a step is 2^-4 relative; subnormals step 2^-9 (half: 2^-10) of the scale
    bound = torch.maximum(xb.abs() * 2.0**-4, scale.double() * 2.0**-10) * (1 + 1e-6)
    assert ((back - xb).abs() <= bound).all()
    assert (back[3] == 0).all() and torch.isfinite(scale).all()


@pytest.mark.parametrize("t, k, n", [(37, 64, 160), (8, 128, 48)])
def test_fp8_linear_equals_the_float64_product_of_its_quantised_operands(t, k, n):
    gen = torch.Generator().manual_seed(t)
    layer = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    layer.weight.data = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16)
    w8, ws = quantize_rows_fp8(layer.weight)
    layer.register_buffer("weight_fp8", w8)
    layer.register_buffer("weight_scale_1N", ws.t().contiguous())
    x8, xs = quantize_rows_fp8(x)
    y = linear(layer, Fp8Input(x8, xs))
    assert y.dtype == torch.bfloat16 and y.shape == (t, n)
    ref = (x8.double() * xs.double()) @ (w8.double() * ws.double()).t()  # independent: dequantise, then multiply
    assert torch.allclose(y.double(), ref, rtol=2**-7, atol=1e-3 * ref.abs().max().item())
    assert 0.005 < _rel(y, x.double() @ layer.weight.double().t()) < 0.1  # fp8 really is coarser than bf16


@pytest.mark.parametrize("keep_dense", [False, True])
def test_pointwise_feed_quantises_the_op_output_per_token(keep_dense):
    pw = Pointwise(compiled=False)
    pw.fp8 = True
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    w = (0.1 * torch.randn(64, generator=gen)).to(torch.bfloat16)
    fed = pw.feed("zero_centred_rmsnorm", h, w, 1e-6, keep_dense=keep_dense)
    dense = zero_centred_rmsnorm(h, w, 1e-6)
    x8, scale = quantize_rows_fp8(dense)
    assert torch.equal(fed.x8_TX.view(torch.uint8), x8.view(torch.uint8)) and torch.equal(fed.scale_T1, scale)
    assert (fed.dense is not None) == keep_dense and (not keep_dense or torch.equal(fed.dense, dense))
    a, b = torch.randn(2, 20, 96, generator=gen).to(torch.bfloat16)
    fed = pw.feed("silu_mul", a, b)
    assert _rel(fed.x8_TX.double() * fed.scale_T1.double(), silu_mul(a, b)) < 0.04
    pw.fp8 = False
    assert torch.equal(pw.feed("silu_mul", a, b), silu_mul(a, b))


def _models(compute_modes, dtype=torch.bfloat16):
    cfg = TargetConfig.from_hf_dict(tiny_config_dict())
    state = random_weights(cfg, seed=0, with_head=False)
    kernels = select_kernels("cpu")
    return [TargetModel.from_state_dict(cfg, state, kernels, dtype=dtype, compute=c) for c in compute_modes]


def test_fp8_model_is_close_to_dense_and_holds_only_fp8_linears():
    dense, fp8 = _models(["dense", "fp8"])
    (ref,) = _models(["dense"], dtype=torch.float32)
    converted = [n for n, m in fp8.named_modules() if getattr(m, "weight_fp8", None) is not None]
    assert converted and all(n.rsplit(".", 1)[-1] in FP8_LINEARS for n in converted)
    assert all(m.weight is None for n, m in fp8.named_modules() if n in converted)
    assert fp8.layers[0].linear_attn.in_proj_a.weight is not None  # dense: feeds the decay
    rng = np.random.default_rng(1)
    ids = torch.from_numpy(rng.integers(0, 512, size=70))
    pos = torch.cat([torch.arange(30), torch.arange(40)])
    cu = torch.tensor([0, 30, 70])
    taps = [1, 3, 6]
    a, b, c = (m.forward_packed(ids, pos, cu, taps) for m in (dense, fp8, ref))
    for j in range(len(taps)):
        e_dense, e_fp8 = _rel(a[:, j], c[:, j]), _rel(b[:, j], c[:, j])
        # measured on this tiny random target: bf16 0.7-1.9%, fp8 5-13% (random weights amplify errors)
        assert e_dense < 0.03 and 2 * e_dense < e_fp8 < 0.2, (j, e_dense, e_fp8)
    # sequences stay independent under fp8 (per-token scales never mix tokens)
    alone = fp8.forward_packed(ids[30:], pos[30:], torch.tensor([0, 40]), taps)
    assert torch.equal(alone, b[30:])


def test_fp8_compute_refusals(tmp_path):
    target = write_random_checkpoint(tmp_path / "t", seed=0)
    with pytest.raises(ValueError, match="--dtype.*bfloat16"):
        ExtractConfig(target=str(target), data="x", out_dir=str(tmp_path / "o"), compute="fp8", dtype="float32")
    (fp32,) = _models(["dense"], dtype=torch.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        fp32.use_fp8_compute()


def test_extract_with_fp8_compute_records_it_and_refuses_a_dense_resume(tmp_path):
    target = write_random_checkpoint(tmp_path / "t", seed=2, fp8_block=32)
    data = tmp_path / "d.jsonl"
    write_jsonl(data, [Sample(f"s{i}", np.arange(1, 30 + i), np.ones(29 + i, np.uint8)) for i in range(4)])
    out = tmp_path / "cache"
    args = ["--target", str(target), "--data", str(data), "--out", str(out), "--token-budget", "128", "--max-seqs", "4"]
    result = CliRunner().invoke(extract_cli, args + ["--compute", "fp8", "--storage", "fp8"])
    assert result.exit_code == 0, result.output
    info = read_cache_config(out).target
    assert info.compute == "fp8" and info.quantization.startswith("fp8 e4m3, 32x32 blocks")
    again = CliRunner().invoke(extract_cli, args)
    assert again.exit_code != 0 and "compute" in again.output and "Traceback" not in again.output


# ---- GPU: error bounds at 27B width -------------------------------------------------------------
@pytest.mark.gpu
def test_fp8_layers_at_27b_width_against_bf16_and_fp32():
    """One GatedDeltaNet and one attention layer of the 27B shape (plus two more GDN layers), fp8 vs
    bf16 vs an fp32 reference, on 2 packed sequences; one FP8 matmul (fast accumulation) also vs its
    float64 product. Eager pointwise ops throughout: no compile time (the benchmark covers compiled)."""
    device = torch.device("cuda")
    cfg = TargetConfig.from_hf_dict(qwen35_27b_config_dict(num_hidden_layers=4, vocab_size=4096))
    state = random_weights(cfg, seed=0, device=device, with_head=False, dtype=torch.float32)
    # fp32 reference on the torch kernels (varlen flash attention has no fp32)
    slow = select_kernels(
        device, allow_slow_kernels=True, gated_delta="torch", conv="torch", attention="sdpa", compile_pointwise=False
    )
    fast = select_kernels(device, compile_pointwise=False)
    ref = TargetModel.from_state_dict(cfg, state, slow, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (3072,), generator=gen).to(device)
    pos = torch.cat([torch.arange(1024), torch.arange(2048)]).to(device)
    cu = torch.tensor([0, 1024, 3072])
    taps = [0, 1, 2, 3]
    want = ref.forward_packed(ids, pos, cu, taps).float()
    del ref
    got = {}
    for compute in ("dense", "fp8"):
        model = TargetModel.from_state_dict(cfg, state, fast, dtype=torch.bfloat16, compute=compute)
        got[compute] = model.forward_packed(ids, pos, cu, taps).float()
        if compute == "fp8":
            layer = model.layers[0].mlp.down_proj  # K = 17408: the longest accumulation
            x = torch.randn(1024, cfg.intermediate_size, device=device).to(torch.bfloat16)
            x8, xs = quantize_rows_fp8(x)
            y = linear(layer, Fp8Input(x8, xs))
            exact = (x8.double() * xs.double()) @ (layer.weight_fp8.double() * layer.weight_scale_1N.double().t()).t()
            assert _rel(y, exact) < 5e-3, _rel(y, exact)  # fast accumulation + bf16 output rounding only
        del model
    for j in range(len(taps)):
        e_bf16, e_fp8 = _rel(got["dense"][:, j], want[:, j]), _rel(got["fp8"][:, j], want[:, j])
        print(
            f"tap {j}: bf16 {e_bf16:.2e}, fp8 {e_fp8:.2e}, fp8 vs bf16 {_rel(got['fp8'][:, j], got['dense'][:, j]):.2e}"
        )
        assert torch.isfinite(got["fp8"]).all()
        assert e_bf16 < 0.02 and e_fp8 < 0.08
