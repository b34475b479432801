"""Fault injection, training side: the run directory is ours alone, pre-emption loses nothing, resume
checks the cache it continues on, and metrics.jsonl keeps one record per step.

Cases (tiny synthetic caches, the dflash-train CLI):
  1. --out that is the cache, inside the cache, a folder with a user file (.tmp-notes too), or with
     user files named as ours (eval.json, metrics.jsonl, run.json: no run.json of ours): refused, untouched.
  2. A second run on a locked run directory: refused naming host and pid. An --out that cannot be written
     (under a file, in /sys, on a read-only file system; see tests/helpers/faults.py): refused before any
     work with one message naming the directory and the fix, nothing written anywhere.
  3. SIGTERM (or SIGINT, Ctrl-C) delivered in step k (a deterministic point): checkpoint of step k,
     exit code 143 (130), a "stopped" event; --resume then reproduces the uninterrupted run's losses
     exactly, and its summary tells this invocation's figures from the whole run's.
  4. --resume on a finished run says it is complete (and trains nothing).
  5. A resumed run marks the resume in metrics.jsonl and leaves exactly one record per step.
  6. --resume onto a cache with another shard count (same target): refused naming the field. Resume
     compares settings as resolved: an unset --num-blocks and its value given explicitly are the same
     run; a changed flag, or a cache.json whose MASK id changed under an unset flag, is named by flag.
     --resume onto a cache of another target: refused naming the target config hash.
  7. --device cuda without CUDA, for dflash-train and dflash-extract: one message, exit 1, no traceback.
  8. Retention after a resume past a damaged newest checkpoint: the one just written and the one
     resumed from are kept, the damaged later one is not counted; --resume where every checkpoint is
     damaged is refused naming them, and nothing is changed.
"""

import dataclasses
import json
import os
import shutil
import signal

import pytest
import torch
from click.testing import CliRunner

from extract.cli import main as extract_cli
from shards import read_cache_config, write_cache_config
from shards.common.lock import DirectoryLock
from tests.helpers.extract import snapshot
from tests.helpers.faults import HOWS, expect_refusal, unwritable
from tests.helpers.train import read_records, tiny_cache, tiny_cli_args, tiny_config
from train.checkpoint.store import latest_checkpoint, list_checkpoints
from train.cli import main as train_cli
from train.loop import run_training
from train.step import StepRunner


def train(cache, run, *extra):
    return CliRunner().invoke(train_cli, tiny_cli_args(cache, run, *extra))


def no_traceback(result):
    return result.exception is None or isinstance(result.exception, SystemExit)


# ---- 1-2. the run directory -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where",
    [
        "the cache",
        "inside the cache",
        "a folder with a user file",
        "a user file named as a temporary",
        "user files of our names",
    ],
)
def test_a_run_directory_that_is_not_ours_is_refused(tmp_path, where):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    out = {
        "the cache": cache,
        "inside the cache": cache / "shards" / "run",
        "a folder with a user file": tmp_path / "mine",
        "a user file named as a temporary": tmp_path / "mine",
        "user files of our names": tmp_path / "mine",
    }[where]
    if where == "a folder with a user file":
        out.mkdir()
        (out / "notes.md").write_text("mine")
    if where == "a user file named as a temporary":
        out.mkdir()
        (out / ".tmp-notes.markdown").write_text("mine")
    if where == "user files of our names":  # names alone do not make them ours: no run.json of ours
        out.mkdir()
        (out / "eval.json").write_text('{"mine": 1}\n')
        (out / "metrics.jsonl").write_text('{"a": 1}\n')
        (out / "run.json").write_text("x\n")
    before = snapshot(tmp_path)
    result = train(cache, out, "--max-steps", "1", "--eval-shards", "1")
    assert result.exit_code == 1 and no_traceback(result), result.output
    expected = {
        "a folder with a user file": ["notes.md"],
        "a user file named as a temporary": [".tmp-notes.markdown"],
        "user files of our names": ["eval.json", "metrics.jsonl", "run.json", "no run.json of a dflash-train run"],
    }.get(where, ["one lies inside the other"])
    assert all(e in result.output for e in expected), result.output
    assert snapshot(tmp_path) == before, "nothing may be written or deleted"


