"""Fine-grained FP8 checkpoints: loaded by dequantising while streaming; other quantizations refused."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from extract.cli import main as extract_cli
from extract.dataset.index import Sample, write_jsonl
from extract.target.fp8.quantization import UnsupportedQuantizationError, read_quantization
from extract.target.model import TargetModel
from extract.target.weights import load_target_head
from shards import read_cache_config
from tests.helpers.extract import cli_args
from tools.cli.dflash_shards import main as shards_cli
from tools.fixtures.tiny_target import write_random_checkpoint

BLOCK = 24  # does not divide the tiny widths (64, 160, ...): partial edge blocks are exercised


@pytest.fixture(scope="module")
def fp8_target(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("fp8") / "tiny", seed=3, fp8_block=BLOCK)


def _dequantise_float64(tensors: dict) -> dict:
    """Independent reference: every (i, j) block of an e4m3 weight times its scale, in float64 loops."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype != torch.float8_e4m3fn:
            out[name] = t.double()
            continue
        s = tensors[name + "_scale_inv"].double()
        w = t.double()
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] *= s[i, j]
        out[name] = w
    return out


def _local(name: str) -> str:
    return name.removeprefix("model.language_model.")


def test_format_is_the_official_one(fp8_target):
    config = json.loads((fp8_target / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [BLOCK, BLOCK] and q["fmt"] == "e4m3"
    tensors = load_file(str(fp8_target / "model.safetensors"))
    w = tensors["model.language_model.layers.0.mlp.gate_proj.weight"]
    s = tensors["model.language_model.layers.0.mlp.gate_proj.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == (-(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK))
    # each block's largest magnitude sits at the top of the e4m3 range
    assert float(w.float()[:BLOCK, :BLOCK].abs().max()) == 448.0
    for kept in ("layers.0.linear_attn.in_proj_a.weight", "embed_tokens.weight", "layers.0.input_layernorm.weight"):
        assert tensors["model.language_model." + kept].dtype == torch.bfloat16
    assert "model.language_model.layers.0.linear_attn.in_proj_a" in q["modules_to_not_convert"]


def test_loads_to_the_float64_dequantisation(fp8_target):
    model = TargetModel.from_pretrained(fp8_target, "cpu", dtype=torch.float32, with_head=True)
    ref = _dequantise_float64(load_file(str(fp8_target / "model.safetensors")))
    params = dict(model.named_parameters())
    fp8_names = [
        n for n, t in load_file(str(fp8_target / "model.safetensors")).items() if t.dtype == torch.float8_e4m3fn
    ]
    assert len(fp8_names) > 40
    for name in fp8_names:
        # one rounding of the exact product to fp32: equal to the float64 result rounded to fp32
        assert torch.equal(params[_local(name)], ref[name].float()), name
    assert torch.equal(
        params["layers.0.linear_attn.in_proj_a.weight"],
        ref["model.language_model.layers.0.linear_attn.in_proj_a.weight"].float(),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hidden_states_equal_a_dense_checkpoint_of_the_dequantised_weights(fp8_target, tmp_path, dtype):
    dense_dir = tmp_path / "dense"
    dense_dir.mkdir()
    config = json.loads((fp8_target / "config.json").read_text())
    del config["quantization_config"]
    (dense_dir / "config.json").write_text(json.dumps(config))
    ref = _dequantise_float64(load_file(str(fp8_target / "model.safetensors")))
    save_file(
        {n: t.to(torch.float32 if n.endswith("A_log") else dtype).contiguous() for n, t in ref.items()},
        str(dense_dir / "model.safetensors"),
    )
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, 512, size=70))
    pos = torch.cat([torch.arange(30), torch.arange(40)])
    cu = torch.tensor([0, 30, 70])
    fp8_model = TargetModel.from_pretrained(fp8_target, "cpu", dtype=dtype)
    dense_model = TargetModel.from_pretrained(dense_dir, "cpu", dtype=dtype)
    a = fp8_model.forward_packed(ids, pos, cu, [1, 3, 6])
    b = dense_model.forward_packed(ids, pos, cu, [1, 3, 6])
    if dtype == torch.float32:
        assert torch.equal(a, b)
    else:  # fp32 product then bf16 vs float64 then bf16: a double-rounding tie flips a rare ulp
        assert (a.float() - b.float()).norm() / b.float().norm() < 2e-3
    assert torch.isfinite(a).all() and 0.1 < a.float().pow(2).mean().sqrt() < 100


def test_target_head_of_an_fp8_checkpoint(fp8_target):
    head = load_target_head(fp8_target)
    assert head["embed_tokens"].dtype == torch.bfloat16 and head["lm_head"].shape == head["embed_tokens"].shape


@pytest.mark.parametrize(
    "quant, words",
    [
        ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
        ({"quant_method": "awq", "bits": 4}, "'awq'"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "'bitsandbytes'"),
        ({"quant_method": "compressed-tensors"}, "'compressed-tensors'"),
        ({"quant_method": "fp8", "weight_block_size": None}, "per-tensor"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "'static'"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "'e5m2'"),
    ],
)
def test_other_quantizations_are_refused_by_name(quant, words, tmp_path):
    with pytest.raises(UnsupportedQuantizationError, match=words):
        read_quantization({"quantization_config": quant})
    target = write_random_checkpoint(tmp_path / "t", seed=0)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quant
    (target / "config.json").write_text(json.dumps(config))
    data = tmp_path / "d.jsonl"
    write_jsonl(data, [Sample("a", np.arange(1, 20), np.ones(19, np.uint8))])
    out = tmp_path / "cache"
    result = CliRunner().invoke(
        extract_cli,
        ["--target", str(target), "--data", str(data), "--out", str(out), "--token-budget", "64", "--dtype", "float32"],
    )
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert words in result.output and "bf16" in result.output  # the method, and what to do
    assert not (out / "cache.json").exists()
    with pytest.raises(UnsupportedQuantizationError):
        TargetModel.from_pretrained(target, "cpu", dtype=torch.float32)


def test_quantization_config_inside_text_config_is_read():
    fmt = read_quantization(
        {"text_config": {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}}}
    )
    assert (fmt.block_n, fmt.block_k) == (128, 64)
    assert read_quantization({"text_config": {}}) is None


@pytest.mark.parametrize(
    "config, words",
    [
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [True, True]}}, "[true, true]"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [32.0, 32.0]}}, "positive integers"),
        (
            {
                "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
                "text_config": {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            },
            "disagree ('fp8' vs 'gptq')",
        ),
    ],
    ids=["bool sizes", "float sizes", "two configs"],
)
def test_damaged_or_contradictory_quantization_configs_are_named(config, words):
    with pytest.raises(UnsupportedQuantizationError) as e:
        read_quantization(config)
    assert words in str(e.value)


