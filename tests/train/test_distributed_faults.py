"""Fault injection, several ranks: two CPU gloo ranks under torchrun (as test_distributed.py starts
them) agree on pre-emption, and shards that do not divide among the ranks are announced, never dropped
in silence.

Cases (a tiny synthetic cache of 5 shards, 2 ranks, 2 epochs: 2 steps per epoch, 4 in all):
  1. SIGTERM delivered to rank 1 only, in its step 2 (a deterministic point: a wrapped StepRunner.run
     sends it): both ranks stop after step 3 (the flags are all-reduced, read one step later), rank 0
     writes one checkpoint and one "stopped" event, each rank exits 143 by itself with no traceback
     (not killed by torchrun's SIGTERM to the others once the first exits); --resume then reproduces
     the uninterrupted two-rank run's losses exactly.
  2. 5 shards on 2 ranks: 1 shard is left out of each epoch, said in the log (count and why) and in
     run.json; each epoch trains 4 shards, a different one left out in each epoch.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from shards import ShardReader, epoch_shard_order
from tests.helpers.process import REPO, child_env, rank_stderr, torchrun_command
from tests.helpers.train import read_records, tiny_cache, tiny_cli_args
from train.checkpoint.store import latest_checkpoint, list_checkpoints

NUM_SHARDS, EPOCHS, WORLD = 5, 2, 2
STEPS = EPOCHS * (NUM_SHARDS // WORLD)
SETTINGS = ["--epochs", str(EPOCHS), "--metrics-every", "2", "--keep-checkpoints", "5"]

# Each rank runs the dflash-train CLI; the rank named on the command line SIGTERMs itself while its
# k-th step runs (before the step's work: the same point on every run), the other rank never does.
# Rank 0 also takes 2 s longer to write its "stopped" record (20 of torchrun's 0.1 s monitor intervals):
# code that let rank 1 exit first had rank 0 killed there by torchrun every time.
SIGTERM_ONE_RANK = textwrap.dedent("""
    import os, signal, sys, time
    from train.metrics.logger import MetricsLogger
    from train.step import StepRunner
    k, rank = int(sys.argv[1]), int(sys.argv[2])
    real, calls = StepRunner.run, [0]
    real_event = MetricsLogger.write_event

    def run(self, **kw):
        calls[0] += 1
        if calls[0] == k and int(os.environ["RANK"]) == rank:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, **kw)

    def slow_stop_record(self, record):
        if record.get("event") == "stopped":
            time.sleep(2.0)
        return real_event(self, record)

    StepRunner.run = run
    MetricsLogger.write_event = slow_stop_record
    from train.cli import main
    main(sys.argv[3:])
""")


def torchrun(module: str, *args: str, log_dir: Path | None = None, path: Path | None = None):
    env = child_env(PYTHONPATH=f"{REPO}{os.pathsep}{path}") if path is not None else child_env()
    cmd = torchrun_command(module, *args, nproc=WORLD, log_dir=log_dir)
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


def losses(run) -> dict[int, float]:
    return {r["step"]: r["loss/total"] for r in read_records(run)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    cache = tiny_cache(root / "cache", num_batches=NUM_SHARDS)
    run = root / "run"
    proc = torchrun("train.cli", *tiny_cli_args(cache, run, *SETTINGS))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cache, run, proc


# ---- 1. SIGTERM on one rank -------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_both_at_one_step_and_resume_is_exact(uninterrupted, tmp_path):
    rank, k = 1, 2  # the rank that does not write checkpoints: rank 0 must learn of it through the flag
    cache, full, _ = uninterrupted
    run = tmp_path / "run"
    (tmp_path / "sigterm_one_rank.py").write_text(SIGTERM_ONE_RANK)
    args = tiny_cli_args(cache, run, *SETTINGS)
    proc = torchrun("sigterm_one_rank", str(k), str(rank), *args, log_dir=tmp_path / "logs", path=tmp_path)
    logs = rank_stderr(tmp_path / "logs")
    shown = proc.stderr[-3000:] + "".join(f"\n--- rank {r} ---\n{t[-3000:]}" for r, t in sorted(logs.items()))
    assert proc.returncode != 0, "a pre-empted job must not report success\n" + shown
    assert sorted(logs) == list(range(WORLD)), shown
    # The flags are all-reduced every step and read one step later: both ranks stop after step k + 1,
    # and each exits 143 by itself (not killed by torchrun's SIGTERM to the survivors of the first exit).
    stop_step = k + 1
    assert f"stopped by SIGTERM after step {stop_step}: checkpoint" in logs[0], shown
    assert f"rank 1: stopped by SIGTERM after step {stop_step}" in logs[1], shown
    assert not any("Traceback" in t for t in logs.values()), shown
    assert proc.stderr.count("exitcode  : 143") == WORLD and "(SIGTERM)" not in proc.stderr, shown
    assert [c.step for c in list_checkpoints(run)] == [stop_step], "one checkpoint, of the step both ranks agreed on"
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "stopped"] == [stop_step]
    assert sorted(losses(run)) == list(range(1, stop_step + 1)), "no step was trained past the agreed one"

    proc = torchrun("train.cli", *tiny_cli_args(cache, run, *SETTINGS, "--resume"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got, reference = losses(run), losses(full)
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1))
    worst = max(abs(got[s] - reference[s]) for s in reference)
    assert worst <= 1e-6, f"max abs loss diff {worst}"
    assert latest_checkpoint(run).step == STEPS


# ---- 2. shards that do not divide among the ranks ---------------------------------------------------------


@pytest.mark.slow
def test_shards_left_out_by_the_rank_split_are_announced(uninterrupted):
    cache, run, proc = uninterrupted
    left_out = NUM_SHARDS % WORLD
    assert (
        f"{left_out} of the {NUM_SHARDS} training shards are left out of each epoch (a different set each epoch"
        in proc.stderr
    ), proc.stderr[-3000:]
    assert "each of the 2 ranks must run the same number of steps" in proc.stderr
    assert json.loads((run / "run.json").read_text())["shards_left_out_per_epoch"] == left_out
    assert sorted(losses(run)) == list(range(1, STEPS + 1)), "each epoch trains NUM_SHARDS // WORLD steps"
    train_ids = ShardReader(cache).batch_ids()
    trained = [
        sorted(b for r in range(WORLD) for b in epoch_shard_order(train_ids, e, 0, r, WORLD)) for e in range(EPOCHS)
    ]
    dropped = [sorted(set(train_ids) - set(t)) for t in trained]
    assert [len(d) for d in dropped] == [left_out] * EPOCHS and dropped[0] != dropped[1], dropped
