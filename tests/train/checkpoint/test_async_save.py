"""Asynchronous checkpoints (train/checkpoint/async_save.py): the loop snapshots, a thread writes, nothing changes.

  1. HostSnapshot: the copy is independent of later in-place updates, its buffers are reused across
     captures, a tensor shared by two entries stays one tensor.
  2. A run whose background writes are held until the loop waits for them (so training runs on while
     each write is pending) writes checkpoints byte for byte equal to a synchronous run's; writes
     never overlap; every save logs its stall, and the wait for the pending write is measured.
  3. SIGKILL while a write is blocked mid-file (in a subprocess, at a deterministic point): the
     previous checkpoint is the newest valid one, the next start removes the temporary folder and
     the resumed run reproduces the uninterrupted losses.
  4. A full disk at a checkpoint (model.safetensors or optimizer.pt failing as each library does, async and
     sync): one line naming the checkpoint, the space it needs and what is free; the previous checkpoint
     intact; once space is back, --resume reproduces the uninterrupted losses. Too little space for the
     next checkpoint: said at start, and its save refused before any byte is written.
Resume from asynchronous checkpoints is also what tests/train/test_resume.py and the SIGTERM cases of
tests/train/test_train_faults.py run, asynchronous being the default.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests.helpers.faults import fill_disk, one_error_line
from tests.helpers.process import child_env, sigkill_when
from tests.helpers.train import read_records, tiny_cache, tiny_cli_args, tiny_config
from train.checkpoint import async_save as checkpoint_async
from train.checkpoint.async_save import CheckpointWriter, HostSnapshot
from train.checkpoint.store import MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, latest_checkpoint, load_model_state
from train.cli import main as train_cli
from train.loop import run_training
from train.step import StepRunner

REPO = Path(__file__).resolve().parents[3]
SETTINGS = dict(epochs=3, checkpoint_every=3, keep_checkpoints=10)  # 4 shards: 12 steps, saves at 3, 6, 9, 12


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss/total"] for r in read_records(run_dir)}


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == kind]


# ---- 1. the snapshot ----------------------------------------------------------------------------------------


def test_snapshot_is_a_copy_in_reused_buffers():
    lr = torch.tensor(0.5)
    state = {"w": torch.arange(6.0).view(2, 3), "groups": [{"lr": lr, "params": [0, 1]}], "also_lr": lr}
    snap = HostSnapshot(pin=False)
    first = snap.capture(state)
    state["w"].add_(100)  # the next optimizer step updates in place
    assert torch.equal(first["w"], torch.arange(6.0).view(2, 3)), "the snapshot must not follow the live tensor"
    assert first["groups"][0]["lr"] is first["also_lr"], "one tensor at two places stays one tensor"
    assert first["groups"][0]["params"] == [0, 1] and first["groups"] is not state["groups"]
    ptr = first["w"].data_ptr()
    second = snap.capture(state)
    assert second["w"].data_ptr() == ptr, "buffers are allocated once and reused"
    assert torch.equal(second["w"], state["w"]) and snap.nbytes == 6 * 4 + 4


# ---- 2. asynchronous == synchronous ---------------------------------------------------------------------------


class HeldWrites:
    """Each background write waits until the loop asks for it (CheckpointWriter.wait: the next save or the
    end of training), so the loop demonstrably trains on with a write pending. `log` records, in order,
    ("step", n) when step n starts, ("write", s) / ("durable", s) around the write of step s."""

    def __init__(self, monkeypatch):
        self.log: list[tuple[str, int]] = []
        self.gates: dict[int, threading.Event] = {}
        self.steps = 0
        self._lock = threading.Lock()
        real_save, real_run, real_wait = checkpoint_async.save_checkpoint, StepRunner.run, CheckpointWriter.wait

        def save(out_dir, step, *args, **kwargs):
            assert self._gate(step).wait(timeout=120), f"the write of step {step} was never asked for"
            self._note("write", step)
            path = real_save(out_dir, step, *args, **kwargs)
            self._note("durable", step)
            return path

        def run(runner, **kwargs):
            self.steps += 1
            self._note("step", self.steps)
            return real_run(runner, **kwargs)

        def wait(writer):
            if writer.pending_step is not None:
                self._gate(writer.pending_step).set()
            return real_wait(writer)

        monkeypatch.setattr(checkpoint_async, "save_checkpoint", save)
        monkeypatch.setattr(StepRunner, "run", run)
        monkeypatch.setattr(CheckpointWriter, "wait", wait)

    def _gate(self, step: int) -> threading.Event:
        with self._lock:
            return self.gates.setdefault(step, threading.Event())

    def _note(self, what: str, n: int) -> None:
        with self._lock:
            self.log.append((what, n))


def test_async_checkpoints_equal_sync_ones_byte_for_byte_and_never_overlap(tmp_path, monkeypatch):
    cache = tiny_cache(tmp_path / "cache", num_batches=4)
    run_training(tiny_config(cache, tmp_path / "sync", checkpoint_write="sync", **SETTINGS))
    held = HeldWrites(monkeypatch)
    run_training(tiny_config(cache, tmp_path / "async", checkpoint_write="async", **SETTINGS))
    monkeypatch.undo()

    saves = [3, 6, 9, 12]
    writes = [entry for entry in held.log if entry[0] != "step"]
    assert writes == [(what, s) for s in saves for what in ("write", "durable")], f"overlapping writes: {held.log}"
    for s in saves[:-1]:  # training went on: step s+1 started before the write of step s did
        assert held.log.index(("step", s + 1)) < held.log.index(("write", s)), held.log

    for s in saves:
        sync_dir, async_dir = tmp_path / "sync" / f"step-{s:08d}", tmp_path / "async" / f"step-{s:08d}"
        for name in (MODEL_FILE, OPTIMIZER_FILE):
            assert (async_dir / name).read_bytes() == (sync_dir / name).read_bytes(), f"{async_dir / name} differs"
        sync_state, async_state = (json.loads((d / STATE_FILE).read_text()) for d in (sync_dir, async_dir))
        for state in (sync_state, async_state):  # time and argv, and the state's checksum, which covers them
            state.pop("provenance"), state.pop("state_checksum")
        assert async_state == sync_state
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")

    stalls = events(tmp_path / "async", "checkpoint")
    assert [e["step"] for e in stalls] == saves
    for e in stalls:
        assert e["checkpoint/mode"] == "async"
        assert e["checkpoint/stall_s"] >= e["checkpoint/wait_s"] + e["checkpoint/snapshot_s"] - 1e-9
    # From the second save on, the previous write was still held: the save waited for it, measurably.
    assert all(e["checkpoint/wait_s"] > 0 for e in stalls[1:]), stalls
    durable = events(tmp_path / "async", "checkpoint_durable")
    assert [e["step"] for e in durable] == saves and all(e["checkpoint/bytes"] > 0 for e in durable)
    assert [e["step"] for e in events(tmp_path / "sync", "checkpoint")] == saves


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_each_checkpoint_says_one_line_once_it_is_durable(tmp_path, caplog, mode):
    """A save is one console line, printed when the checkpoint is durable, with its size and the loop's
    stall: never a "saved" line before the "durable" one."""
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    caplog.set_level(logging.INFO)
    res = CliRunner().invoke(
        train_cli,
        tiny_cli_args(
            cache,
            tmp_path / "run",
            "--epochs",
            "4",
            "--checkpoint-every",
            "2",
            "--keep-checkpoints",
            "9",
            "--checkpoint-write",
            mode,
        ),
    )
    assert res.exit_code == 0, res.output
    for step in (2, 4):
        lines = [r.getMessage() for r in caplog.records if f"step-{step:08d}" in r.getMessage()]
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"checkpoint step {step} durable: {tmp_path / 'run' / f'step-{step:08d}'} (")
        assert "training blocked" in lines[0] and ("background" in lines[0]) == (mode == "async"), lines[0]


# ---- 3. killed mid-write ----------------------------------------------------------------------------------------

# The child trains as the parent's uninterrupted run does, but its second checkpoint write (step 6) stops
# inside optimizer.pt: partial bytes on disk, a marker file, then it blocks for good. The loop trains on
# to step 9, whose save waits for that write forever; the parent kills it there.
_CHILD = """
import os, sys, threading
from pathlib import Path
sys.path.insert(0, {repo!r})
import torch
from tests.helpers.train import tiny_config
from train.loop import run_training

