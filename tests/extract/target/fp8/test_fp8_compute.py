"""--compute fp8: rowwise e4m3 quantisation, torch._scaled_mm linear layers, the fused pointwise
feeds, the forward's memory-traffic cuts (ForwardOptions), and extraction end to end (CPU: torch's
CPU _scaled_mm runs the same code as the GPU)."""

import dataclasses
import logging

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from extract.cli import main as extract_cli
from extract.config import ExtractConfig
from extract.dataset.index import Sample, write_jsonl
from extract.target.config import TargetConfig
from extract.target.fp8.linear import FP8_LINEARS, Fp8Input, grouped_linears, linear
from extract.target.fp8.quantization import quantize_rows_fp8
from extract.target.kernels import select_kernels
from extract.target.model import TargetModel
from extract.target.ops import silu_mul, zero_centred_rmsnorm
from extract.target.options import ForwardOptions
from extract.target.pointwise import Pointwise
from shards import read_cache_config
from tests.helpers.extract import rel_l2, two_sequences_27b
from tools.fixtures.tiny_target import qwen35_27b_config_dict, random_weights, tiny_config_dict, write_random_checkpoint


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
    assert 0.005 < rel_l2(y, x.double() @ layer.weight.double().t()) < 0.1  # fp8 really is coarser than bf16


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
    assert torch.equal(fed.x8_TX.view(torch.uint8), x8.view(torch.uint8)) and torch.equal(fed.scale_TG, scale)
    assert (fed.dense is not None) == keep_dense and (not keep_dense or torch.equal(fed.dense, dense))
    a, b = torch.randn(2, 20, 96, generator=gen).to(torch.bfloat16)
    fed = pw.feed("silu_mul", a, b)
    assert rel_l2(fed.x8_TX.double() * fed.scale_TG.double(), silu_mul(a, b)) < 0.04
    pw.fp8 = False
    assert torch.equal(pw.feed("silu_mul", a, b), silu_mul(a, b))


@pytest.mark.parametrize("keep_dense", [False, True])
def test_fused_residual_norm_and_quantisation_equal_the_float64_sequence(keep_dense):
    """add_zero_centred_rmsnorm under FP8: h + delta (the new residual, rounded to bf16 once), and the
    e4m3 rows of its zero-centred norm with per-token scales, against float64 arithmetic."""
    pw = Pointwise(compiled=False)
    pw.fp8 = True
    gen = torch.Generator().manual_seed(3)
    h, delta = (torch.randn(2, 24, 128, generator=gen) * torch.logspace(-1, 2, 24)[None, :, None]).to(torch.bfloat16)
    w = (0.2 * torch.randn(128, generator=gen)).to(torch.bfloat16)
    h_new, fed = pw.feed("add_zero_centred_rmsnorm", h, delta, w, 1e-6, keep_dense=keep_dense)
    h64 = (h.double() + delta.double()).to(torch.bfloat16).double()  # one rounding of the exact sum
    assert h_new.dtype == torch.bfloat16 and torch.equal(h_new.double(), h64)
    y64 = h64 / torch.sqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.double())
    amax = y64.abs().amax(-1, keepdim=True)
    assert torch.allclose(fed.scale_TG.double(), amax / 448.0, rtol=2**-7)  # the norm output is bf16 first
    back = fed.x8_TX.double() * fed.scale_TG.double()
    # half an e4m3 step (2^-4 relative, 2^-10 of the scale for subnormals) plus the bf16 rounding of y
    bound = y64.abs() * (2.0**-4 + 2.0**-7) + fed.scale_TG.double() * 2.0**-10
    assert ((back - y64).abs() <= bound).all(), (back - y64).abs().max()
    if keep_dense:
        assert torch.allclose(fed.dense.double(), y64, rtol=2**-7, atol=0)
    else:
        assert fed.dense is None


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
        e_dense, e_fp8 = rel_l2(a[:, j], c[:, j]), rel_l2(b[:, j], c[:, j])
        # measured on this tiny random target: bf16 0.7-1.9%, fp8 5-13% (random weights amplify errors)
        assert e_dense < 0.03 and 2 * e_dense < e_fp8 < 0.2, (j, e_dense, e_fp8)
    # sequences stay independent under fp8 (per-token scales never mix tokens)
    alone = fp8.forward_packed(ids[30:], pos[30:], torch.tensor([0, 40]), taps)
    assert torch.equal(alone, b[30:])


