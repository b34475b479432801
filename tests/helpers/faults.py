"""Helpers shared by the fault tests of several components (no tests here): a flipped byte, output
directories whose writes really fail, and writers that fail as on a full disk (fill_disk, at the end).

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


# ---- a full disk ----------------------------------------------------------------------------------------------
# How each writer fails when the disk fills under it, as measured on a 2 MB tmpfs: safetensors keeps only the
# OS's words, torch.save to a path keeps nothing of the errno, Python's own file writes (shards.container's
# write_container, the durable writes) and pyarrow raise OSError(ENOSPC).
_WRITERS = {  # name: (module, attribute) of the writer as the code under test calls it
    "safetensors": ("train.checkpoint.store", "save_file"),  # save_file(tensors, path): model.safetensors
    "torch.save": ("torch", "save"),  # torch.save(obj, path): optimizer.pt
    "container": ("train.checkpoint.export", "write_container"),  # write_container(f, ...): the export
}


def _no_space(writer: str) -> Exception:
    if writer == "safetensors":
        from safetensors import SafetensorError

        return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    if writer == "torch.save":
        return RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fill_disk(monkeypatch, writer: str, when=lambda path: True, free_after: int = 4096) -> list[str]:
    """`writer` (a _WRITERS key) fails as on a full disk for the paths `when` accepts: it writes 100 bytes
    of the file, then raises what that writer raises there; from then on the file system reports at most
    `free_after` bytes free (shutil.disk_usage as shards.common.diskfull reads it). Returns the paths it
    failed on."""
    import importlib

    import shards.common.diskfull as diskfull

    module_name, attribute = _WRITERS[writer]
    module = importlib.import_module(module_name)
    real_write, real_usage = getattr(module, attribute), diskfull.shutil.disk_usage
    failed: list[str] = []

    def usage(path):
        found = real_usage(path)
        return found._replace(free=min(found.free, free_after)) if failed else found

    def full(first, second, *args, **kwargs):
        f = first if writer == "container" else None  # write_container(f, ...) writes into an open file
        path = _open_path(f) if f is not None else _real_path(os.fsdecode(second))
        if not when(path):
            return real_write(first, second, *args, **kwargs)
        failed.append(path)
        if f is not None:
            f.write(b"\0" * 100)
        else:
            with open(path, "wb") as out:
                out.write(b"\0" * 100)
        raise _no_space(writer)

    monkeypatch.setattr(module, attribute, full)
    monkeypatch.setattr(diskfull.shutil, "disk_usage", usage)
    return failed


def _real_path(path: str) -> str:
    """The path as the user sees it: writers get /proc/self/fd/N/name (shards.common.owned's pinned paths)."""
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def _open_path(f) -> str:
    """The path of an open file, also of one os.fdopen made (whose name is its descriptor)."""
    return f.name if isinstance(f.name, str) else os.readlink(f"/proc/self/fd/{f.fileno()}")


def one_error_line(result) -> str:
    """A CliRunner result's one `Error:` line: exit 1, exactly one such line, no traceback."""
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]
