"""Fault injection, the target checkpoint dflash-extract reads (extract/target/checkpoint.py): a damaged
target is one line naming the file and the fix, never a traceback, refused before any work.

Cases (the tiny target and dataset of tests/conftest.py; dflash-extract CLI):
  1. A damaged target checkpoint: config.json not JSON, nested 200,000 deep or with a size of another
     type, a weight index mapping a name to a number, a tensor missing, a tensor of the wrong shape,
     a truncated model.safetensors: exit 1, the file named, refused before the dataset scan and before
     cache.json. More than 20 bad tensors (layer 3's q_proj of another shape, layers 4 and 5 missing):
     every one counted, the first 20 named with file, expected and found shape. Tensors config.json does
     not describe (a layer past num_hidden_layers, a bias the model lacks, integer weights). A sharded
     checkpoint (index and two files) with one unreadable header and one tensor the index names but its
     file lacks.
A shard copied in from a cache of another dataset: tests/extract/test_extract_faults.py; a shard outside
the plan of cache.json: tests/shards/test_format.py.
"""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from extract.cli import main as extract_cli
from extract.target.checkpoint import MAX_REPORTED_TENSORS
from tests.helpers.extract import cli_args


def _weights(ckpt):
    return next(ckpt.glob("*.safetensors"))


def _edit_tensor(ckpt, edit):
    path = _weights(ckpt)
    tensors = load_file(str(path))
    name = next(n for n in tensors if "layers.1.mlp.up_proj" in n)
    edit(tensors, name)
    save_file(tensors, str(path))
    return name


def _bad_json(ckpt):
    (ckpt / "config.json").write_text('{"model_type": ')
    return str(ckpt / "config.json"), "not valid JSON"


def _deep_json(ckpt):  # a RecursionError traceback before
    (ckpt / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    return str(ckpt / "config.json"), "JSON nested more than"


def _mistyped_field(ckpt):  # a TypeError traceback before ("int() argument must be ...")
    config = json.loads((ckpt / "config.json").read_text())
    text = config.get("text_config", config)
    text["hidden_size"] = [text["hidden_size"]]
    (ckpt / "config.json").write_text(json.dumps(config))
    field = "text_config.hidden_size" if "text_config" in config else "hidden_size"
    return str(ckpt / "config.json"), f"field {field} must be an integer, found an array"


def _mistyped_index(ckpt):  # an AttributeError traceback before
    _shard(ckpt)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 1}}))
    return str(ckpt / "model.safetensors.index.json"), "field weight_map.a must be a string, found an integer"


def _missing(ckpt):
    name = _edit_tensor(ckpt, lambda t, n: t.pop(n))
    return name, "is not in the checkpoint (expected shape ("


def _shape(ckpt):
    name = _edit_tensor(ckpt, lambda t, n: t.__setitem__(n, t[n][:-1].clone()))
    return name, "expected ("


def _truncated(ckpt):
    path = _weights(ckpt)
    path.write_bytes(path.read_bytes()[:1000])
    return str(path), "not a readable safetensors file"


def refused(ckpt, data, out):
    result = CliRunner().invoke(extract_cli, cli_args(ckpt, data, out))
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), f"raw traceback: {result.exception!r}"
    assert not out.exists(), "refused before cache.json or any shard is written"
    return result.output


