"""Durable writes: a file appears under its final name only when complete.

Unique temporary name in the same directory, write, flush, fsync, os.replace, fsync the directory.
A writer killed at any point leaves at most a `.tmp-*` file, which readers never look at.
Files get mode 0o644 (mkstemp's 0o600 would hide a cache or an exported drafter from a serving
process that runs as another user).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from shards.common.crc import crc32

TMP_PREFIX = ".tmp-"
# What tempfile.mkstemp names our temporaries: the prefix, the final name and a dot, then 8 random
# characters. A user's `.tmp-backup/` folder or `.tmp-notes.txt` has another shape and stays theirs.
PROBE = "probe"  # check_writable's temporaries: .tmp-probe.xxxxxxxx
_TEMPORARY = re.compile(re.escape(TMP_PREFIX) + r"(?P<final>.+)\.[a-z0-9_]{8}")


FILE_MODE = 0o644  # owner writes, everyone reads
DIR_MODE = 0o755


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None], mode: int = FILE_MODE) -> None:
    """Call write(f) on a temporary file, then make it appear as `path` in one step."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Covers disk-full and KeyboardInterrupt alike: the final name never holds a partial file.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def check_writable(path: str | Path, what: str) -> None:
    """Refuse, before any work, an output directory the program could not write: `path` itself when
    it exists, else the nearest existing directory above it (where it would be created).

    Writability is tried, not asked: os.access says yes to root on a read-only mount. A probe
    temporary of ours (a file in `path`, or a folder where `path` would be made) is created and
    removed at once. Raises ValueError starting with `what` (the flag and its value), naming the
    directory, the reason and the fix.
    """
    target = Path(path)
    where = target
    try:
        while not where.exists() and where.parent != where:
            where = where.parent
    except OSError as e:  # a component we may not even look into
        raise ValueError(f"{what}: cannot look into {where} ({e.strerror}); choose another directory") from e
    if not where.is_dir():
        made = "" if where == target else f", so {target} cannot be made in it"
        raise ValueError(f"{what}: {where} is a file, not a directory{made}; choose another path")
    try:
        if where == target:
            fd, probe = tempfile.mkstemp(prefix=TMP_PREFIX + PROBE + ".", dir=where)
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=TMP_PREFIX + PROBE + ".", dir=where))
    except OSError as e:
        raise ValueError(
            f"{what}: cannot write in {where} ({e.strerror}); choose a directory on a writable file system, "
            "or one this user may write to"
        ) from e


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_final_name(path: str | Path) -> str | None:
    """The final name an atomic_write temporary of ours was for, None for anything else (a folder, a
    link, another name)."""
    path = Path(path)
    match = _TEMPORARY.fullmatch(path.name)
    if match is None or path.is_symlink() or not path.is_file():
        return None
    return match["final"]


def remove_stale_temporaries(directory: str | Path, finals: Callable[[str], bool] | None = None) -> list[Path]:
    """Delete the temporary files killed writers of ours left in `directory` (with `finals`: only those
    whose final name it accepts, the names written there); returns what was removed."""
    removed = []
    for p in Path(directory).glob(TMP_PREFIX + "*"):
        final = temporary_final_name(p)
        if final is None or (finals is not None and not finals(final)):
            continue
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed


def file_checksum(path: str | Path, chunk_bytes: int = 16 << 20) -> str:
    """crc32 of a file's bytes (same "crc32:xxxxxxxx" form as shards.format.checksum)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            crc = crc32(chunk, crc)
    return f"crc32:{crc:08x}"


def fsync_file(path: str | Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
