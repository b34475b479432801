"""One writer or many readers: an OS lock on a cache or run directory.

The lock is fcntl.flock on DIR/.dflash.lock: exclusive for a job that writes the directory
(dflash-extract, dflash-train on its --out, dflash-shards index and verify --quarantine), shared for
one that reads a cache (dflash-train train and eval on --cache). Readers go together; a writer is
refused while one reads (an --overwrite once rewrote every shard under a running training, which died
saying a shard was missing), and a reader while a writer writes. The kernel releases a flock when its
process exits, however it exits (SIGKILL included), so a lock left by a killed job never blocks the
next one; the file itself stays (deleting it while another process opens it would let two holders in).

Holders leave a record (host, pid, command, start time, argv) so that a refusal can name them: the
writer in the lock file itself, each reader in a file of its own beside it (.dflash.reader-XXXXXXXX)
on which it holds a flock of its own. The record says who; only the flock says whether it is still
there: a reader killed with SIGKILL leaves its record but not its flock, so it is never named, and
the next writer (under whose lock no reader can exist) deletes it.

A reader opens the lock read-only (flock needs no write access), so a cache on a read-only mount or of
another user is read as before; where the lock file is absent and cannot be created, it reads
unlocked, with a warning, and where its record cannot be written, a refusal calls it unnamed.

Files are opened through shards/common/owned (Dir.open_own, Dir.create): a link, FIFO or device
planted under either name is refused, naming it, never truncated through or blocked on.

Ranks of one torchrun job: rank 0 takes a writer's lock for the whole job; every rank takes a
reader's (shared flocks do not conflict).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from shards.common.errors import UserError
from shards.common.json_input import parse_json
from shards.common.owned import LOCK_FILE, READER_PREFIX, READER_RECORD, Dir, OwnershipError
from shards.common.owned.dirfd import random_suffix

log = logging.getLogger(__name__)

_RECORD_BYTES = 4096  # what a refusal reads of a holder's record


class DirectoryLockedError(UserError, ValueError):
    """Another process holds the directory's lock; the message names its host and pid."""