@pytest.mark.parametrize(
    "damage",
    [_bad_json, _deep_json, _mistyped_field, _mistyped_index, _missing, _shape, _truncated],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_damaged_target_is_one_message_naming_the_file(target, data, tmp_path, no_work, damage):
    ckpt = tmp_path / "target"
    shutil.copytree(target, ckpt)
    named, reason = damage(ckpt)
    shown = refused(ckpt, data, tmp_path / "cache")
    assert named in shown and reason in shown, shown


def _shard(ckpt) -> dict[str, str]:
    """Split the checkpoint into two files with an index, as large releases ship (names -> file)."""
    tensors = load_file(str(_weights(ckpt)))
    _weights(ckpt).unlink()
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in files.items():
        save_file({n: tensors[n] for n in part}, str(ckpt / file))
    weight_map = {n: file for file, part in files.items() for n in part}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_every_bad_target_tensor_is_named_with_file_and_shapes(target, data, tmp_path, no_work):
    ckpt = tmp_path / "target"
    shutil.copytree(target, ckpt)
    path = _weights(ckpt)
    tensors = load_file(str(path))
    # Layer 3's (full attention) q_proj narrower, and every tensor of layers 4 and 5 (more than 20) gone.
    missing = sorted(n for n in tensors if ".layers.4." in n or ".layers.5." in n)
    reshaped = next(n for n in tensors if n.endswith("layers.3.self_attn.q_proj.weight"))
    assert len(missing) + 1 > MAX_REPORTED_TENSORS
    for name in missing:
        del tensors[name]
    want = tuple(tensors[reshaped].shape)
    tensors[reshaped] = tensors[reshaped][:, :-2].clone()
    save_file(tensors, str(path))
    shown = refused(ckpt, data, tmp_path / "cache")
    num_bad = len(missing) + 1
    assert f"{ckpt}: {num_bad} bad or missing tensor(s)" in shown and f"(the first {MAX_REPORTED_TENSORS})" in shown
    assert f"... and {num_bad - MAX_REPORTED_TENSORS} more" in shown, shown
    assert f"{ckpt}: {missing[0]} is not in the checkpoint (expected shape (" in shown, shown
    found = (want[0], want[1] - 2)
    assert f"{path}: {reshaped} has shape {found}, expected {want} from config.json" in shown, shown


def test_tensors_config_json_does_not_describe_are_refused(target, data, tmp_path, no_work):
    ckpt = tmp_path / "target"
    shutil.copytree(target, ckpt)
    path = _weights(ckpt)
    tensors = load_file(str(path))
    prefix = next(n for n in tensors if n.endswith("layers.2.mlp.down_proj.weight")).split("layers.")[0]
    layers = json.loads((ckpt / "config.json").read_text()).get("text_config", {}).get("num_hidden_layers")
    tensors[f"{prefix}layers.{layers}.mlp.down_proj.weight"] = tensors[f"{prefix}layers.2.mlp.down_proj.weight"].clone()
    tensors[f"{prefix}layers.2.mlp.down_proj.bias"] = torch.zeros(
        tensors[f"{prefix}layers.2.mlp.down_proj.weight"].shape[0]
    )
    gate = f"{prefix}layers.1.mlp.gate_proj.weight"
    tensors[gate] = tensors[gate].to(torch.int32)
    save_file(tensors, str(path))
    shown = refused(ckpt, data, tmp_path / "cache")
    assert f"1 tensor(s) of layers past config.json's num_hidden_layers {layers}" in shown, shown
    assert f"1 tensor(s) the Qwen3.5 model has no parameter for ({prefix}layers.2.mlp.down_proj.bias)" in shown, shown
    assert f"{gate} is stored as I32; weights are floats" in shown, shown
    assert "3 bad or missing tensor(s)" in shown, shown


def test_a_sharded_target_with_a_bad_header_or_tensor_is_refused_naming_them(target, data, tmp_path, no_work):
    ckpt = tmp_path / "target"
    shutil.copytree(target, ckpt)
    weight_map = _shard(ckpt)
    first, second = ckpt / "model-00001-of-00002.safetensors", ckpt / "model-00002-of-00002.safetensors"
    first.write_bytes(b"\xff" * 8 + first.read_bytes()[8:])  # a header length past the file: unreadable
    dropped = next(n for n, f in sorted(weight_map.items()) if f == second.name and "layers.2." in n)
    tensors = load_file(str(second))
    del tensors[dropped]  # the index still names the file for it
    save_file(tensors, str(second))
    shown = refused(ckpt, data, tmp_path / "cache")
    assert f"{first}: not a readable safetensors file" in shown, shown
    assert shown.count(str(first)) == 1, "an unreadable file is named once, not once per tensor it holds"
    assert f"{second}: tensor {dropped!r} is missing" in shown, shown
    assert "2 bad or missing tensor(s)" in shown, shown
