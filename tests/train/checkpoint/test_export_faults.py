"""Fault injection, training files: exports never replace what is not ours and are readable by others;
checkpoints carry checksums, a damaged newest one falls back to the previous valid one; a full disk
while checkpointing is one clear message; a shard of another cache is refused by name.

Cases (tiny synthetic caches, training through the library and the dflash-train CLI):
  1. Export into a target checkpoint folder, into a folder with a user file: refused, bytes unchanged.
     Export twice: the second needs --overwrite. Files 0o644 and folder 0o755 under umask 077.
  2. Newest checkpoint with a flipped byte in model.safetensors, a truncated optimizer.pt, a truncated
     model.safetensors: resume and run-dir export fall back to the previous checkpoint with a warning
     naming the file; exporting that checkpoint by name is refused naming the file.
  3. ENOSPC while writing a checkpoint: "no space left" and the file named, exit 1, nothing partial.
  4. A shard copied in from another cache of the same shapes: verify, the reader and training name it.
  5. eval --out onto a user's file or into a missing directory: refused before any
     work; its own file is replaced, as strict JSON. eval of a checkpoint with a flipped or truncated
     model.safetensors, and --init-from of a truncated export: refused naming the file, no traceback.
"""

import json
import logging
import os
import shutil
import stat

import pytest
from click.testing import CliRunner

from shards import ShardReader, shard_path
from shards.inspect import verify_cache
from tests.helpers.extract import snapshot
from tests.helpers.train import fill_disk_on_torch_save, read_records, tiny_cache, tiny_cli_args, tiny_config
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


# ---- 3. full disk while checkpointing ---------------------------------------------------------------------


def test_disk_full_while_checkpointing_names_the_file(tmp_path, monkeypatch):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    run = tmp_path / "run"
    fill_disk_on_torch_save(monkeypatch)
    result = CliRunner().invoke(train_cli, tiny_cli_args(cache, run, "--max-steps", "2"))
    assert result.exit_code == 1, result.output
    assert "no space left" in result.output and "optimizer.pt" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), "no raw traceback"
    assert list_checkpoints(run) == [] and not list(run.glob(".tmp-*"))


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