@pytest.mark.parametrize("compute", ["dense", "fp8"])
def test_each_forward_cut_switched_off_gives_the_same_hidden_states(compute):
    """ForwardOptions only move memory traffic: with any one cut off, the taps are bit-identical in
    eager mode (the fused residual adds in bf16 like the separate add; the depthwise conv per channel
    group is the same arithmetic; a concatenated matmul's columns are the separate matmuls')."""
    (model,) = _models([compute])
    rng = np.random.default_rng(4)
    ids = torch.from_numpy(rng.integers(0, 512, size=70))
    pos = torch.cat([torch.arange(30), torch.arange(40)])
    cu = torch.tensor([0, 30, 70])
    taps = [1, 3, 6]
    want = model.forward_packed(ids, pos, cu, taps)
    # feed_kernels is left out: on the H200 the Triton kernels and the eager functions they replace
    # gave taps 0.8% apart at layer 0 (3.6% at layer 3), while each kernel equals its function at 27B
    # width on random inputs (tests/extract/target/fp8/test_fp8_kernels.py) and under the interpreter the same forward
    # is exact at layer 0; not explained. test_fp8_layers_at_27b_width_against_bf16_and_fp32 holds
    # the kernels to the functions' accuracy against fp32 instead.
    for field in [f for f in dataclasses.fields(ForwardOptions) if f.name != "feed_kernels"]:
        model.set_forward_options(ForwardOptions(**{field.name: False}))
        got = model.forward_packed(ids, pos, cu, taps)
        assert torch.equal(got, want), (field.name, (got.float() - want.float()).abs().max())
    model.set_forward_options(ForwardOptions(fuse_residual=False, split_conv=False, concat_linears=False))
    assert torch.equal(model.forward_packed(ids, pos, cu, taps), want)
    with pytest.raises(ValueError, match="ForwardOptions.split_conv"):
        ForwardOptions(split_conv=1)


def test_concatenated_groups_equal_their_layers_one_by_one():
    """Under FP8 compute each LINEAR_GROUPS entry is one matmul over concatenated weights, each
    layer's weight a view into it; its output columns equal each layer's own product (float64
    reference from the quantised operands), and the dense a|b group equals the two dense layers."""
    (fp8,) = _models(["fp8"])
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(33, fp8.config.hidden_size, generator=gen).to(torch.bfloat16)
    fed = Fp8Input(*quantize_rows_fp8(x), dense=x)
    x64 = fed.x8_TX.double() * fed.scale_TG.double()
    gdn, attn = fp8.layers[0].linear_attn, fp8.layers[3].self_attn
    checked = 0
    for module in (gdn, attn, fp8.layers[0].mlp):
        for group, names in module.LINEAR_GROUPS.items():
            outs = grouped_linears(module, group, fed, ForwardOptions())
            assert len(outs) == len(names)
            for name, y in zip(names, outs):
                layer = getattr(module, name)
                if layer.weight is None:  # FP8: a row slice of the group's e4m3 matrix
                    assert layer.weight_fp8.data_ptr() >= getattr(module, f"{group}_weight").data_ptr()
                    ref = x64 @ (layer.weight_fp8.double() * layer.weight_scale_1N.double().t()).t()
                else:  # dense a|b: the dense input, bf16 weights
                    ref = x.double() @ layer.weight.double().t()
                assert y.shape == ref.shape and y.dtype == torch.bfloat16
                assert torch.allclose(y.double(), ref, rtol=2**-7, atol=1e-3 * ref.abs().max().item()), (group, name)
                checked += 1
    assert checked == 2 + 2 + 3 + 2
    assert gdn.in_proj_qkv.weight_fp8.untyped_storage().data_ptr() == gdn.qkvz_weight.untyped_storage().data_ptr()


