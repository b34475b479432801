"""--compute fp8 on an FP8 checkpoint: the checkpoint's e4m3 weights and block scales kept as stored,
activations quantised per token per block of channels, block-scaled matmuls (extract/target/fp8/linear.py).
CPU: the fp32 block math (torch has no blockwise scaled_mm there); GPU: scaled_mm's blockwise kernel
against the float64 block math at 27B width."""

import json
import logging

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from extract.target.config import TargetConfig
from extract.target.fp8.linear import (
    FP8_LINEARS,
    Fp8Conversion,
    Fp8Input,
    block_fp8_matmul,
    blockwise_kernel_fits,
    fp8_kernel_report,
    grouped_linears,
    linear,
)
from extract.target.fp8.quantization import (
    MIN_AMAX,
    Fp8BlockFormat,
    dequantize_fp8_blocks,
    quantize_fp8_blocks,
    quantize_groups_fp8,
    quantize_rows_fp8,
)
from extract.target.kernels import KernelChoice, select_kernels
from extract.target.model import TargetModel
from extract.target.ops import zero_centred_rmsnorm
from extract.target.options import ForwardOptions
from extract.target.pointwise import Pointwise
from tests.helpers.extract import rel_l2, two_sequences_27b
from tools.fixtures.tiny_target import qwen35_27b_config_dict, random_weights, write_random_checkpoint

PREFIX = "model.language_model."  # tiny_target's default (multimodal) naming
E4M3_HALF_STEP = 2.0**-4  # e4m3 keeps 3 mantissa bits: rounding is within 2^-4 relative
SUBNORMAL_HALF_STEP = 2.0**-10  # ... and below 2^-6 within 2^-10 of the scale (steps of 2^-9)


@pytest.fixture(scope="module")
def fp8_targets(tmp_path_factory):
    """FP8 tiny checkpoints with 32x32 blocks (every tiny width is whole blocks: groups concatenate)
    and 24x24 blocks (partial edge blocks, no layer's N whole blocks: groups run layer by layer)."""
    root = tmp_path_factory.mktemp("fp8block")
    return {block: write_random_checkpoint(root / f"b{block}", seed=3, fp8_block=block) for block in (32, 24)}


def _ids():
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, 512, size=70))
    return ids, torch.cat([torch.arange(30), torch.arange(40)]), torch.tensor([0, 30, 70]), [1, 3, 6]


