"""Fault injection, training files: exports never replace what is not ours and are readable by others;
checkpoints carry checksums, a damaged newest one falls back to the previous valid one; a full disk
while exporting is one clear line; a shard of another cache is refused by name.

Cases (tiny synthetic caches, training through the library and the dflash-train CLI):
  1. Export into a target checkpoint folder, into a folder with a user file: refused, bytes unchanged.
     Export twice: the second needs --overwrite. Files 0o644 and folder 0o755 under umask 077. Export
     into a directory that cannot be written (under a file, in /sys, on a read-only file system; see
     tests/helpers/faults.py): refused before any work naming the directory and the fix.
  2. Newest checkpoint with a flipped byte in model.safetensors, a truncated optimizer.pt, a truncated
     model.safetensors: resume and run-dir export fall back to the previous checkpoint with a warning
     naming the file; exporting that checkpoint by name is refused naming the file.
  3. A full disk while exporting (new, or over an earlier export): one line naming the file, the space it
     needs and what is free; nothing partial, an earlier export untouched; the export completes once
     there is space. (A full disk while checkpointing: test_async_save.py.)
  4. A shard copied in from another cache of the same shapes: verify, the reader and training name it.
  5. eval --out onto a user's file or into a missing directory: refused before any
     work; its own file is replaced, as strict JSON. eval of a checkpoint with a flipped or truncated
     model.safetensors, and --init-from of a truncated export: refused naming the file, no traceback.
  6. Training SIGKILLed in a subprocess in the middle of writing a checkpoint: the partial checkpoint is
     ignored, the resume starts from the previous one and continues exactly (losses equal to 1e-6).
"""

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from shards import ShardReader, shard_path
from shards.inspect import verify_cache
from tests.helpers.extract import snapshot
from tests.helpers.faults import HOWS, expect_refusal, fill_disk, one_error_line, unwritable
from tests.helpers.process import REPO
from tests.helpers.train import read_records, tiny_cache, tiny_cli_args, tiny_config
from tools.fixtures.tiny_target import write_random_checkpoint
from train.checkpoint.store import latest_checkpoint, list_checkpoints
from train.cli import main as train_cli
from train.loop import run_training


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("trained")
    cache = tiny_cache(root / "cache", num_batches=4)
    run = root / "run"
    run_training(tiny_config(cache, run, epochs=1, checkpoint_every=2, keep_checkpoints=5))
    assert [c.step for c in list_checkpoints(run)] == [2, 4]
    return cache, run


def export(*args):
    return CliRunner().invoke(train_cli, ["export", *map(str, args)])


def no_traceback(result):
    return result.exception is None or isinstance(result.exception, SystemExit)


# ---- 1. export refusals and permissions -------------------------------------------------------------------


def test_export_into_a_target_checkpoint_is_refused(trained, tmp_path):
    _, run = trained
    target = write_random_checkpoint(tmp_path / "target", seed=1)
    before = snapshot(target)
    for flags in ([], ["--overwrite"]):
        result = export(run, target, *flags)
        assert result.exit_code == 1, result.output
        assert "is not a drafter exported by dflash-train" in result.output, result.output
        assert snapshot(target) == before, "the target checkpoint must be left byte for byte"


@pytest.mark.parametrize("name", ["README.md", ".tmp-notes.markdown"])  # a temporary's prefix is no mark
def test_export_into_a_folder_with_user_files_is_refused(trained, tmp_path, name):
    _, run = trained
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text("mine")
    result = export(run, out)
    assert result.exit_code == 1 and name in result.output, result.output
    assert sorted(p.name for p in out.iterdir()) == [name]


def test_replacing_an_export_needs_overwrite_and_files_are_readable_by_all(trained, tmp_path):
    _, run = trained
    out = tmp_path / "exported"
    old = os.umask(0o077)  # a private umask must not make the export private
    try:
        assert export(run / "step-00000002", out).exit_code == 0
        first = snapshot(out)
        result = export(run, out)
        assert result.exit_code == 1 and "pass --overwrite" in result.output, result.output
        assert snapshot(out) == first
        result = export(run, out, "--overwrite")
        assert result.exit_code == 0, result.output
    finally:
        os.umask(old)
    assert snapshot(out) != first, "the step-4 export replaced the step-2 one"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644}, modes


@pytest.mark.parametrize("how", HOWS)
def test_export_into_a_directory_that_cannot_be_written_is_refused_first(trained, tmp_path, monkeypatch, no_work, how):
    _, run_dir = trained
    out, where = unwritable(how, tmp_path, monkeypatch)
    before = snapshot(tmp_path)
    result = CliRunner().invoke(train_cli, ["export", str(run_dir), str(out)])
    expect_refusal(result, "export directory", out, where, how)
    assert snapshot(tmp_path) == before, "nothing is written anywhere"


