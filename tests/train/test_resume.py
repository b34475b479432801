"""Resume continues exactly: the losses after a resume equal the uninterrupted run's, whether the
run stopped cleanly at a checkpoint or was SIGKILLed mid-run."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.helpers.process import child_env, sigkill_when
from tests.helpers.train import read_records, tiny_cache, tiny_cli_args, tiny_config
from train.checkpoint.store import latest_checkpoint, list_checkpoints
from train.cli import main as train_cli
from train.loop import run_training


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (before a kill and again after the resume) keeps the later value."""
    return {r["step"]: r["loss/total"] for r in read_records(run_dir)}


def assert_same_losses(got: dict[int, float], want: dict[int, float], steps) -> None:
    diffs = {s: abs(got[s] - want[s]) for s in steps}
    worst = max(diffs.values())
    assert worst <= 1e-6, f"max abs loss diff {worst} (per step: {diffs})"


def test_resume_from_checkpoints_matches_uninterrupted_run(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=4)
    settings = dict(epochs=3, checkpoint_every=3, keep_checkpoints=10, metrics_every=2, kl_lambda=0.0)
    full = tmp_path / "full"
    run_training(tiny_config(cache, full, **settings))
    reference = losses(full)
    assert sorted(reference) == list(range(1, 13))
    assert [c.step for c in list_checkpoints(full)] == [3, 6, 9, 12]

    for start in (3, 6):  # step 3: mid-epoch (cursor 3 of 4); step 6: second epoch
        resumed = tmp_path / f"from{start}"
        resumed.mkdir()
        shutil.copytree(full / f"step-{start:08d}", resumed / f"step-{start:08d}")
        summary = run_training(tiny_config(cache, resumed, resume=True, **settings))
        assert summary.steps == 12
        got = losses(resumed)
        assert sorted(got) == list(range(start + 1, 13))
        assert_same_losses(got, reference, range(start + 1, 13))


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_matches_uninterrupted_run(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=4)
    extra = ["--epochs", "40", "--checkpoint-every", "8", "--keep-checkpoints", "2", "--metrics-every", "3"]
    full = tmp_path / "full"
    run_training(tiny_config(cache, full, epochs=40, checkpoint_every=8, keep_checkpoints=2, metrics_every=3))
    reference = losses(full)
    total = len(reference)
    assert total == 160

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.cli", *tiny_cli_args(cache, killed, *extra)],
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    sigkill_when(proc, lambda: (ckpt := latest_checkpoint(killed)) is not None and ckpt.step >= 16, timeout_s=60)
    assert proc.returncode == -signal.SIGKILL
    before = losses(killed)
    last_logged = max(before)
    assert last_logged < total, "the run finished before it could be killed; the test proves nothing"
    ckpt = latest_checkpoint(killed)
    assert ckpt is not None and ckpt.step <= last_logged

    run_training(
        tiny_config(cache, killed, resume=True, epochs=40, checkpoint_every=8, keep_checkpoints=2, metrics_every=3)
    )
    after = losses(killed)
    assert sorted(after) == list(range(1, total + 1))
    assert_same_losses(after, reference, range(1, total + 1))


def test_a_checkpoint_from_before_a_setting_existed_resumes_as_its_default(tmp_path):
    """A setting (or drafter field) added after the checkpoint was written is absent from its record: it
    trained as the default does, so the resume goes on; run now with another value, it is refused."""
    cache, run = tiny_cache(tmp_path / "cache", num_batches=3), tmp_path / "run"
    args = tiny_cli_args(cache, run, "--max-steps", "2", "--checkpoint-every", "1")
    assert CliRunner().invoke(train_cli, args).exit_code == 0
    state_path = run / "step-00000001" / "train_state.json"
    state = json.loads(state_path.read_text())
    for key in ("fp8", "fp8_recipe", "selector_gold", "kl_lambda"):
        del state["resolved_identity"][key]
    del state["drafter"]["input_embedding_scale"], state["state_checksum"]
    state_path.write_text(json.dumps(state))

    shutil.rmtree(run / "step-00000002")
    result = CliRunner().invoke(train_cli, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    assert (run / "step-00000002").is_dir()

    shutil.rmtree(run / "step-00000002")
    result = CliRunner().invoke(train_cli, [*args, "--resume", "--kl-lambda", "0.5"])
    assert result.exit_code == 1 and "--kl-lambda" in result.output, result.output


def test_a_dflash1_run_resumes_whatever_its_selector_settings(tmp_path):
    """The DFlash 2 selector's settings change nothing in a DFlash 1 drafter: a resume ignores them (a DFlash 1
    checkpoint from before a selector default changed goes on), while a DFlash 2 run is still held to them."""
    cache, run = tiny_cache(tmp_path / "cache", num_batches=3), tmp_path / "run"
    args = tiny_cli_args(cache, run, "--max-steps", "2", "--checkpoint-every", "1")
    assert CliRunner().invoke(train_cli, [*args, "--selector-gold", "drop", "--selector-weight", "0.5"]).exit_code == 0
    shutil.rmtree(run / "step-00000002")
    result = CliRunner().invoke(train_cli, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    assert (run / "step-00000002").is_dir()


def test_a_checkpoint_trained_on_other_shards_is_refused(tmp_path):
    """The data cursor indexes the run's training shards. A checkpoint whose split differs under the same
    flags (a run from before the split moved to a long sample's boundary) must not resume over other shards."""
    cache, run = tiny_cache(tmp_path / "cache", num_batches=4), tmp_path / "run"
    args = tiny_cli_args(cache, run, "--max-steps", "2", "--checkpoint-every", "1", "--eval-shards", "1")
    assert CliRunner().invoke(train_cli, args).exit_code == 0
    shutil.rmtree(run / "step-00000002")
    state_path = run / "step-00000001" / "train_state.json"
    state = json.loads(state_path.read_text())
    assert state["train_ids"] == [0, 1, 2]
    state["train_ids"] = [0, 1]  # as if the split had held out the last two shards
    del state["state_checksum"]
    state_path.write_text(json.dumps(state))
    result = CliRunner().invoke(train_cli, [*args, "--resume"])
    assert result.exit_code == 1, result.output
    assert "--eval-shards: checkpoint trained on 2 shards, now 3 (first difference at shard id 2" in result.output