def test_a_probe_of_another_rank_and_a_resume_only_record_are_ours(tmp_path):
    """check_writable's probe (another rank's, a moment ahead) is no user file; a run first started with
    --resume wrote run-resume-00000000.json and no run.json, and stays its run directory."""
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    run = tmp_path / "run"
    run.mkdir()
    (run / ".tmp-probe.abcd1234").write_bytes(b"")
    assert train(cache, run, "--max-steps", "1", "--eval-shards", "1").exit_code == 0
    record = (run / "run.json").read_text()
    (run / "run.json").unlink()
    (run / "run-resume-00000000.json").write_text(record)
    for step in run.glob("step-*"):  # died before its first checkpoint
        shutil.rmtree(step)
    result = train(cache, run, "--max-steps", "1", "--eval-shards", "1", "--resume")
    assert result.exit_code == 0, result.output


def test_a_second_run_on_a_locked_run_directory_is_refused(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    run = tmp_path / "run"
    run.mkdir()
    with DirectoryLock(run, "dflash-train"):
        result = train(cache, run, "--max-steps", "1")
    assert result.exit_code == 1 and f"pid {os.getpid()}" in result.output, result.output
    assert "in use by another dflash-train" in result.output
    assert train(cache, run, "--max-steps", "1").exit_code == 0, "released with its holder"


@pytest.mark.parametrize("how", HOWS)
def test_train_out_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch, no_work, how):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    out, where = unwritable(how, tmp_path, monkeypatch)
    before = snapshot(tmp_path)
    result = CliRunner().invoke(train_cli, tiny_cli_args(cache, out, "--max-steps", "1"))
    expect_refusal(result, "--out", out, where, how)
    assert snapshot(tmp_path) == before, "nothing is written anywhere"


# ---- 3. SIGTERM -------------------------------------------------------------------------------------------

SETTINGS = dict(epochs=2, checkpoint_every=3, keep_checkpoints=5, metrics_every=2)
CLI_SETTINGS = ["--epochs", "2", "--checkpoint-every", "3", "--keep-checkpoints", "5", "--metrics-every", "2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    cache = tiny_cache(root / "cache", num_batches=4)
    run_training(tiny_config(cache, root / "run", **SETTINGS))
    return cache, root / "run", {r["step"]: r["loss/total"] for r in read_records(root / "run")}


@pytest.mark.parametrize("k,signum,exit_code", [(2, signal.SIGTERM, 143), (5, signal.SIGINT, 130)])
def test_sigterm_or_sigint_checkpoints_the_step_and_resume_is_exact(
    uninterrupted, tmp_path, monkeypatch, k, signum, exit_code
):
    cache, _, reference = uninterrupted
    run = tmp_path / "run"
    real = StepRunner.run
    calls = [0]
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)

    def terminated(self, **kw):
        calls[0] += 1
        if calls[0] == k:  # the scheduler's notice (or the user's Ctrl-C) arrives while step k runs
            os.kill(os.getpid(), signum)
        return real(self, **kw)

    monkeypatch.setattr(StepRunner, "run", terminated)
    result = train(cache, run, *CLI_SETTINGS)
    name = signal.Signals(signum).name
    assert result.exit_code == exit_code and no_traceback(result), result.output
    assert f"stopped by {name} after step {k}" in result.output and "--resume" in result.output, result.output
    assert latest_checkpoint(run).step == k, "the step in flight is finished and checkpointed: nothing lost"
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(e["step"], e["reason"]) for e in events if e.get("event") == "stopped"] == [(k, name)]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers, "handlers restored"

    monkeypatch.undo()
    result = train(cache, run, *CLI_SETTINGS, "--resume")
    assert result.exit_code == 0, result.output
    tokens = {r["step"]: r["data/tokens_seen"] for r in read_records(run)}
    this_run, whole = f"{tokens[8] - tokens[k]:,} tokens", f"{tokens[8]:,} tokens"
    expected = f"this invocation (resumed at step {k}): {8 - k} steps, {this_run} ("
    assert expected in result.output and f"the whole run: 8 steps, {whole}" in result.output, result.output
    got = {r["step"]: r["loss/total"] for r in read_records(run)}
    assert sorted(got) == sorted(reference)
    worst = max(abs(got[s] - reference[s]) for s in reference)
    assert worst <= 1e-6, f"max abs loss diff {worst}"