class DirectoryLock:
    """`with DirectoryLock(dir, "dflash-extract"):` holds dir's lock (shared=True: a reader's), or
    raises DirectoryLockedError naming the holders that exclude it."""

    def __init__(self, directory: str | Path, program: str, *, shared: bool = False):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.program = program
        self.shared = shared
        self._fd: int | None = None
        self._reader: tuple[Dir, str, int] | None = None  # a reader's record: folder, name, descriptor

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> DirectoryLock:
        if self._fd is not None:
            return self
        with Dir.open(self.directory) as d:
            fd = self._open(d)
            if fd is None:
                return self
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                refusal = self._refusal(d, fd)
                os.close(fd)
                raise refusal from None
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            try:
                if self.shared:
                    self._write_reader_record()
                else:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, _record(self.program), 0)
                    _remove_reader_records(d)  # all stale: no reader holds the lock with us
            except BaseException:
                self.release()
                raise
        return self

    def _open(self, d: Dir) -> int | None:
        """The lock file's descriptor; None for a reader that can neither open nor create it."""
        if not self.shared:
            return d.open_own(LOCK_FILE, os.O_RDWR | os.O_CREAT)
        try:
            return d.open_own(LOCK_FILE, os.O_RDONLY)
        except FileNotFoundError:
            pass
        try:  # a cache that no locking job wrote (copied without its dot files): a later writer must see us
            return d.open_own(LOCK_FILE, os.O_RDONLY | os.O_CREAT)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            log.warning(
                "%s: cannot create the lock file (%s): reading %s unlocked, so a job that rewrites it "
                "meanwhile would not be refused",
                self.path,
                e.strerror,
                self.directory,
            )
            return None

    def _write_reader_record(self) -> None:
        """This reader's record beside the lock, flocked for as long as it reads; left out (a refusal
        then calls this reader unnamed) where the directory is read-only to it."""
        d = Dir.open(self.directory)
        while True:
            name = READER_PREFIX + random_suffix()
            try:
                fd = d.create(name)
                break
            except FileExistsError:
                continue
            except OSError as e:
                d.close()
                log.debug("%s: no reader record (%s)", self.directory, e)
                return
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._reader = (d, name, fd)
        os.write(fd, _record(self.program))

    def _refusal(self, d: Dir, fd: int) -> DirectoryLockedError:
        """The refusal naming who holds the lock: a writer (its record in the lock file) or readers."""
        where = f"lock file {self.path}"
        if not self.shared and _try_flock(fd, fcntl.LOCK_SH):  # no writer, so readers hold it
            readers = _live_readers(d)
            fcntl.flock(fd, fcntl.LOCK_UN)
            who = "; ".join(readers) if readers else "a job that could not record itself (a read-only cache?)"
            return DirectoryLockedError(
                f"{self.directory} is being read by {who} ({where}); wait for it to finish or stop it, "
                "or choose another directory"
            )
        program, holder = _describe(os.pread(fd, _RECORD_BYTES, 0))
        if self.shared:
            return DirectoryLockedError(
                f"{self.directory} is being written by {program or 'another job'} ({holder}; {where}); "
                "wait for it to finish, then run again"
            )
        return DirectoryLockedError(
            f"{self.directory} is in use by another {program or self.program} ({holder}; {where}); "
            "wait for it to finish or stop it, or choose another directory"
        )

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self._reader is not None:
                d, name, record_fd = self._reader
                self._reader = None
                try:
                    d.unlink(name, missing_ok=True)  # kept, it would only be stale: its flock goes below
                except OSError:
                    pass
                finally:
                    os.close(record_fd)
                    d.close()
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_holder(directory: str | Path) -> str | None:
    """Which job writes `directory` right now ("dflash-extract, host H, pid P, ..."), None when none
    does (readers are no writers); reads only (no lock file is made), so it works on a read-only cache."""
    try:
        with Dir.open(directory) as d:
            fd = d.open_own(LOCK_FILE, os.O_RDONLY)
    except OSError:  # no lock file (nobody ever wrote here), or a directory we may not read
        return None
    try:
        if _try_flock(fd, fcntl.LOCK_SH):
            return None
        program, holder = _describe(os.pread(fd, _RECORD_BYTES, 0))
        return f"{program or 'another process'}, {holder}"
    finally:
        os.close(fd)


def _try_flock(fd: int, operation: int) -> bool:
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _record(program: str) -> bytes:
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "program": program,
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
    }
    return (json.dumps(record) + "\n").encode()


def _live_readers(d: Dir) -> list[str]:
    """The readers whose records are still flocked, each as "program (host H, pid P, running since T)"."""
    found = []
    for name in d.names():
        if not READER_RECORD.fullmatch(name):
            continue
        try:
            fd = d.open_own(name, os.O_RDONLY)
        except (OSError, OwnershipError):  # gone meanwhile, or not a file: no reader of ours
            continue
        try:
            if _try_flock(fd, fcntl.LOCK_SH):  # its reader is gone (closing fd drops this probe's flock)
                continue
            program, holder = _describe(os.pread(fd, _RECORD_BYTES, 0))
            found.append(f"{program or 'a reader'} ({holder})")
        finally:
            os.close(fd)
    return found


def _remove_reader_records(d: Dir) -> None:
    for name in d.names():
        if READER_RECORD.fullmatch(name) and d.is_file(name):
            d.unlink(name, missing_ok=True)


def _describe(raw: bytes) -> tuple[str | None, str]:
    """(the holder's program, where and since when it runs) from the lock file's record."""
    try:
        rec = parse_json(raw, LOCK_FILE)
        return rec.get("program"), f"host {rec['host']}, pid {rec['pid']}, running since {rec['since']}"
    except (ValueError, KeyError, TypeError, AttributeError):  # InputFileError included
        return None, "holder unknown: it is starting up"