def test_broken_fp8_checkpoints_name_the_tensor(fp8_target, tmp_path):
    tensors = load_file(str(fp8_target / "model.safetensors"))
    name = "model.language_model.layers.1.mlp.down_proj.weight"
    cases = ("no scale", "scale shape", "no config", "e5m2 weight", "int scale", "negative scale", "nan scale")
    cases += ("nan weight", "fp8 config, bf16 weights", "zero scale", "huge scale")
    matches = {
        "no config": "no quantization_config",
        "e5m2 weight": "down_proj.weight is stored as F8_E5M2",
        "int scale": "down_proj.weight_scale_inv is stored as I32",
        "negative scale": "negative or non-finite block scale",
        "nan scale": "negative or non-finite block scale",
        "nan weight": "down_proj.weight holds NaN e4m3 codes",
        "fp8 config, bf16 weights": "no weight is stored as float8_e4m3fn",
        "zero scale": r"down_proj.weight_scale_inv holds 1 zero block scale\(s\) over non-zero e4m3 codes",
        "huge scale": r"down_proj.weight_scale_inv dequantises weights to \|w\| = .* above 1e\+04",
    }
    for case in cases:
        bad = tmp_path / case.replace(" ", "_")
        bad.mkdir()
        config = json.loads((fp8_target / "config.json").read_text())
        broken = dict(tensors)
        if case == "no scale":
            del broken[name + "_scale_inv"]
        elif case == "scale shape":
            broken[name + "_scale_inv"] = broken[name + "_scale_inv"][:, :1].contiguous()
        elif case == "no config":
            del config["quantization_config"]
        elif case == "e5m2 weight":  # same bytes read as the other FP8 format: silently wrong values before
            broken[name] = broken[name].view(torch.float8_e5m2)
        elif case == "int scale":
            broken[name + "_scale_inv"] = broken[name + "_scale_inv"].to(torch.int32)
        elif case == "negative scale":
            broken[name + "_scale_inv"] = -broken[name + "_scale_inv"]
        elif case == "nan scale":
            broken[name + "_scale_inv"] = broken[name + "_scale_inv"].clone()
            broken[name + "_scale_inv"][0, 0] = float("nan")
        elif case in ("zero scale", "huge scale"):  # finite and >= 0, and still no quantiser's
            broken[name + "_scale_inv"] = broken[name + "_scale_inv"].clone()
            broken[name + "_scale_inv"][0, 0] = 0.0 if case == "zero scale" else 1e30
        elif case == "nan weight":
            codes = broken[name].view(torch.uint8).clone()
            codes[0, 0] = 0x7F
            broken[name] = codes.view(torch.float8_e4m3fn)
        elif case == "fp8 config, bf16 weights":  # the bf16 release with an FP8 release's config.json
            broken = {k: (v.float() if v.dtype == torch.float8_e4m3fn else v) for k, v in broken.items()}
            broken = {k: v for k, v in broken.items() if not k.endswith("_scale_inv")}
        (bad / "config.json").write_text(json.dumps(config))
        save_file(broken, str(bad / "model.safetensors"))
        with pytest.raises(ValueError, match=matches.get(case, "down_proj.weight_scale_inv")):
            TargetModel.from_pretrained(bad, "cpu", dtype=torch.float32)


def test_extract_from_fp8_checkpoint_records_it(fp8_target, tmp_path):
    data = tmp_path / "d.jsonl"
    write_jsonl(data, [Sample(f"s{i}", np.arange(1, 30 + i), np.ones(29 + i, np.uint8)) for i in range(4)])
    out = tmp_path / "cache"
    result = CliRunner().invoke(extract_cli, cli_args(fp8_target, data, out, token_budget=128, max_seqs=4))
    assert result.exit_code == 0, result.output
    target = read_cache_config(out).target
    assert target.quantization == f"fp8 e4m3, {BLOCK}x{BLOCK} blocks (dequantised at load)"
    assert target.compute == "dense"
    info = CliRunner().invoke(shards_cli, ["info", str(out)])
    assert info.exit_code == 0, info.output
    assert f"dense compute; checkpoint fp8 e4m3, {BLOCK}x{BLOCK} blocks (dequantised at load)" in info.output
