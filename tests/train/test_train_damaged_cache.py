"""Training on a damaged extracted cache (the tiny target's reference cache of tests/conftest.py, through the
dflash-train CLI): a truncated shard, a shard of another format version, a deleted shard are refused naming
the shard file, or skipped with --skip-bad-shards and counted (summary line, metrics event,
data/skipped_shards); a damaged target head is refused naming target_head.safetensors."""

import json

import pytest
from click.testing import CliRunner

from shards import shard_path
from tests.helpers.extract import VOCAB, copy_cache, corrupt_shard
from tests.helpers.faults import flip_byte
from tests.helpers.train import read_records, tiny_cli_args
from train.checkpoint.store import latest_checkpoint
from train.cli import main as train_cli

BAD_SHARD = 2


def _damage_shard(cache, how):
    path = shard_path(cache, BAD_SHARD)
    if how == "missing":
        path.unlink()
        return path, "missing"
    corrupt_shard(path, how)
    return path, {"truncate": "truncated", "version": "format version"}[how]


def train_args(cache, run, *extra):
    return tiny_cli_args(cache, run, "--epochs", "1", "--mask-token-id", str(VOCAB - 1), *extra)


@pytest.mark.parametrize("how", ["truncate", "version", "missing"])
def test_training_refuses_a_bad_shard_naming_it(reference, tmp_path, how):
    cache = copy_cache(reference, tmp_path)
    path, reason = _damage_shard(cache, how)
    result = CliRunner().invoke(train_cli, train_args(cache, tmp_path / "run"))
    assert result.exit_code != 0, f"training on a cache with a {how} shard must stop:\n{result.output}"
    assert str(path) in result.output and reason in result.output, result.output
    assert latest_checkpoint(tmp_path / "run") is None
    if how == "missing":  # seen from the file listing before any set-up: no run directory is made
        assert "1 of its" in result.output and "planned shards are missing" in result.output, result.output
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("how", ["truncate", "version", "missing"])
def test_training_skips_a_bad_shard_and_counts_it(reference, tmp_path, how):
    cache = copy_cache(reference, tmp_path)
    _damage_shard(cache, how)
    run = tmp_path / "run"
    result = CliRunner().invoke(train_cli, train_args(cache, run, "--skip-bad-shards"))
    assert result.exit_code == 0, result.output
    assert "1 shard skipped" in result.output, result.output
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["batch_id"] for e in events if e.get("event") == "skipped_shard"] == [BAD_SHARD]
    records = read_records(run)
    assert records[-1]["data/skipped_shards"] == 1
    assert len(records) == reference["num_batches"] - 1, "one step per good shard"


def test_training_refuses_a_damaged_target_head_naming_it(reference, tmp_path):
    cache = copy_cache(reference, tmp_path)
    flip_byte(cache / "target_head.safetensors")
    result = CliRunner().invoke(train_cli, train_args(cache, tmp_path / "run"))
    assert result.exit_code != 0
    assert str(cache / "target_head.safetensors") in result.output and "checksum" in result.output, result.output
