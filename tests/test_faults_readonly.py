"""Fault injection, directories that cannot be written: `dflash-extract --out`, `dflash-train --out` and
`dflash-train export OUT` are refused before any work with one message naming the directory and the fix.

The tests run as root, whom permission bits do not stop (chmod 0o500 changes nothing, and os.access says
yes), so the code tries to write (a probe temporary of its own, created and removed) and the tests make
writes really fail in three ways, each named in its case:
  "under a file"   ENOTDIR, real: the output's parent is a regular file.
  "in /sys"        EPERM / EACCES, real: sysfs refuses new entries even to root (skipped without sysfs).
  "read-only fs"   EROFS: an existing, empty directory whose writes fail as on a read-only mount, by
                   monkeypatching os.open and os.mkdir for paths inside it (the CLIs run in process,
                   through click's CliRunner).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from extract.cli import main as extract_cli
from tests.helpers.extract import cli_args, snapshot
from tests.helpers.train import tiny_cache, tiny_cli_args, tiny_config
from train.cli import main as train_cli
from train.loop import run_training

SYSFS = Path("/sys")
HAS_SYSFS = os.path.ismount(SYSFS) and (SYSFS / "kernel").is_dir()


def fail_writes_in(monkeypatch, directory: Path) -> None:
    """Creating anything inside `directory` fails with EROFS, as on a read-only mount."""
    real_open, real_mkdir = os.open, os.mkdir

    def inside(path) -> bool:
        return Path(os.fsdecode(path)).parent == directory

    def ro_open(path, flags, *a, **kw):
        if inside(path) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
        return real_open(path, flags, *a, **kw)

    def ro_mkdir(path, *a, **kw):
        if inside(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
        return real_mkdir(path, *a, **kw)

    monkeypatch.setattr(os, "open", ro_open)
    monkeypatch.setattr(os, "mkdir", ro_mkdir)


def unwritable(how: str, tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """(the output path to give, the directory the message must name as not writable)."""
    if how == "under a file":
        (tmp_path / "notes.txt").write_text("a file, not a directory")
        return tmp_path / "notes.txt" / "out", tmp_path / "notes.txt"
    if how == "in /sys":
        if not HAS_SYSFS:
            pytest.skip("needs a sysfs mount at /sys")
        return SYSFS / "dflash-test-out", SYSFS
    ro = tmp_path / "ro"
    ro.mkdir()
    fail_writes_in(monkeypatch, ro)
    return ro, ro


HOWS = ["under a file", "in /sys", "read-only fs"]


def expect_refusal(result, flag: str, out: Path, where: Path, how: str) -> None:
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), f"raw traceback: {result.exception!r}"
    shown = result.output
    if how == "under a file":
        assert f"{flag} {out}: {where} is a file, not a directory" in shown, shown
    else:
        assert f"{flag} {out}: cannot write in {where} (" in shown, shown
        assert "choose a directory on a writable file system, or one this user may write to" in shown, shown


@pytest.mark.parametrize("how", HOWS)
def test_extract_out_that_cannot_be_written_is_refused_before_any_work(
    target, data, tmp_path, monkeypatch, no_work, how
):
    out, where = unwritable(how, tmp_path, monkeypatch)
    before = snapshot(tmp_path)
    result = CliRunner().invoke(extract_cli, cli_args(target, data, out))
    expect_refusal(result, "--out", out, where, how)
    assert snapshot(tmp_path) == before, "nothing is written anywhere"


@pytest.mark.parametrize("how", HOWS)
def test_train_out_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch, no_work, how):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    out, where = unwritable(how, tmp_path, monkeypatch)
    before = snapshot(tmp_path)
    result = CliRunner().invoke(train_cli, tiny_cli_args(cache, out, "--max-steps", "1"))
    expect_refusal(result, "--out", out, where, how)
    assert snapshot(tmp_path) == before, "nothing is written anywhere"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    cache = tiny_cache(root / "cache", num_batches=2)
    run_training(tiny_config(cache, root / "run", max_steps=1))
    return root / "run"


@pytest.mark.parametrize("how", HOWS)
def test_export_into_a_directory_that_cannot_be_written_is_refused_first(run_dir, tmp_path, monkeypatch, no_work, how):
    out, where = unwritable(how, tmp_path, monkeypatch)
    before = snapshot(tmp_path)
    result = CliRunner().invoke(train_cli, ["export", str(run_dir), str(out)])
    expect_refusal(result, "export directory", out, where, how)
    assert snapshot(tmp_path) == before, "nothing is written anywhere"
