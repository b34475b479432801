"""One writer at a time: an exclusive OS lock on a cache or run directory.

The lock is fcntl.flock on DIR/.dflash.lock. The kernel releases it when the holding process exits,
however it exits (SIGKILL included), so a lock left by a killed run never blocks the next one; the
file itself stays (deleting it while another process waits on it would let two holders in). The
holder writes its host, pid, start time and argv into the file, so the refusal can name it.

Ranks of one torchrun job share a lock by having rank 0 take it for the whole job.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from shards.common.errors import UserError
from shards.common.json_input import parse_json

LOCK_FILE = ".dflash.lock"


class DirectoryLockedError(UserError, ValueError):
    """Another process holds the directory's lock; the message names its host and pid."""


class DirectoryLock:
    """`with DirectoryLock(dir, "dflash-extract"):` holds dir's lock, or raises DirectoryLockedError."""

    def __init__(self, directory: str | Path, program: str):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.program = program
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> DirectoryLock:
        if self._fd is not None:
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            program, holder = _describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise DirectoryLockedError(
                f"{self.directory} is in use by another {program or self.program} ({holder}; lock file {self.path}); "
                "wait for it to finish or stop it, or choose another directory"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "program": self.program,
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": sys.argv,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_holder(directory: str | Path) -> str | None:
    """Who holds `directory`'s lock right now ("dflash-extract, host H, pid P, ..."), None when nobody
    does; reads only (no lock file is made), so it works on a read-only cache."""
    path = Path(directory) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        program, holder = _describe(os.pread(fd, 4096, 0))
        return f"{program or 'another process'}, {holder}"
    finally:
        os.close(fd)


def _describe(raw: bytes) -> tuple[str | None, str]:
    """(the holder's program, where and since when it runs) from the lock file's record."""
    try:
        rec = parse_json(raw, LOCK_FILE)
        return rec.get("program"), f"host {rec['host']}, pid {rec['pid']}, running since {rec['since']}"
    except (ValueError, KeyError, TypeError, AttributeError):  # InputFileError included
        return None, "holder unknown: it is starting up"
