"""Durable writes: a file appears under its final name only when complete.

Unique temporary name in the same directory, created exclusively, write, flush, fsync, rename, fsync
the directory (Dir.write_atomic, shards/common/owned). A writer killed at any point leaves at most a
`.tmp-*` file, which readers never look at. Files get mode 0o644 (mkstemp's 0o600 would hide a cache or
an exported drafter from a serving process that runs as another user).

The path functions here open the file's directory as the caller names it; writes inside a cache, run or
export directory go through Dir.opened(root, folder) instead, so no link inside it is followed.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from shards.common.crc import crc32
from shards.common.owned import FILE_MODE, PROBE, TMP_PREFIX, Dir, not_own_file


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None], mode: int = FILE_MODE) -> None:
    """Call write(f) on a temporary file, then make it appear as `path` in one step."""
    path = Path(path)
    with Dir.open(path.parent) as d:
        d.write_atomic(path.name, write, mode)


def check_writable(path: str | Path, what: str) -> None:
    """Refuse, before any work, an output directory the program could not write: `path` itself when
    it exists, else the nearest existing directory above it (where it would be created).

    Writability is tried, not asked: os.access says yes to root on a read-only mount. A probe
    temporary of ours (a file in `path`, or a folder where `path` would be made) is created and
    removed at once. Raises ValueError starting with `what` (the flag and its value), naming the
    directory, the reason and the fix.
    """
    target = Path(path)
    if target.is_symlink() and not target.exists():  # making it would make it where the link points
        raise not_own_file(target, os.lstat(target), "folder")
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


def remove_stale_temporaries(directory: str | Path, finals: Callable[[str], bool] | None = None) -> list[str]:
    """Delete the temporary files killed writers of ours left in `directory` (with `finals`: only those
    whose final name it accepts, the names written there); returns their names."""
    with Dir.open(directory) as d:
        return d.remove_temporaries(finals)


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