cache, out, marker = sys.argv[1:4]
real_save = torch.save
def blocking_save(obj, f, *args, **kwargs):
    if "step-00000006" in os.path.realpath(f):  # f reaches the folder through its descriptor (/proc/self/fd/N)
        with open(f, "wb") as partial:
            partial.write(b"PK partial")
        Path(marker).write_text("blocked")
        threading.Event().wait()
    return real_save(obj, f, *args, **kwargs)
torch.save = blocking_save
torch.set_num_threads(1)
run_training(tiny_config(cache, out, **{settings!r}))
"""


@pytest.mark.slow
def test_a_kill_mid_write_leaves_the_previous_checkpoint_and_resume_is_exact(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=4)
    run_training(tiny_config(cache, tmp_path / "full", **SETTINGS))
    reference = losses(tmp_path / "full")

    killed, marker = tmp_path / "killed", tmp_path / "blocked"
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(repo=str(REPO), settings=SETTINGS))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(cache), str(killed), str(marker)],
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    # Step 9 logged: the loop is at its save, waiting for the blocked step-6 write.
    sigkill_when(proc, lambda: marker.exists() and (killed / "metrics.jsonl").exists() and 9 in losses(killed))
    assert proc.returncode == -signal.SIGKILL
    assert latest_checkpoint(killed).step == 3, "the interrupted write must not replace or damage step 3"
    assert list(killed.glob(".tmp-step-00000006-*")), "the killed write left its temporary folder"
    assert {7, 8} <= set(losses(killed)), "training went on while the write was pending"

    run_training(tiny_config(cache, killed, resume=True, **SETTINGS))
    assert not list(killed.glob(".tmp-*")), "the next start removes what the killed write left"
    got = losses(killed)
    worst = max(abs(got[s] - reference[s]) for s in range(4, 13))
    assert worst <= 1e-6, f"max abs loss diff {worst} after resuming from step 3"


# ---- 4. a full disk --------------------------------------------------------------------------------------------

FULL_DISK = ("--max-steps", "8", "--checkpoint-every", "2", "--keep-checkpoints", "5")


@pytest.fixture(scope="module")
def full_disk_reference(tmp_path_factory):
    """A cache and the losses of its uninterrupted 8-step run (checkpoints every 2 steps)."""
    root = tmp_path_factory.mktemp("full_disk")
    cache = tiny_cache(root / "cache", num_batches=4)
    result = CliRunner().invoke(train_cli, tiny_cli_args(cache, root / "run", *FULL_DISK))
    assert result.exit_code == 0, result.output
    return cache, losses(root / "run")


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("writer", ["safetensors", "torch.save"])  # model.safetensors, optimizer.pt
def test_a_full_disk_at_a_checkpoint_is_one_line_and_resume_continues(
    full_disk_reference, tmp_path, monkeypatch, mode, writer
):
    """The disk fills while step 4 is written (each library failing as it does: safetensors with the OS's
    words only, torch.save with no errno at all): one line naming the checkpoint, what it needs and what is
    free; step 2 intact; once space is back, --resume continues from step 2 as if nothing had happened."""
    cache, reference = full_disk_reference
    run = tmp_path / "run"
    failed = fill_disk(monkeypatch, writer, when=lambda path: "step-00000004" in path)
    args = tiny_cli_args(cache, run, *FULL_DISK, "--checkpoint-write", mode)
    line = one_error_line(CliRunner().invoke(train_cli, args))
    assert failed, "the step-4 checkpoint was never written"
    assert line.startswith(f"Error: writing {run / 'step-00000004'} failed: No space left on device (needs "), line
    assert "KB free there); checkpoint step-00000004 was not kept" in line, line
    assert "re-run with --resume" in line, line
    assert latest_checkpoint(run).step == 2, "the checkpoint before the full disk must stay the newest valid one"
    assert not list(run.glob(".tmp-*")) and not (run / "step-00000004").exists()
    assert max(losses(run)) <= 6, f"the loop trained on past a failed checkpoint: {sorted(losses(run))}"

    monkeypatch.undo()  # space again
    result = CliRunner().invoke(train_cli, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    got = losses(run)
    worst = max(abs(got[s] - reference[s]) for s in range(3, 9))
    assert sorted(got) == list(range(1, 9)) and worst <= 1e-6, f"max abs loss diff {worst} after the resume"


def test_too_little_space_is_said_at_start_and_refused_before_writing(
    full_disk_reference, tmp_path, monkeypatch, caplog
):
    """A checkpoint's size is known from the start (the state's tensor bytes): the start warns that the next
    one does not fit, and its save is refused before writing anything; the size stated is what a checkpoint
    really takes (model.safetensors + optimizer.pt of a real one) but for the files' headers."""
    cache, _ = full_disk_reference
    written = tmp_path / "written"
    result = CliRunner().invoke(train_cli, tiny_cli_args(cache, written, "--max-steps", "2"))
    assert result.exit_code == 0, result.output
    on_disk = sum((written / "step-00000002" / name).stat().st_size for name in (MODEL_FILE, OPTIMIZER_FILE))

    import shards.common.diskfull as diskfull

    real = diskfull.shutil.disk_usage
    monkeypatch.setattr(diskfull.shutil, "disk_usage", lambda path: real(path)._replace(free=900))
    run = tmp_path / "run"
    caplog.set_level(logging.INFO)
    line = one_error_line(CliRunner().invoke(train_cli, tiny_cli_args(cache, run, *FULL_DISK)))
    assert line.startswith(f"Error: {run}: ") and " to write and 900 B free there; nothing was written" in line, line
    assert "checkpoint step-00000002 was not kept" in line and not list(run.glob("*step-*")), line
    stated = line.removeprefix(f"Error: {run}: ").split(" to write")[0]
    assert f"the next checkpoint needs {stated} under {run}, and 900 B is free there" in caplog.text, caplog.text
    needed = float(stated.removesuffix(" KB")) * 1e3
    # Headers: a few hundred bytes a tensor, some percent of this tiny drafter's state, nothing of a 27B one's.
    assert 0 < on_disk - needed < 0.1 * on_disk, f"checkpoint size stated {stated}, written {on_disk} B"


