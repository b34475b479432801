"""A full disk anywhere the program writes is one clean line: which path, how much was needed, how much is free.

Each write boundary (a checkpoint, an export, a shard, the manifest, dflash-data's outputs, the metrics
log) runs inside `refusing_when_full(path, then=..., needed=...)`, which turns a write that failed for want
of space (ENOSPC) or quota (EDQUOT) into DiskFullError (exit 1 and its one line, as the CLIs' user_errors
reports the user-error family: shards.common.errors imports this module, so this one cannot import it):

    writing runs/a/.tmp-step-00000002-x1/optimizer.pt failed: No space left on device (needs 20.80 GB,
    3.10 GB free there); nothing partial was kept, ...

Libraries lose the errno (measured on a 2 MB tmpfs): safetensors raises SafetensorError("... No space left on
device (os error 28)"); torch.save to a path raises RuntimeError("... unexpected pos 576 vs 534") with no
errno anywhere; pyarrow and Python's own files raise OSError(28). So a failure counts as disk full when an
OSError with either errno is in its chain (__cause__, __context__), when a library's error (not an OSError,
whose text may be a server's or a peer's) carries the OS's words for them, or, for a writer that says how
much it needed, when the file system now has less free than that. The CLIs' user_errors catches what no boundary named (one line, the path when the error
has one). `refuse_short_space` refuses before a write whose size is known (a checkpoint).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shards.common.progress import format_bytes

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How the OS's words reach us through libraries that drop the errno (Rust's io::Error adds "(os error 28)").
_NO_SPACE_WORDS = [(code, words) for code in NO_SPACE_ERRNOS for words in (os.strerror(code), f"os error {code}")]


class DiskFullError(OSError):
    """A write failed for want of space or quota; the message names the path, the sizes and what to do.
    Its errno is ENOSPC or EDQUOT (set after construction: OSError's own "[Errno N]" prefix stays out)."""

    exit_code = 1  # user_errors: one line, exit 1, as for the user-error family

    def __init__(self, message: str, code: int = errno.ENOSPC):
        super().__init__(message)
        self.errno = code


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the file system that holds `path` (its nearest existing directory); None if unknown."""
    where = Path(path)
    try:
        while not where.exists() and where.parent != where:
            where = where.parent
        return shutil.disk_usage(where).free
    except OSError:
        return None


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def no_space_errno(error: BaseException) -> int | None:
    """ENOSPC or EDQUOT when the chain of `error` says so (by errno or by the OS's words), else None."""
    for e in _chain(error):
        if isinstance(e, OSError):
            if e.errno in NO_SPACE_ERRNOS:
                return e.errno
            continue
        text = str(e)
        for code, words in _NO_SPACE_WORDS:
            if words in text:
                return code
    return None


def is_disk_full(error: BaseException, path: str | Path | None = None, needed: int | None = None) -> bool:
    """Whether `error` is a write failing for want of space or quota (see the module docstring); with `needed`,
    also a failure that lost its errno while `path`'s file system has less than `needed` bytes free."""
    if not isinstance(error, Exception) or isinstance(error, DiskFullError):
        return False  # Ctrl-C and exits; an inner boundary's refusal already says it all
    if no_space_errno(error) is not None:
        return True
    free = free_bytes(path) if path is not None and needed else None
    return free is not None and free < needed


def _filename(error: BaseException) -> str | None:
    """The file an OSError in the chain names (open, mkstemp, rename set it; a write never does)."""
    return next((os.fsdecode(e.filename) for e in _chain(error) if isinstance(e, OSError) and e.filename), None)


def disk_full_message(path: str | Path, then: str, needed: int | None = None, code: int = errno.ENOSPC) -> str:
    """`writing PATH failed: No space left on device (needs X, Y free there); THEN`."""
    free = free_bytes(path)
    sizes = [f"needs {format_bytes(needed)}"] if needed else []
    sizes += [f"{format_bytes(free)} free there"] if free is not None else []
    return f"writing {path} failed: {os.strerror(code)} ({', '.join(sizes) or 'free space unknown'}); {then}"


@contextmanager
def refusing_when_full(path: str | Path, then: str, needed: int | None = None) -> Iterator[None]:
    """Inside: a write failing for want of space or quota raises DiskFullError naming the file the error
    names, else `path`; `needed` bytes when known; the free space; and `then` (what to do). Anything else,
    and a DiskFullError from a boundary inside this one, passes through unchanged."""
    try:
        yield
    except Exception as e:
        if not is_disk_full(e, path, needed):
            raise
        code = no_space_errno(e) or errno.ENOSPC
        raise DiskFullError(disk_full_message(_filename(e) or path, then, needed, code), code) from e


def disk_full_line(error: BaseException) -> str | None:
    """For the CLIs' user_errors: the one line of a disk-full error (a boundary's, or one no boundary
    named), else None."""
    if isinstance(error, DiskFullError):
        return str(error)
    code = no_space_errno(error) if is_disk_full(error) else None
    if code is None:
        return None
    where = _filename(error)
    then = "free space (or choose another output directory) and run the same command again"
    return disk_full_message(where, then, code=code) if where else f"{os.strerror(code)} ({error}); {then}"


def refuse_short_space(path: str | Path, needed: int, then: str) -> None:
    """Before a write of `needed` bytes under `path`: DiskFullError when its file system has less free."""
    free = free_bytes(path)
    if free is not None and free < needed:
        raise DiskFullError(
            f"{path}: {format_bytes(needed)} to write and {format_bytes(free)} free there; nothing was written; {then}"
        )