def _block_product_float64(x8, scale_x, w8, scale_w, bn: int, bk: int) -> torch.Tensor:
    """Independent reference: sum over K blocks of (x8 * s_x) @ (w8 * s_w).T, one (n, k) block at a time."""
    T, (N, K) = x8.shape[0], w8.shape
    x8, scale_x, w8, scale_w = (t.double().cpu() for t in (x8, scale_x, w8, scale_w))
    y = torch.zeros(T, N, dtype=torch.float64)
    for i in range(-(-N // bn)):
        rows = slice(i * bn, min((i + 1) * bn, N))
        for j in range(-(-K // bk)):
            cols = slice(j * bk, min((j + 1) * bk, K))
            y[:, rows] += (x8[:, cols] * scale_x[:, j : j + 1]) @ (w8[rows, cols] * scale_w[i, j]).t()
    return y


# ---- quantisation per group of channels -----------------------------------------------------------
def test_group_quantisation_against_float64_with_a_partial_and_an_all_zero_group():
    gen = torch.Generator().manual_seed(0)
    group, X = 32, 100  # groups of 32, 32, 32 and a partial one of 4
    x = torch.randn(9, X, generator=gen, dtype=torch.float64) * torch.logspace(-3, 3, 9, dtype=torch.float64)[:, None]
    x[2, 32:64] = 0.0  # an all-zero group
    x[5] = 0.0  # an all-zero row
    xb = x.to(torch.bfloat16)
    x8, scale = quantize_groups_fp8(xb, group)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == (9, X) and x8.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (9, 4)
    x64, back = xb.double(), x8.double()
    for r in range(9):
        for g in range(4):
            cols = slice(g * group, min((g + 1) * group, X))
            amax = x64[r, cols].abs().max().item()
            want = max(amax, MIN_AMAX) / 448.0
            assert abs(scale[r, g].item() - want) <= 1e-6 * want, (r, g)
            restored = back[r, cols] * scale[r, g].double()
            bound = torch.clamp(x64[r, cols].abs() * E4M3_HALF_STEP, min=want * SUBNORMAL_HALF_STEP) * (1 + 1e-6)
            assert ((restored - x64[r, cols]).abs() <= bound).all(), (r, g)
            if amax > 0:  # each group's largest magnitude lands on the top of the e4m3 range
                assert back[r, cols].abs().max().item() == 448.0, (r, g)
            else:
                assert (back[r, cols] == 0).all() and torch.isfinite(scale[r, g])
    # a group as wide as the row is the rowwise quantisation, bit for bit
    rows8, rows_scale = quantize_rows_fp8(xb)
    wide8, wide_scale = quantize_groups_fp8(xb, 128)
    assert torch.equal(wide8.view(torch.uint8), rows8.view(torch.uint8)) and torch.equal(wide_scale, rows_scale)
    with pytest.raises(ValueError, match="group"):
        quantize_groups_fp8(xb, 0)


def test_pointwise_feed_quantises_per_group_in_block_mode():
    pw = Pointwise(compiled=False)
    pw.fp8, pw.fp8_group = True, 24
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    w = (0.1 * torch.randn(64, generator=gen)).to(torch.bfloat16)
    fed = pw.feed("zero_centred_rmsnorm", h, w, 1e-6, keep_dense=True)
    x8, scale = quantize_groups_fp8(zero_centred_rmsnorm(h, w, 1e-6), 24)
    assert fed.scale_TG.shape == (20, 3) and torch.equal(fed.scale_TG, scale)
    assert torch.equal(fed.x8_TX.view(torch.uint8), x8.view(torch.uint8))
    pw.fp8_group = 0
    assert pw.feed("zero_centred_rmsnorm", h, w, 1e-6).scale_TG.shape == (20, 1)


# ---- the block matmul ------------------------------------------------------------------------------
@pytest.mark.parametrize("bn, bk", [(32, 32), (24, 40), (128, 128)])
def test_block_matmul_equals_a_float64_loop_over_blocks(bn, bk):
    gen = torch.Generator().manual_seed(bn + bk)
    T, N, K = 37, 80, 100  # partial blocks along N and K for every block shape
    fmt = Fp8BlockFormat(block_n=bn, block_k=bk)
    w = (torch.randn(N, K, generator=gen) / K**0.5 * torch.logspace(-1, 1, K)).to(torch.bfloat16)
    x = (torch.randn(T, K, generator=gen) * torch.logspace(1, -1, K)).to(torch.bfloat16)
    w8, scale_w = quantize_fp8_blocks(w, fmt)
    x8, scale_x = quantize_groups_fp8(x, bk)
    y = block_fp8_matmul(x8, scale_x, w8, scale_w, fmt)
    ref = _block_product_float64(x8, scale_x, w8, scale_w, bn, bk)
    assert y.dtype == torch.bfloat16 and y.shape == (T, N)
    # the bf16 rounding of the output (2^-9 relative) and fp32 accumulation only
    err = (y.double() - ref).abs()
    assert (err <= ref.abs() * 2.0**-8 + 1e-6 * ref.abs().max()).all(), err.max()


def test_kernel_choice_and_its_report():
    cuda, cpu, b128 = torch.device("cuda"), torch.device("cpu"), Fp8BlockFormat(block_n=128, block_k=128)
    assert blockwise_kernel_fits(cuda, b128, 17408, 5120)
    assert not blockwise_kernel_fits(cpu, b128, 17408, 5120)
    assert not blockwise_kernel_fits(cuda, b128, 160, 5120) and not blockwise_kernel_fits(cuda, b128, 5120, 96)
    assert not blockwise_kernel_fits(cuda, Fp8BlockFormat(block_n=64, block_k=64), 5120, 5120)
    # torch wants K / 128 a multiple of 4 for the weight scales (checked on meta tensors: 640 refused)
    assert not blockwise_kernel_fits(cuda, b128, 5120, 640) and blockwise_kernel_fits(cuda, b128, 5120, 512)
    done = Fp8Conversion(num_layers=10, num_as_stored=9, num_fp32_fallback=4, num_groups=3)
    (level, line), (warn_level, warn) = fp8_kernel_report(done, b128, cuda, compiled=True, concat=True)
    assert level == logging.INFO and "checkpoint's 128x128 block scales" in line and "9 weights as stored" in line
    assert "activations per token per 128 channels" in line and "scaled_mm blockwise" in line
    assert "fp32 accumulation" in line and "compiled" in line
    assert warn_level == logging.WARNING and "4 of 10" in warn and "slow fp32" in warn
    ((_, cpu_line),) = fp8_kernel_report(Fp8Conversion(num_layers=10), b128, cpu, compiled=False, concat=True)
    assert "fp32 dequantise-and-matmul" in cpu_line
    tiny = Fp8Conversion(num_layers=10, num_fp32_fallback=10)
    (_, tiny_line), _ = fp8_kernel_report(
        tiny, Fp8BlockFormat(block_n=32, block_k=32), cuda, compiled=True, concat=True
    )
    assert "fp32 dequantise-and-matmul" in tiny_line and "scaled_mm blockwise" not in tiny_line
    ((_, rowwise),) = fp8_kernel_report(Fp8Conversion(num_layers=10), None, cuda, compiled=True, concat=True)
    assert "rowwise scales, fast accumulation" in rowwise


# ---- loading an FP8 checkpoint under --compute fp8 ------------------------------------------------
@pytest.mark.parametrize("block", [32, 24])
def test_fp8_checkpoint_keeps_its_e4m3_weights_and_scales_bit_for_bit(fp8_targets, block, caplog):
    path = fp8_targets[block]
    stored = load_file(str(path / "model.safetensors"))
    with caplog.at_level(logging.INFO):
        model = TargetModel.from_pretrained(path, "cpu", compute="fp8")
    layers = {name: m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in FP8_LINEARS}
    assert len(layers) == 50
    for name, layer in layers.items():
        w8, scale = stored[PREFIX + name + ".weight"], stored[PREFIX + name + ".weight_scale_inv"]
        assert w8.dtype == torch.float8_e4m3fn and layer.weight is None
        assert torch.equal(layer.weight_fp8.view(torch.uint8), w8.view(torch.uint8)), name
        assert layer.weight_scale_nk.dtype == torch.float32 and torch.equal(layer.weight_scale_nk, scale), name
        assert (layer.weight_block.block_n, layer.weight_block.block_k) == (block, block)
    assert model.pw.fp8_group == block
    gdn = model.layers[0].linear_attn
    assert torch.equal(gdn.in_proj_a.weight, stored[PREFIX + "layers.0.linear_attn.in_proj_a.weight"])  # dense
    concatenated = getattr(gdn, "qkvz_weight", None) is not None
    assert concatenated == (block == 32)  # 24 divides none of the tiny Ns: the scales do not stack
    if block == 24:
        assert "groups run one matmul per layer" in caplog.text
    assert "50 linear weights kept as stored" in caplog.text and "block scales" in caplog.text


def test_a_layer_the_checkpoint_keeps_in_bf16_is_quantised_into_the_same_blocks(fp8_targets, tmp_path):
    """Each group runs one kind of matmul: up_proj stored in bf16 beside an FP8 gate_proj becomes
    block-scaled e4m3 like it, with its blocks' own scales (as the releases quantise)."""
    tensors = load_file(str(fp8_targets[32] / "model.safetensors"))
    name = PREFIX + "layers.1.mlp.up_proj.weight"
    fmt = Fp8BlockFormat(block_n=32, block_k=32)
    tensors[name] = dequantize_fp8_blocks(tensors[name], tensors.pop(name + "_scale_inv"), fmt, torch.bfloat16)
    config = json.loads((fp8_targets[32] / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append(name.removesuffix(".weight"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = TargetModel.from_pretrained(tmp_path, "cpu", compute="fp8")
    mlp = model.layers[1].mlp
    w8, scale = quantize_fp8_blocks(tensors[name], fmt)
    assert torch.equal(mlp.up_proj.weight_fp8.view(torch.uint8), w8.view(torch.uint8))
    assert torch.equal(mlp.up_proj.weight_scale_nk, scale)
    assert mlp.gate_up_weight.dtype == torch.float8_e4m3fn  # still one matmul


def test_layers_run_the_block_product_of_the_files_tensors(fp8_targets):
    """Every FP8 layer and concatenated group of the loaded model against the float64 block loop over
    the tensors as the file holds them (an independent read: safetensors, not our loader)."""
    stored = load_file(str(fp8_targets[32] / "model.safetensors"))
    model = TargetModel.from_pretrained(fp8_targets[32], "cpu", compute="fp8")
    gen = torch.Generator().manual_seed(2)
    checked = 0
    for module in (model.layers[0].linear_attn, model.layers[3].self_attn, model.layers[0].mlp):
        prefix = next(n for n, m in model.named_modules() if m is module)
        groups = [names for names in module.LINEAR_GROUPS.values() if names[0] in FP8_LINEARS]
        for names in groups + [(n,) for n in ("out_proj", "o_proj", "down_proj") if hasattr(module, n)]:
            layers = [getattr(module, n) for n in names]
            x = torch.randn(19, layers[0].in_features, generator=gen).to(torch.bfloat16)
            fed = Fp8Input(*quantize_groups_fp8(x, 32))
            if len(names) > 1:
                group = next(g for g, n in module.LINEAR_GROUPS.items() if n == names)
                outs = grouped_linears(module, group, fed, ForwardOptions())
            else:
                outs = [linear(layers[0], fed)]
            for n, y in zip(names, outs):
                key = f"{PREFIX}{prefix}.{n}.weight"
                ref = _block_product_float64(fed.x8_TX, fed.scale_TG, stored[key], stored[key + "_scale_inv"], 32, 32)
                err = (y.double() - ref).abs()
                assert (err <= ref.abs() * 2.0**-8 + 1e-6 * ref.abs().max()).all(), (n, err.max())
                checked += 1
    assert checked == 3 + 4 + 3  # q|k|v|z and out_proj, q|k|v and o_proj, gate|up and down_proj


def test_hidden_states_track_the_checkpoint_closer_than_a_rowwise_requantisation(fp8_targets):
    """Reference: the FP8 checkpoint dequantised, dense fp32. Block mode's weights are the checkpoint's
    own (error 0); a rowwise requantisation (the old --compute fp8 on FP8 checkpoints) adds ~2-3% to
    every weight, and its hidden states are much further from the reference."""
    path = fp8_targets[32]
    ids, pos, cu, taps = _ids()
    ref_model = TargetModel.from_pretrained(path, "cpu", dtype=torch.float32)
    block = TargetModel.from_pretrained(path, "cpu", compute="fp8")
    rowwise = TargetModel.from_pretrained(path, "cpu", compute="dense").use_fp8_compute()
    fmt = Fp8BlockFormat(block_n=32, block_k=32)
    down = {name: m.layers[2].mlp.down_proj for name, m in (("ref", ref_model), ("block", block), ("row", rowwise))}
    w_block = dequantize_fp8_blocks(down["block"].weight_fp8, down["block"].weight_scale_nk, fmt, torch.float32)
    w_row = down["row"].weight_fp8.float() * down["row"].weight_scale_1N.t()
    assert torch.equal(w_block, down["ref"].weight)  # exactly the checkpoint's weights
    assert rel_l2(w_row, down["ref"].weight) > 0.01
    want = ref_model.forward_packed(ids, pos, cu, taps)
    got_block, got_row = (m.forward_packed(ids, pos, cu, taps) for m in (block, rowwise))
    for j in range(len(taps)):
        e_block, e_row = rel_l2(got_block[:, j], want[:, j]), rel_l2(got_row[:, j], want[:, j])
        # measured on this tiny random target: block 3.4-8.2%, rowwise 6.0-15.9% (random weights amplify errors)
        assert e_block < 0.12 and e_block < 0.75 * e_row, (j, e_block, e_row)
    alone = block.forward_packed(ids[30:], pos[30:], torch.tensor([0, 40]), taps)
    assert torch.equal(alone, got_block[30:])  # per-token scales never mix sequences


@pytest.mark.parametrize("block", [32, 24])
def test_each_forward_cut_switched_off_gives_the_same_hidden_states_in_block_mode(fp8_targets, block):
    model = TargetModel.from_pretrained(fp8_targets[block], "cpu", compute="fp8")
    ids, pos, cu, taps = _ids()
    want = model.forward_packed(ids, pos, cu, taps)
    model.set_forward_options(ForwardOptions(fuse_residual=False, split_conv=False, concat_linears=False))
    got = model.forward_packed(ids, pos, cu, taps)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def test_block_mode_is_refused_before_loading_on_a_gpu_without_the_blockwise_kernel(fp8_targets, monkeypatch):
    """torch's 1x128 x 128x128 scaled_mm exists for sm_90 only: an L40S (sm_89) or a B200 (sm_100) would
    load the whole target and fail at the first matmul. Refused before any tensor is read."""
    import extract.target.weights

    kernels = KernelChoice(gated_delta_backend="torch", conv_backend="torch", attention_backend="sdpa")
    for capability, name in (((8, 9), "NVIDIA L40S"), ((10, 0), "NVIDIA B200")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        monkeypatch.setattr(extract.target.weights, "load_weights_into", lambda *a, **k: pytest.fail("loaded"))
        with pytest.raises(ValueError, match=rf"Hopper \(sm_90\) only; {name} is sm_{capability[0]}{capability[1]}"):
            TargetModel.from_pretrained(fp8_targets[32], "cuda", kernels=kernels, compute="fp8")


def test_the_kept_weights_are_handed_over_not_copied(fp8_targets):
    model = TargetModel.from_pretrained(fp8_targets[32], "cpu", compute="dense")
    fmt = Fp8BlockFormat(block_n=32, block_k=32)
    stored = {"layers.0.mlp.up_proj.weight": quantize_fp8_blocks(model.layers[0].mlp.up_proj.weight, fmt)}
    model.use_fp8_compute(block=fmt, stored=stored)
    assert stored == {}  # consumed: nothing else keeps the kept tensors alive while groups concatenate


def test_block_mode_refusals(fp8_targets):
    with pytest.raises(ValueError, match="bfloat16"):
        TargetModel.from_pretrained(fp8_targets[32], "cpu", dtype=torch.float32, compute="fp8")
    model = TargetModel.from_pretrained(fp8_targets[32], "cpu", compute="dense")
    w8, scale = quantize_fp8_blocks(model.layers[0].mlp.up_proj.weight, Fp8BlockFormat(block_n=32, block_k=32))
    with pytest.raises(ValueError, match="block format"):
        model.use_fp8_compute(stored={"layers.0.mlp.up_proj.weight": (w8, scale)})
    with pytest.raises(ValueError, match="not FP8_LINEARS"):
        model.use_fp8_compute(block=Fp8BlockFormat(block_n=32, block_k=32), stored={"lm_head.weight": (w8, scale)})


# ---- GPU: scaled_mm's blockwise kernel at 27B width -----------------------------------------------
@pytest.mark.gpu
def test_blockwise_scaled_mm_at_27b_width_equals_the_float64_block_math():
    """Every FP8 matmul of a 27B-width GatedDeltaNet layer, attention layer and MLP (the concatenated
    groups too), in block mode with 128x128 blocks, on scaled_mm's blockwise kernel, against the
    float64 block product of the same e4m3 operands; then the 4-layer forward vs an fp32 reference,
    block mode beside rowwise. Eager pointwise ops: no compile time."""
    device = torch.device("cuda")
    cfg = TargetConfig.from_hf_dict(qwen35_27b_config_dict(num_hidden_layers=4, vocab_size=4096))
    state = random_weights(cfg, seed=0, device=device, with_head=False, dtype=torch.float32)
    slow = select_kernels(
        device, allow_slow_kernels=True, gated_delta="torch", conv="torch", attention="sdpa", compile_pointwise=False
    )
    ref = TargetModel.from_state_dict(cfg, state, slow, dtype=torch.float32)
    ids, pos, cu, taps = two_sequences_27b(device, first_len=1024)
    want = ref.forward_packed(ids, pos, cu, taps).float()
    del ref
    fast = select_kernels(device, compile_pointwise=False)
    fmt = Fp8BlockFormat(block_n=128, block_k=128)
    got = {}
    for mode in ("rowwise", "block"):
        model = TargetModel.from_state_dict(cfg, state, fast, dtype=torch.bfloat16)
        model.use_fp8_compute(block=fmt if mode == "block" else None)
        got[mode] = model.forward_packed(ids, pos, cu, taps).float()
        if mode == "block":
            _check_every_matmul_at_27b_width(model, device)
        del model
    for j in range(len(taps)):
        e_row, e_block = rel_l2(got["rowwise"][:, j], want[:, j]), rel_l2(got["block"][:, j], want[:, j])
        print(f"tap {j}: fp8 rowwise {e_row:.2e}, fp8 block {e_block:.2e} (relative L2 vs fp32)")
        assert torch.isfinite(got["block"]).all() and e_block < 0.08


def _check_every_matmul_at_27b_width(model: TargetModel, device) -> None:
    gen = torch.Generator(device).manual_seed(0)
    for module in (model.layers[0].linear_attn, model.layers[3].self_attn, model.layers[0].mlp):
        runs = [(g, names) for g, names in module.LINEAR_GROUPS.items() if names[0] in FP8_LINEARS]
        runs += [(None, (n,)) for n in ("out_proj", "o_proj", "down_proj") if hasattr(module, n)]
        for group, names in runs:
            layers = [getattr(module, n) for n in names]
            N, K = sum(layer.out_features for layer in layers), layers[0].in_features
            assert blockwise_kernel_fits(device, layers[0].weight_block, N, K), names
            for T in (1021, 2048):  # a token count that is no multiple of 16, and one that is
                x = torch.randn(T, K, generator=gen, device=device).to(torch.bfloat16)
                fed = Fp8Input(*quantize_groups_fp8(x, 128))
                outs = grouped_linears(module, group, fed, ForwardOptions()) if group else [linear(layers[0], fed)]
                for layer, y in zip(layers, outs):
                    x64 = fed.x8_TX.double() * fed.scale_TG.double().repeat_interleave(128, 1)
                    w64 = layer.weight_fp8.double() * layer.weight_scale_nk.double().repeat_interleave(
                        128, 0
                    ).repeat_interleave(128, 1)
                    exact = x64 @ w64.t()
                    err = rel_l2(y, exact)
                    print(f"{names} N={layer.out_features} K={K} T={T}: relative L2 vs float64 {err:.2e}")
                    # bf16 output rounding (~1.1e-3 relative L2) plus fp32 accumulation; measured 1.66e-3
                    assert err < 4e-3, (names, T, err)
