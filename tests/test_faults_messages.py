"""Fault injection, messages: a user error is one line naming the file and the fix, never a traceback;
a shard from another cache or outside the plan is refused by name.

Cases (the tiny target, dataset and reference cache of test_faults.py; dflash-extract CLI):
  1. A damaged target checkpoint: config.json not JSON, a tensor missing, a tensor of the wrong shape,
     a truncated model.safetensors: exit 1, the file named, no cache written.
  2. A shard copied in from a cache of another dataset (same shapes): verify and the resumed extraction
     name it and leave it in place; a shard outside the plan of cache.json is named by verify.
"""

import shutil

import pytest
from click.testing import CliRunner
from extract_helpers import cli_args, copy_cache, extract_cfg, make_samples
from safetensors.torch import load_file, save_file

from extract.cli import main as extract_cli
from extract.data import write_jsonl
from extract.runner import CacheMismatchError, run_extract
from shards import shard_path
from shards.inspect import verify_cache


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


def _missing(ckpt):
    name = _edit_tensor(ckpt, lambda t, n: t.pop(n))
    return name, "is not in the checkpoint"


def _shape(ckpt):
    name = _edit_tensor(ckpt, lambda t, n: t.__setitem__(n, t[n][:-1].clone()))
    return name, "expected"


def _truncated(ckpt):
    path = _weights(ckpt)
    path.write_bytes(path.read_bytes()[:1000])
    return str(path), "not a readable safetensors file"


@pytest.mark.parametrize("damage", [_bad_json, _missing, _shape, _truncated], ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_target_is_one_message_naming_the_file(target, data, tmp_path, damage):
    ckpt = tmp_path / "target"
    shutil.copytree(target, ckpt)
    named, reason = damage(ckpt)
    out = tmp_path / "cache"
    result = CliRunner().invoke(extract_cli, cli_args(ckpt, data, out))
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), f"raw traceback: {result.exception!r}"
    assert named in result.output and reason in result.output, result.output
    if damage in (_bad_json, _truncated):  # found before the cache is created; the others at model load
        assert not (out / "cache.json").exists()


def test_a_shard_of_another_dataset_is_refused_on_resume_and_by_verify(target, data, reference, tmp_path):
    cache = copy_cache(reference, tmp_path)
    samples = make_samples()
    samples[0], samples[1] = samples[1], samples[0]  # same samples, other order: another dataset fingerprint
    other_data = tmp_path / "other.jsonl"
    write_jsonl(other_data, samples)
    other = tmp_path / "other"
    run_extract(extract_cfg(target, other_data, other))
    shutil.copy(shard_path(other, 3), shard_path(cache, 3))
    foreign = shard_path(cache, 3).read_bytes()
    bad = verify_cache(cache).bad
    assert [b["file"] for b in bad if b["batch_id"] == 3] == [str(shard_path(cache, 3))], bad
    assert "belongs to another cache" in next(b["reason"] for b in bad if b["batch_id"] == 3)
    with pytest.raises(CacheMismatchError, match="b00000003.safetensors: belongs to another cache"):
        run_extract(extract_cfg(target, data, cache))
    assert shard_path(cache, 3).read_bytes() == foreign, "a shard that is not this cache's is left for the user"


def test_a_shard_outside_the_plan_is_named_by_verify(reference, tmp_path):
    cache = copy_cache(reference, tmp_path)
    n = reference["num_batches"]
    shutil.copy(shard_path(cache, 0), shard_path(cache, n + 4))
    bad = verify_cache(cache).bad
    reasons = [b["reason"] for b in bad if b["batch_id"] == n + 4]
    assert reasons and f"outside the plan of {n} batches" in reasons[0], bad