# ---- 4-5. resume bookkeeping ------------------------------------------------------------------------------


def test_resume_on_a_finished_run_says_it_is_complete(uninterrupted, tmp_path):
    cache, full, _ = uninterrupted
    run = tmp_path / "run"
    shutil.copytree(full, run)
    before = (run / "metrics.jsonl").read_text()
    result = train(cache, run, *CLI_SETTINGS, "--resume")
    assert result.exit_code == 0, result.output
    assert "is already complete: step 8 of 8" in result.output and "nan" not in result.output, result.output
    assert (run / "metrics.jsonl").read_text() == before, "nothing trained, nothing logged"


def test_a_resumed_run_marks_the_resume_and_logs_each_step_once(uninterrupted, tmp_path):
    cache, full, reference = uninterrupted
    run = tmp_path / "run"
    shutil.copytree(full, run)
    for ckpt in list_checkpoints(run):
        if ckpt.step > 3:
            shutil.rmtree(ckpt.path)  # as if killed after step 8 was logged but before its checkpoints
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "loss/tot')  # and a line cut by the kill
    result = train(cache, run, *CLI_SETTINGS, "--resume")
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if "event" not in r]
    assert steps == sorted(reference), f"one record per step, in order: {steps}"
    resumes = [r for r in lines if r.get("event") == "resume"]
    assert [r["step"] for r in resumes] == [3] and resumes[0]["checkpoint"].endswith("step-00000003")
    at = {r["step"]: i for i, r in enumerate(lines) if "event" not in r}  # line of each step record
    assert at[3] < lines.index(resumes[0]) < at[4], "the marker sits between steps 3 and 4"


# ---- 6. resume identity -----------------------------------------------------------------------------------


def test_resume_onto_a_cache_with_other_shards_is_refused(tmp_path):
    run = tmp_path / "run"
    first = tiny_cache(tmp_path / "a", num_batches=2, seed=0)
    assert train(first, run, "--max-steps", "2").exit_code == 0
    other = tiny_cache(tmp_path / "b", num_batches=3, seed=0)  # same target and head, one more shard
    result = train(other, run, "--max-steps", "4", "--resume")
    assert result.exit_code == 1, result.output
    assert "cache num_shards: checkpoint 2, now 3" in result.output, result.output