def test_fp8_compute_refusals(tmp_path):
    target = write_random_checkpoint(tmp_path / "t", seed=0)
    with pytest.raises(ValueError, match="--dtype.*bfloat16"):
        ExtractConfig(target=str(target), data="x", out_dir=str(tmp_path / "o"), compute="fp8", dtype="float32")
    (fp32,) = _models(["dense"], dtype=torch.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        fp32.use_fp8_compute()


def test_extract_with_fp8_compute_records_it_and_refuses_a_dense_resume(tmp_path, caplog):
    target = write_random_checkpoint(tmp_path / "t", seed=2, fp8_block=32)
    data = tmp_path / "d.jsonl"
    write_jsonl(data, [Sample(f"s{i}", np.arange(1, 30 + i), np.ones(29 + i, np.uint8)) for i in range(4)])
    out = tmp_path / "cache"
    args = ["--target", str(target), "--data", str(data), "--out", str(out), "--token-budget", "128", "--max-seqs", "4"]
    caplog.set_level(logging.INFO)
    dense = CliRunner().invoke(extract_cli, [*args[:5], str(tmp_path / "dense"), *args[6:]])
    assert dense.exit_code == 0, dense.output
    assert "kernel fp8 feeds" not in caplog.text, "FP8 compute is off: its feed kernels are not announced"
    caplog.clear()
    result = CliRunner().invoke(extract_cli, args + ["--compute", "fp8", "--storage", "fp8"])
    assert result.exit_code == 0, result.output
    assert caplog.text.count("kernel fp8 feeds:") == 1, caplog.text
    info = read_cache_config(out).target
    # an FP8 checkpoint under fp8 compute runs its own block scales: part of the cache's identity
    assert info.compute == "fp8" and info.quantization.startswith("fp8 e4m3, 32x32 blocks (kept as stored")
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
    ids, pos, cu, taps = two_sequences_27b(device, first_len=1024)
    want = ref.forward_packed(ids, pos, cu, taps).float()
    del ref
    got = {}
    for compute in ("dense", "fp8"):
        model = TargetModel.from_state_dict(cfg, state, fast, dtype=torch.bfloat16, compute=compute)
        got[compute] = model.forward_packed(ids, pos, cu, taps).float()
        if compute == "fp8":  # the Triton feed kernels (default) and the pointwise functions they replace
            model.set_forward_options(ForwardOptions(feed_kernels=False))
            got["fp8_functions"] = model.forward_packed(ids, pos, cu, taps).float()
            layer = model.layers[0].mlp.down_proj  # K = 17408: the longest accumulation
            x = torch.randn(1024, cfg.intermediate_size, device=device).to(torch.bfloat16)
            x8, xs = quantize_rows_fp8(x)
            y = linear(layer, Fp8Input(x8, xs))
            exact = (x8.double() * xs.double()) @ (layer.weight_fp8.double() * layer.weight_scale_1N.double().t()).t()
            assert rel_l2(y, exact) < 5e-3, rel_l2(y, exact)  # fast accumulation + bf16 output rounding only
        del model
    for j in range(len(taps)):
        e_bf16, e_fp8 = rel_l2(got["dense"][:, j], want[:, j]), rel_l2(got["fp8"][:, j], want[:, j])
        print(
            f"tap {j}: bf16 {e_bf16:.2e}, fp8 {e_fp8:.2e}, fp8 vs bf16 {rel_l2(got['fp8'][:, j], got['dense'][:, j]):.2e}"
        )
        assert torch.isfinite(got["fp8"]).all()
        assert e_bf16 < 0.02 and e_fp8 < 0.08
        # The feed kernels round as the functions do but not always to the same e4m3 code (see the cuts
        # test): they must be as accurate, not equal.
        assert e_fp8 <= 1.15 * rel_l2(got["fp8_functions"][:, j], want[:, j])


@pytest.mark.gpu
def test_forward_cuts_agree_on_the_fast_kernels_at_27b_width():
    """Each ForwardOptions cut off vs all on, FP8 compute on the fast kernels at 27B width (the conv on
    channel slices of a concatenated matmul's output, fla on contiguous q/k/v, varlen attention on a
    strided v), 2 packed sequences; and the per-group conv equals the whole conv, contiguous."""
    device = torch.device("cuda")
    cfg = TargetConfig.from_hf_dict(qwen35_27b_config_dict(num_hidden_layers=4, vocab_size=4096))
    state = random_weights(cfg, seed=1, device=device, with_head=False, dtype=torch.bfloat16)
    kernels = select_kernels(device, compile_pointwise=False)
    model = TargetModel.from_state_dict(cfg, state, kernels, dtype=torch.bfloat16, compute="fp8")
    ids, pos, cu, taps = two_sequences_27b(device, first_len=1000)
    want = model.forward_packed(ids, pos, cu, taps).float()
    # feed_kernels is left out: on the H200 the Triton kernels and the eager functions they replace
    # gave taps 0.8% apart at layer 0 (3.6% at layer 3), while each kernel equals its function at 27B
    # width on random inputs (tests/extract/target/fp8/test_fp8_kernels.py) and under the interpreter the same forward
    # is exact at layer 0; not explained. test_fp8_layers_at_27b_width_against_bf16_and_fp32 holds
    # the kernels to the functions' accuracy against fp32 instead.
    for field in [f for f in dataclasses.fields(ForwardOptions) if f.name != "feed_kernels"]:
        model.set_forward_options(ForwardOptions(**{field.name: False}))
        got = model.forward_packed(ids, pos, cu, taps).float()
        errs = [rel_l2(got[:, j], want[:, j]) for j in range(len(taps))]
        print(f"{field.name} off vs on, relative L2 per tap: {errs}")
        assert max(errs) < 1e-2, (field.name, errs)
    gdn = model.layers[0].linear_attn
    batch = kernels.prepare(cu, 3072, device)
    qkvz_TN = torch.randn(3072, cfg.linear_conv_dim + cfg.linear_value_dim, device=device).to(torch.bfloat16)
    qkv_TE, conv_EW = qkvz_TN[:, : cfg.linear_conv_dim], gdn.conv1d.weight.squeeze(1)
    sizes = [cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim]
    parts = [
        kernels.conv1d_silu(x_TC, w_CW, batch)
        for x_TC, w_CW in zip(torch.split(qkv_TE, sizes, dim=-1), torch.split(conv_EW, sizes, dim=0))
    ]
    assert torch.equal(torch.cat(parts, dim=-1), kernels.conv1d_silu(qkv_TE, conv_EW, batch))
    if kernels.conv_backend == "causal_conv1d":  # channel-last outputs of strided inputs: no copy for fla
        assert all(p.is_contiguous() for p in parts), [p.stride() for p in parts]


@pytest.mark.gpu
def test_gpu_extraction_with_the_copy_stream_writes_what_the_target_computed(tmp_path):
    """Shards copied to the host on the writer's side stream (while the next batch runs) hold the
    same hidden states as a CPU extraction of the same target (fp32, to kernel rounding)."""
    from extract.runner import run_extract
    from shards.codec import decode_hidden
    from tests.helpers.extract import all_tensors, extract_cfg, make_samples

    target = write_random_checkpoint(tmp_path / "t", seed=1, dtype=torch.float32)
    data = tmp_path / "d.jsonl"
    write_jsonl(data, make_samples())
    caches = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"cache-{device}"
        run_extract(extract_cfg(target, data, out, device=device, allow_slow_kernels=True, storage_dtype="fp8"))
        caches[device] = all_tensors(out)
    assert sorted(caches["cpu"]) == sorted(caches["cuda"]) and len(caches["cpu"]) > 2
    for b, want in caches["cpu"].items():
        got = caches["cuda"][b]
        a, e = (decode_hidden(t["hidden"], t["hidden_scale"]).float() for t in (got, want))
        assert rel_l2(a, e) < 2e-2, (b, rel_l2(a, e))  # fp8 storage: a differently rounded value may flip a step