# ---- GPU: page-locked snapshot ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_snapshot_writes_the_state_it_was_taken_from(tmp_path):
    device = torch.device("cuda")
    big = torch.randn(4096, 4096 + 64, device=device)  # over the cudaHostRegister threshold
    model = {"big": big, "small": torch.randn(7, device=device)}
    opt = {"state": {0: {"step": torch.tensor(3.0, device=device), "exp_avg": torch.randn(5, device=device)}}}
    want = {k: v.cpu() for k, v in model.items()}
    writer = CheckpointWriter(tmp_path, keep=2, mode="async", device=device)
    writer.allocate(model, opt)
    writer.save(1, model, opt, {"step": 1})
    big.add_(1.0)  # training goes on while the thread writes
    writer.wait()
    got = load_model_state(latest_checkpoint(tmp_path))
    assert all(torch.equal(got[k], want[k]) for k in want)
    writer.close()


def test_bench_checkpoint_runs_on_cpu_at_a_small_size(tmp_path):
    from tools.bench.checkpoint import main as bench

    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--hidden", "64", "--mlp", "128", "--layers", "1", "--step-matmuls", "1"]
    result = CliRunner().invoke(bench, [*args, "--dir", str(tmp_path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [(r["mode"], r["save"]) for r in report["results"]] == [("async", 1), ("async", 2), ("sync", 1)]
    # 12 bytes per parameter in the buffers (fp32 weights, exp_avg, exp_avg_sq) plus AdamW's step counters.
    async_bytes = report["results"][0]["host_buffer_bytes"]
    assert 12 * report["params"] <= async_bytes < 12 * report["params"] + 4096
    assert all(r["bytes"] > 12 * report["params"] for r in report["results"])
    assert list(tmp_path.iterdir()) == [out], "the benchmark removes its checkpoints"