# ---- 2. damaged checkpoints -------------------------------------------------------------------------------


def _flip(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-64])


DAMAGE = {
    "flipped weight byte": ("model.safetensors", _flip),
    "truncated optimizer": ("optimizer.pt", _truncate),
    "truncated weights": ("model.safetensors", _truncate),
}


def damaged_copy(full, run, case):
    """A copy of the run `full` at `run` whose step-4 checkpoint has the damage `case`; (run, damaged file)."""
    shutil.copytree(full, run)
    name, damage = DAMAGE[case]
    bad = run / "step-00000004" / name
    damage(bad)
    return run, bad


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous(trained, tmp_path, caplog, case):
    cache, full = trained
    run, bad = damaged_copy(full, tmp_path / "run", case)
    caplog.set_level(logging.WARNING)
    assert latest_checkpoint(run).step == 2
    assert str(bad) in caplog.text and "falling back" in caplog.text, caplog.text

    result = export(run / "step-00000004", tmp_path / "e1")
    assert result.exit_code == 1 and str(bad) in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), "no raw traceback"
    assert not (tmp_path / "e1").exists() or not any((tmp_path / "e1").iterdir())
    result = export(run, tmp_path / "e2")
    assert result.exit_code == 0 and "step 2" in result.output, result.output

    summary = run_training(tiny_config(cache, run, epochs=1, checkpoint_every=2, keep_checkpoints=5, resume=True))
    assert summary.steps == 4
    reference = {r["step"]: r["loss/total"] for r in read_records(full)}
    got = {r["step"]: r["loss/total"] for r in read_records(run)}
    assert abs(got[4] - reference[4]) <= 1e-6, "resumed from step 2, steps 3-4 retrained exactly"


# ---- 3. full disk while exporting ---------------------------------------------------------------------------


@pytest.mark.parametrize("earlier", [False, True], ids=["new", "over an earlier export"])
def test_disk_full_while_exporting_is_one_line_and_leaves_nothing_partial(trained, tmp_path, monkeypatch, earlier):
    """model.safetensors fills the disk: one line naming it, what it needs and what is free; no temporary
    and no partial file, an earlier export in place untouched; once space is back the export completes."""
    _, run = trained
    out = tmp_path / "export"
    if earlier:
        assert export(run / "step-00000002", out).exit_code == 0
    before = snapshot(tmp_path)
    failed = fill_disk(monkeypatch, "container")
    result = export(run, out, *(["--overwrite"] if earlier else []))
    line = one_error_line(result)
    assert failed and failed[0].startswith(str(out / ".tmp-model.safetensors.")), failed
    assert line.startswith(f"Error: writing {out / 'model.safetensors'} failed: No space left on device (needs "), line
    assert "KB free there); nothing of this export was written; free space and export again" in line, line
    assert snapshot(tmp_path) == before, "a failed export must leave the directory as it was"
    monkeypatch.undo()
    result = export(run, out, *(["--overwrite"] if earlier else []))
    assert result.exit_code == 0 and "(step 4)" in result.output, result.output


# ---- 4. a shard of another cache --------------------------------------------------------------------------


def test_a_shard_of_another_cache_is_refused_naming_it(tmp_path):
    cache = tiny_cache(tmp_path / "a", num_batches=3, seed=0)
    other = tiny_cache(tmp_path / "b", num_batches=3, seed=1)  # same shapes, other head and data
    shutil.copy(shard_path(other, 1), shard_path(cache, 1))
    foreign = shard_path(cache, 1)
    report = verify_cache(cache)
    assert [b["file"] for b in report.bad if b["batch_id"] == 1] == [str(foreign)]
    assert "belongs to another cache" in report.bad[0]["reason"], report.bad
    with pytest.raises(ValueError, match="belongs to another cache"):
        ShardReader(cache).info(1)
    result = CliRunner().invoke(train_cli, tiny_cli_args(cache, tmp_path / "run", "--max-steps", "3"))
    assert result.exit_code == 1 and str(foreign) in result.output, result.output
    assert "belongs to another cache" in result.output


# ---- 5. eval --out and damaged drafters in eval and --init-from -------------------------------------------


def evaluate(drafter, cache, *extra):
    args = ["eval", "--drafter", drafter, "--cache", cache, "--eval-shards", "1", "--budgets", "", *extra]
    return CliRunner().invoke(train_cli, [str(a) for a in args])