def test_resume_compares_the_settings_as_resolved_naming_the_flag(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    run = tmp_path / "run"
    args = tiny_cli_args(cache, run, "--max-steps", "2", "--checkpoint-every", "1")
    at = args.index("--num-blocks")
    default_density = args[:at] + args[at + 2 :]  # --num-blocks unset: derived from the token budget
    assert CliRunner().invoke(train_cli, default_density).exit_code == 0
    num_blocks = json.loads((run / "run.json").read_text())["num_blocks"]

    def resume(*extra):
        shutil.rmtree(run / "step-00000002")  # the run stopped after step 1
        return CliRunner().invoke(train_cli, [*default_density, "--resume", *extra])

    result = resume("--num-blocks", str(num_blocks))  # the value it resolved to, now given explicitly
    assert result.exit_code == 0, result.output
    result = resume("--lr", "0.001")
    assert result.exit_code == 1 and "--lr: checkpoint 0.0006, now 0.001" in result.output, result.output
    config = read_cache_config(cache)
    write_cache_config(cache, dataclasses.replace(config, mask_token_id=config.mask_token_id - 1))
    result = CliRunner().invoke(train_cli, [*default_density, "--resume"])
    assert result.exit_code == 1 and no_traceback(result), result.output
    expected = f"--mask-token-id: checkpoint {config.mask_token_id}, now {config.mask_token_id - 1}"
    assert expected in result.output, result.output


def test_training_resume_on_a_cache_of_another_target_is_refused(tmp_path):
    run = tmp_path / "run"
    first = tiny_cache(tmp_path / "a", num_batches=2, seed=0)
    result = CliRunner().invoke(train_cli, tiny_cli_args(first, run, "--max-steps", "2"))
    assert result.exit_code == 0, result.output
    other = tiny_cache(tmp_path / "b", num_batches=2, seed=1)  # config_hash synthetic-1
    result = CliRunner().invoke(train_cli, tiny_cli_args(other, run, "--max-steps", "4", "--resume"))
    assert result.exit_code != 0
    assert "cache target config_hash: checkpoint 'synthetic-0', now 'synthetic-1'" in result.output, result.output


# ---- 7. no raw tracebacks for a missing GPU ---------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_message(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    args = tiny_cli_args(cache, tmp_path / "run")
    args[args.index("--device") + 1] = "cuda"
    result = CliRunner().invoke(train_cli, args)
    assert result.exit_code == 1 and no_traceback(result), result.output
    assert "--device cuda: CUDA is not available" in result.output, result.output

    from tests.helpers.extract import cli_args, dataset_file, tiny_target_dir  # noqa: F401

    class Factory:
        def mktemp(self, name):
            p = tmp_path / name
            p.mkdir()
            return p

    target, data = tiny_target_dir(Factory()), dataset_file(Factory())
    result = CliRunner().invoke(extract_cli, cli_args(target, data, tmp_path / "c", "--device", "cuda"))
    assert result.exit_code == 1 and no_traceback(result), result.output
    assert "--device cuda: CUDA is not available" in result.output, result.output
    assert not (tmp_path / "c").exists()


# ---- 8. damaged checkpoints and retention -----------------------------------------------------------------


def test_pruning_after_a_resume_past_a_damaged_checkpoint_keeps_the_good_ones(uninterrupted, tmp_path):
    cache, full, reference = uninterrupted
    run = tmp_path / "run"
    shutil.copytree(full, run)  # checkpoints of steps 3, 6 and 8
    os.truncate(run / "step-00000008" / "model.safetensors", 1000)
    result = train(
        cache,
        run,
        "--epochs",
        "2",
        "--metrics-every",
        "2",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "1",
        "--resume",
    )
    assert result.exit_code == 0 and no_traceback(result), result.output
    # Step 7 was written beside the damaged step 8 (not counted, left), then step 8 was written again.
    assert [c.step for c in list_checkpoints(run)] == [6, 8], "kept: the one resumed from and the newest"
    assert latest_checkpoint(run).step == 8, "the rewritten step 8 verifies"
    got = {r["step"]: r["loss/total"] for r in read_records(run)}
    assert max(abs(got[s] - reference[s]) for s in reference) <= 1e-6


def test_resume_where_every_checkpoint_is_damaged_is_refused(uninterrupted, tmp_path):
    cache, full, _ = uninterrupted
    run = tmp_path / "run"
    shutil.copytree(full, run)
    for ckpt in list_checkpoints(run):
        os.truncate(ckpt.path / "model.safetensors", 1000)
    before = snapshot(run)
    result = train(cache, run, *CLI_SETTINGS, "--resume")
    assert result.exit_code == 1 and no_traceback(result), result.output
    assert "none is valid" in result.output and "step-00000003" in result.output, result.output
    assert snapshot(run) == before, "no silent restart from step 0: nothing written, truncated or deleted"
    result = train(cache, run, *CLI_SETTINGS)
    assert result.exit_code == 1 and "already holds checkpoints" in result.output, result.output
