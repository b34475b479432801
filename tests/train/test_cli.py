"""dflash-train through click's CliRunner on tiny synthetic caches: train, checkpoint, export, eval,
and every refusal naming the thing that is wrong."""

from __future__ import annotations

import json
import math
import re

import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from shards import CacheConfig, read_cache_config, shard_path, write_cache_config
from tests.helpers.train import read_records, rewrite_shard, tiny_cache, tiny_cli_args
from train.checkpoint.export import load_exported_drafter
from train.cli import main


def invoke(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def train_by_cli(tmp_path, num_batches: int, *flags: str):
    """dflash-train train on a new tiny cache of num_batches shards into tmp_path/run, which must succeed:
    (cache, run dir, output)."""
    cache = tiny_cache(tmp_path / "cache", num_batches=num_batches)
    run = tmp_path / "run"
    res = invoke(tiny_cli_args(cache, run, *flags))
    assert res.exit_code == 0, res.output
    return cache, run, res.output


def test_train_checkpoint_export_eval_end_to_end(tmp_path):
    flags = ("--max-steps", "4", "--checkpoint-every", "2", "--eval-shards", "1", "--keep-checkpoints", "1")
    cache, run, output = train_by_cli(tmp_path, 5, *flags)
    assert "done in " in output and ": 4 steps, " in output and "acceptance length" in output
    assert sorted(p.name for p in run.glob("step-*")) == ["step-00000004"], "keep-checkpoints 1 keeps the newest"
    run_json = json.loads((run / "run.json").read_text())
    assert run_json["provenance"]["argv"] and "git_sha" in run_json["provenance"]
    assert run_json["config"]["eval_shards"] == 1
    assert [r["step"] for r in read_records(run)] == [1, 2, 3, 4]

    out = tmp_path / "exported"
    res = invoke(["export", str(run / "step-00000004"), str(out)])
    assert res.exit_code == 0, res.output
    model, cfg = load_exported_drafter(out, dtype=torch.float32)
    trained = load_file(str(run / "step-00000004" / "model.safetensors"))
    for name, t in model.state_dict().items():
        diff = (t - trained[name].to(torch.bfloat16).float()).abs().max().item()
        assert diff == 0, f"{name}: exported differs from the checkpoint by {diff}"
    assert cfg.tap_layer_ids == [1, 3, 5] and cfg.block_size == 4

    res = invoke(["export", str(run), str(tmp_path / "exported2")])  # a run dir exports its newest
    assert res.exit_code == 0, res.output

    report = tmp_path / "eval.json"
    res = invoke(
        [
            "eval",
            "--drafter",
            str(out),
            "--cache",
            str(cache),
            "--eval-shards",
            "1",
            "--num-blocks",
            "8",
            "--out",
            str(report),
        ]
    )
    assert res.exit_code == 0, res.output
    result = json.loads(report.read_text())
    assert result["batch_ids"] == [4]
    assert 1.0 <= result["acceptance_length"] <= 4.0 and 1.0 <= result["acceptance_length_pooled"] <= 4.0
    assert result["dtype"] == "bfloat16", "an export is evaluated in the training default dtype"
    assert len(result["accepted_histogram"]) == 4 and len(result["slot_acceptance"]) == 3
    assert {"16", "32", "64"} == set(result["tree_acceptance"]) and "random_anchor_chain_length" in result
    assert "agreement with the data" in res.output, "a cache without target top-k must say whose tokens it measures"


def test_one_number_per_set_of_weights(tmp_path):
    """The run's own eval, eval on its checkpoint (and on the run dir) and eval on its bf16 export agree
    exactly: all of them evaluate the weights rounded to the training compute dtype."""
    cache, run, _ = train_by_cli(
        tmp_path, 4, "--max-steps", "3", "--eval-shards", "1", "--compute-dtype", "bfloat16", "--lr", "1e-2"
    )
    in_training = json.loads((run / "eval.json").read_text())
    assert invoke(["export", str(run), str(tmp_path / "exported")]).exit_code == 0
    figures = {}
    for name, drafter in [("checkpoint", run / "step-00000003"), ("run", run), ("export", tmp_path / "exported")]:
        report = tmp_path / f"{name}.json"
        res = invoke(
            ["eval", "--drafter", str(drafter), "--cache", str(cache), "--eval-shards", "1", "--out", str(report)]
        )
        assert res.exit_code == 0, res.output
        assert "dtype bfloat16" in res.output
        figures[name] = json.loads(report.read_text())
    for name, got in figures.items():
        for key in ("acceptance_length", "acceptance_length_pooled", "heldout_loss", "random_anchor_chain_length"):
            assert got[key] == in_training[key], f"{name} {key}: {got[key]} vs in-training {in_training[key]}"
    res = invoke(
        [
            "eval",
            "--drafter",
            str(run),
            "--cache",
            str(cache),
            "--eval-shards",
            "1",
            "--dtype",
            "float32",
            "--out",
            str(tmp_path / "f32.json"),
        ]
    )
    assert "dtype float32" in res.output


def test_default_command_is_train(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    res = invoke(tiny_cli_args(cache, tmp_path / "run", "--max-steps", "1")[1:])
    assert res.exit_code == 0, res.output
    assert ": 1 step, " in res.output


def test_existing_run_needs_resume_and_resume_refuses_changed_settings(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=3)
    run = tmp_path / "run"
    assert invoke(tiny_cli_args(cache, run, "--max-steps", "2")).exit_code == 0
    res = invoke(tiny_cli_args(cache, run, "--max-steps", "2"))
    assert res.exit_code != 0 and "--resume" in res.output
    res = invoke(tiny_cli_args(cache, run, "--max-steps", "2", "--resume", "--lr", "1e-3"))
    assert res.exit_code != 0 and "lr: checkpoint 0.0006, now 0.001" in res.output


def test_bad_shard_is_refused_by_name_or_skipped_and_counted(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=3)
    bad = shard_path(cache, 1)
    data = bytearray(bad.read_bytes())
    data[-10] ^= 0xFF  # one flipped byte in the data section: only the checksum sees it
    bad.write_bytes(bytes(data))

    res = invoke(tiny_cli_args(cache, tmp_path / "run1", "--epochs", "1"))
    assert res.exit_code != 0
    assert str(bad) in res.output and "checksum" in res.output

    res = invoke(tiny_cli_args(cache, tmp_path / "run2", "--epochs", "1", "--skip-bad-shards"))
    assert res.exit_code == 0, res.output
    assert "1 shard skipped" in res.output
    lines = [json.loads(x) for x in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()]
    assert [x["batch_id"] for x in lines if x.get("event") == "skipped_shard"] == [1]
    assert read_records(tmp_path / "run2")[-1]["data/skipped_shards"] == 1
    assert len(read_records(tmp_path / "run2")) == 2, "two good shards, two steps"


def test_mismatched_taps_and_target_head_are_refused_naming_both(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    res = invoke(tiny_cli_args(cache, tmp_path / "run", "--taps", "1,2,3"))
    assert res.exit_code != 0
    assert "[1, 2, 3]" in res.output and "[1, 3, 5]" in res.output

    cfg = read_cache_config(cache)
    raw = json.loads(cfg.to_json())
    raw["target"]["vocab_size"] = 200  # cache.json now disagrees with target_head.safetensors (128 rows)
    write_cache_config(cache, CacheConfig(**raw))
    res = invoke(tiny_cli_args(cache, tmp_path / "run"))
    assert res.exit_code != 0
    assert "target_head.safetensors" in res.output and "(128, 32)" in res.output and "(200, 32)" in res.output


def test_missing_mask_token_is_a_clear_error(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    raw = json.loads(read_cache_config(cache).to_json())
    raw["mask_token_id"] = None
    write_cache_config(cache, CacheConfig(**raw))
    res = invoke(tiny_cli_args(cache, tmp_path / "run"))
    assert res.exit_code != 0 and "--mask-token-id" in res.output
    res = invoke(tiny_cli_args(cache, tmp_path / "run", "--max-steps", "1", "--mask-token-id", "127"))
    assert res.exit_code == 0, res.output


def test_non_finite_batch_stops_the_run_naming_it(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=3)

    def poison(t):
        t["hidden"][5, 1, 3] = math.nan

    rewrite_shard(cache, 2, poison)
    res = invoke(tiny_cli_args(cache, tmp_path / "run", "--epochs", "1", "--log-every", "10"))
    assert res.exit_code != 0
    assert "batch 2 holds non-finite hidden states" in res.output
    assert not list((tmp_path / "run").glob("step-*")), "no checkpoint may be saved from a poisoned run"


def test_bad_options_are_refused_before_any_model_loads(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    res = invoke(tiny_cli_args(cache, tmp_path / "run", "--warmup-ratio", "1.5"))
    assert res.exit_code == 2 and "--warmup-ratio 1.5: must be in [0, 1)" in res.output
    assert "Usage:" in res.output and "Traceback" not in res.output
    res = invoke(tiny_cli_args(cache, tmp_path / "run", "--eval-shards", "2"))
    assert res.exit_code != 0 and "--eval-shards 2 leaves no training shards" in res.output


def test_what_can_never_train_is_refused_before_any_work(tmp_path, no_work):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    run = tmp_path / "run"
    for flags, expected in (
        (["--attention", "flex"], "--attention flex on cpu: FlexAttention has no backward pass off CUDA"),
        (["--mask-token-id", "200"], "--mask-token-id 200 outside the target's vocabulary [0, 128)"),
    ):
        res = invoke(tiny_cli_args(cache, run, *flags))  # the later flag wins over tiny_cli_args' own
        assert res.exit_code == 1 and expected in res.output, res.output
        assert "Traceback" not in res.output and not run.exists()


def test_a_mistyped_command_is_named_with_suggestions(tmp_path):
    res = invoke(["exprot", str(tmp_path / "run1"), str(tmp_path / "d")])
    assert res.exit_code == 2 and "No such command 'exprot'. Did you mean 'export'" in res.output, res.output
    assert "--cache" not in res.output, "not taken for `train exprot ...`"


def test_eval_splits_held_out_shards_as_training_does_and_warns_on_trained_ones(tmp_path, caplog):
    cache = tiny_cache(tmp_path / "cache", num_batches=3, plan=True)  # planned ids 0..2, as extraction plans
    run = tmp_path / "run"
    assert invoke(tiny_cli_args(cache, run, "--max-steps", "1", "--eval-shards", "1")).exit_code == 0
    report = tmp_path / "eval.json"

    def evaluate(*choice):
        args = ["eval", "--drafter", str(run), "--cache", str(cache), "--budgets", "", "--out", str(report)]
        return CliRunner().invoke(main, [*args, *choice])

    res = evaluate("--eval-shards", "1")  # its held-out shard: no warning
    assert res.exit_code == 0 and "WARNING" not in res.output, res.output
    assert "held-out loss" in res.output
    record = json.loads(report.read_text())
    assert record["batch_ids"] == [2]
    # A slot the walk never reached is null in the JSON and a dash in the table, never "nan".
    unreached = [k for k, a in enumerate(record["slot_acceptance"], start=1) if a is None]
    assert unreached and "nan" not in res.output, res.output
    for k in unreached:
        assert re.search(rf"^slot {k} accepted \| reached +-$", res.output, re.M), res.output
    caplog.clear()
    res = evaluate("--shards", "0")  # a shard it was trained on: said loudly, once, in the table and the JSON
    assert res.exit_code == 0, res.output
    warning = "the drafter was trained on shards [0] of this cache: the figures below are NOT held-out"
    assert f"WARNING: {warning}" in res.output and (res.output + caplog.text).count(warning) == 1
    assert "held-out loss" not in res.output and "loss (trained-on shards)" in res.output
    assert json.loads(report.read_text())["trained_on_batch_ids"] == [0]
    shard_path(cache, 2).unlink()  # the held-out shard's file is gone: refused, never shard 1 instead
    res = evaluate("--eval-shards", "1")
    assert res.exit_code == 1 and "held-out shards [2] of cache" in res.output and "missing" in res.output, res.output
