"""Readers lock the cache too: a training or an eval reading a cache holds a shared lock on it for as
long as it reads, so the jobs that rewrite an existing cache (dflash-extract --overwrite, dflash-shards
index and verify --quarantine) are refused, naming the reader, and a training is refused while an
extraction still writes the cache, naming that job.

Cases (the CLIs; "running" jobs are real CLI runs paused at a hook, or locks held in this process,
which conflict with the CLIs' own as flock is per open file):
  1. A training (then an eval) in progress: every writer refused naming it, nothing changed; verify
     without --quarantine reads on; once the reader is done the writers proceed, no record is left.
  2. A training (and an eval) on a cache whose extraction holds the lock: refused naming that job
     before any work, no run directory made.
  3. Readers together: a training runs while another reader holds the cache.
  4. A reader killed with SIGKILL in mid-run: the lock is free again, and its record, left behind, is
     never named in a refusal (the flock decides, not the record); the next writer deletes it.
"""

import os
import signal
import subprocess
import sys

from click.testing import CliRunner

from extract.cli import main as extract_cli
from shards.common.lock import DirectoryLock
from shards.common.owned import READER_RECORD
from shards.format import MANIFEST_FILE
from tests.helpers.extract import cli_args, snapshot
from tests.helpers.process import REPO, child_env, sigkill_when
from tests.helpers.train import tiny_cache, tiny_cli_args
from tools.cli.dflash_shards import main as shards_cli
from train.cli import main as train_cli
from train.eval import run as eval_run
from train.step import StepRunner


def _writers(target, data, cache):
    """The commands that rewrite an existing cache, as (name, CliRunner result) of running each now."""
    runs = {
        "extract --overwrite": (extract_cli, cli_args(target, data, cache, "--overwrite")),
        "index": (shards_cli, ["index", str(cache)]),
        "verify --quarantine": (shards_cli, ["verify", str(cache), "--quarantine"]),
    }
    return {name: CliRunner().invoke(cli, args) for name, (cli, args) in runs.items()}


def _cache_files(cache):
    """snapshot() but for the readers' records (a reader's own, with its pid and start time)."""
    return {name: raw for name, raw in snapshot(cache).items() if not READER_RECORD.fullmatch(name)}


def _readers_records(cache):
    return sorted(p.name for p in cache.iterdir() if READER_RECORD.fullmatch(p.name))


def test_a_reading_training_and_eval_refuse_the_writers_naming_them(target, data, tmp_path, monkeypatch):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    (cache / MANIFEST_FILE).unlink()  # index would write it, --quarantine would move a bad shard
    before = _cache_files(cache)
    seen = {}

    def writers_now(name):
        seen[name] = _writers(target, data, cache)
        seen[name + " verify"] = CliRunner().invoke(shards_cli, ["verify", str(cache)])
        assert _cache_files(cache) == before

    real_step = StepRunner.run

    def step_then_writers(self, **kw):
        if "train" not in seen:
            writers_now("train")
        return real_step(self, **kw)

    monkeypatch.setattr(StepRunner, "run", step_then_writers)
    run = tmp_path / "run"
    result = CliRunner().invoke(train_cli, tiny_cli_args(cache, run, "--max-steps", "1"))
    assert result.exit_code == 0, result.output
    real_walk = eval_run.evaluate_drafter

    def writers_then_walk(*args, **kw):
        writers_now("eval")
        return real_walk(*args, **kw)

    monkeypatch.setattr(eval_run, "evaluate_drafter", writers_then_walk)
    result = CliRunner().invoke(
        train_cli, ["eval", "--drafter", str(run), "--cache", str(cache), "--eval-shards", "1", "--budgets", ""]
    )
    assert result.exit_code == 0, result.output

    for reader in ("train", "eval"):
        for name, res in seen[reader].items():
            assert res.exit_code == 1, (reader, name, res.output)
            named = f"{cache} is being read by dflash-train {reader} (host "
            assert named in res.output and f"pid {os.getpid()}, running since " in res.output, (
                reader,
                name,
                res.output,
            )
            assert "Traceback" not in res.output
        verify = seen[reader + " verify"]
        assert "being written" not in verify.output and "checked 2 shards" in verify.output, verify.output
    assert _readers_records(cache) == [], "each reader takes its record away"
    monkeypatch.undo()
    assert CliRunner().invoke(shards_cli, ["index", str(cache)]).exit_code == 0, "the readers are done"
    assert (cache / MANIFEST_FILE).exists()


def test_training_on_a_cache_being_extracted_is_refused_naming_the_job(tmp_path, no_work):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    run = tmp_path / "run"
    with DirectoryLock(cache, "dflash-extract"):  # the extraction still running
        trained = CliRunner().invoke(train_cli, tiny_cli_args(cache, run, "--max-steps", "1"))
        evaluated = CliRunner().invoke(
            train_cli, ["eval", "--drafter", str(tmp_path), "--cache", str(cache), "--eval-shards", "1"]
        )
    for result in (trained, evaluated):
        assert result.exit_code == 1, result.output
        assert f"{cache} is being written by dflash-extract (host " in result.output, result.output
        assert f"pid {os.getpid()}" in result.output and "wait for it to finish" in result.output, result.output
    assert not run.exists(), "refused before the run directory was made"
    assert _readers_records(cache) == []


def test_two_readers_go_together(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    with DirectoryLock(cache, "dflash-train eval", shared=True):  # another job reading the cache
        result = CliRunner().invoke(train_cli, tiny_cli_args(cache, tmp_path / "run", "--max-steps", "1"))
        assert result.exit_code == 0, result.output
        assert len(_readers_records(cache)) == 1, "the training took its own record away, the eval's stays"
    assert _readers_records(cache) == []


def test_a_killed_reader_frees_the_cache_and_is_never_named(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    run = tmp_path / "run"
    args = tiny_cli_args(cache, run, "--epochs", "100000")  # runs until killed
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.cli", *args], cwd=REPO, env=child_env(), stderr=subprocess.PIPE
    )
    sigkill_when(proc, lambda: (run / "metrics.jsonl").exists())  # mid-run, the cache locked
    assert proc.returncode == -signal.SIGKILL
    assert len(_readers_records(cache)) == 1, "a killed reader cannot take its record away"

    with DirectoryLock(cache, "dflash-train eval", shared=True):  # a live reader beside the dead one's record
        res = CliRunner().invoke(shards_cli, ["index", str(cache)])
    assert res.exit_code == 1 and f"pid {os.getpid()}" in res.output, res.output
    assert f"pid {proc.pid}" not in res.output and "dflash-train train" not in res.output, res.output

    res = CliRunner().invoke(shards_cli, ["index", str(cache)])
    assert res.exit_code == 0, res.output
    assert _readers_records(cache) == [], "the next writer deletes the stale record"
