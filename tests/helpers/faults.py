"""Helpers shared by the fault tests of several components (no tests here): a flipped byte, and output
directories whose writes really fail.

The tests run as root, whom permission bits do not stop (chmod 0o500 changes nothing, and os.access says
yes), so the code tries to write (a probe temporary of its own, created and removed) and the tests make
writes really fail in three ways (HOWS), each named in its case by `unwritable`:
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


def flip_byte(path, offset=-10):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


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