@pytest.mark.parametrize("case", ["a user file", "a missing directory"])
def test_eval_out_is_refused_before_any_work(trained, tmp_path, no_work, case):
    cache, run = trained
    out = {"a user file": cache / "cache.json", "a missing directory": tmp_path / "nodir" / "x.json"}[case]
    before = snapshot(tmp_path), snapshot(cache)
    result = evaluate(run, cache, "--out", out)
    assert result.exit_code == 1 and no_traceback(result), result.output
    expected = {
        "a user file": f"--out {out} exists and was not written by dflash-train eval",
        "a missing directory": f"directory {tmp_path / 'nodir'} does not exist",
    }[case]
    assert expected in result.output, result.output
    assert (snapshot(tmp_path), snapshot(cache)) == before and not (tmp_path / "nodir").exists()


def test_eval_out_is_strict_json_and_replaces_only_its_own(trained, tmp_path):
    cache, run = trained
    out = tmp_path / "eval.json"
    for _ in range(2):  # the second run replaces the first's file: it is ours
        result = evaluate(run, cache, "--out", out)
        assert result.exit_code == 0, result.output
        record = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in {out}: not JSON"))
        assert record["batch_ids"] == [3]
    assert not list(tmp_path.glob(".*")), "no temporary left beside it"


@pytest.mark.parametrize("case", ["flipped weight byte", "truncated weights"])
def test_eval_of_a_damaged_checkpoint_is_refused_naming_the_file(trained, tmp_path, caplog, case):
    cache, full = trained
    run, bad = damaged_copy(full, tmp_path / "run", case)
    result = evaluate(run / "step-00000004", cache)
    assert result.exit_code == 1 and no_traceback(result), result.output
    assert str(bad) in result.output and "acceptance length" not in result.output, result.output
    caplog.set_level(logging.INFO)
    result = evaluate(run, cache)  # a run directory: its newest valid checkpoint, as export takes it
    assert result.exit_code == 0, result.output
    assert f"eval: checkpoint {run / 'step-00000002'}" in caplog.text, caplog.text


def test_init_from_a_truncated_export_is_refused_before_any_work(trained, tmp_path):
    cache, run = trained
    drafter = tmp_path / "drafter"
    assert export(run, drafter).exit_code == 0
    _truncate(drafter / "model.safetensors")
    result = CliRunner().invoke(train_cli, tiny_cli_args(cache, tmp_path / "run", "--init-from", str(drafter)))
    assert result.exit_code == 1 and no_traceback(result), result.output
    assert f"--init-from {drafter}: {drafter / 'model.safetensors'}: unreadable" in result.output, result.output
    assert not (tmp_path / "run").exists(), "refused before the run directory is made"


# ---- 6. SIGKILL while writing a checkpoint ----------------------------------------------------------------


# The child trains through the CLI and SIGKILLs itself half way through writing its second checkpoint's
# optimizer state, so a .tmp-step-* folder with a partial optimizer.pt is all that is left of it.
TRAIN_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    marker = sys.argv[1]
    real_save = torch.save
    calls = [0]

    def dying_save(obj, f, *a, **kw):
        calls[0] += 1
        if calls[0] == 2:
            with open(f, "wb") as out:
                out.write(b"partial optimizer state")
            with open(marker, "w") as m:
                m.write(os.path.realpath(f))  # f reaches the folder through its descriptor (/proc/self/fd/N)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *a, **kw)

    torch.save = dying_save
    from train.cli import main
    main(sys.argv[2:])
""")


@pytest.mark.slow
def test_training_killed_while_checkpointing_resumes_exactly(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=4)
    settings = dict(epochs=4, checkpoint_every=4, keep_checkpoints=3, metrics_every=3)
    full = tmp_path / "full"
    run_training(tiny_config(cache, full, **settings))
    reference = {r["step"]: r["loss/total"] for r in read_records(full)}
    assert sorted(reference) == list(range(1, 17))

    killed = tmp_path / "killed"
    marker = tmp_path / "killed-at"
    args = tiny_cli_args(
        cache, killed, "--epochs", "4", "--checkpoint-every", "4", "--keep-checkpoints", "3", "--metrics-every", "3"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, "-c", TRAIN_KILL_SCRIPT, str(marker), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    assert ".tmp-step-00000008" in marker.read_text(), marker.read_text()
    assert latest_checkpoint(killed).step == 4, "the half-written step 8 must not count as a checkpoint"
    assert list(killed.glob(".tmp-step-00000008-*")), "the kill should have left the partial checkpoint"

    run_training(tiny_config(cache, killed, resume=True, **settings))
    got = {r["step"]: r["loss/total"] for r in read_records(killed)}  # steps 5-8 logged twice: the later wins
    assert sorted(got) == list(range(1, 17))
    diffs = {s: abs(got[s] - reference[s]) for s in range(5, 17)}
    assert max(diffs.values()) <= 1e-6, f"max abs loss diff {max(diffs.values())} (per step: {diffs})"
    assert not list(killed.glob(".tmp-step-*")), "the partial checkpoint must be cleaned up"
    assert latest_checkpoint(killed).step == 16
