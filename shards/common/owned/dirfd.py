"""A directory the program writes in, reached through an open descriptor: no link inside it is followed,
no FIFO or device inside it is opened where the program expects a file of its own.

Dir.open(path) opens the directory as the user named it (links on that path are the user's own choice);
every name inside it is then resolved relative to the descriptor (dir_fd=), one component at a time with
O_NOFOLLOW, so a planted link cannot redirect a write: not as the last component (O_NOFOLLOW guards only
that one) and not as a folder on the way (`shards/` or `logs/` made a link to elsewhere).

The rules for a file of the program's own:
  create       exclusively (O_CREAT | O_EXCL | O_NOFOLLOW): a name that exists, dangling link included,
               is never written through;
  open         only a regular file: lstat first, so a FIFO (whose open blocks) or a device (whose open can
               act) is never opened, then O_NOFOLLOW | O_NONBLOCK and fstat again (a swap in between is
               caught), then back to blocking; for an in-place write (append, truncate) only a file with one
               name, as a hard link's other name (a `cp -al` copy) would change too;
  replace      an atomic write renames a temporary created exclusively over the name, and only over a
               regular file (a link, FIFO or folder there is the user's and is refused);
  delete       unlink / rmdir / rmtree by name relative to the descriptor (they never follow a link).
Anything else found where a file of ours should be is refused with OwnershipError, naming it.

Library writers that take a path (safetensors, torch.save, TensorBoard) follow links. They write only
inside a folder the program has just created exclusively (make_temp_dir: a fresh random name, nothing
can be planted in it), through `pinned_path`: /proc/self/fd/N/NAME resolves to the very directory the
descriptor holds, even if its name is swapped for a link meanwhile.

Why hand-written: pathlib, shutil.move and tempfile take paths and follow links in every component but
the last; Linux's openat2(RESOLVE_NO_SYMLINKS) does this walk in the kernel but Python's os has no
binding for it; no library on PyPI gives descriptor-relative, no-follow access with these refusals.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, BinaryIO

from shards.common.errors import UserError

TMP_PREFIX = ".tmp-"
PROBE = "probe"  # check_writable's temporaries: .tmp-probe.xxxxxxxx
# The shape of our temporaries (as tempfile.mkstemp names them): the prefix, the final name and a dot,
# then 8 random characters. A user's `.tmp-backup/` folder or `.tmp-notes.txt` has another shape.
_TEMP_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"
_TEMPORARY = re.compile(re.escape(TMP_PREFIX) + r"(?P<final>.+)\.[a-z0-9_]{8}")

FILE_MODE = 0o644  # owner writes, everyone reads: a serving process often runs as another user
DIR_MODE = 0o755

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_OWN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_PROC_FD = Path("/proc/self/fd")


class OwnershipError(UserError, ValueError):
    """A directory or file is not the program's to write, replace or delete; the message names it and
    what to do. Every refusal of that kind (a folder of the user's files, a link, FIFO or device where
    a file of ours belongs, a file of ours' name holding something else) is this one type."""


def random_suffix() -> str:
    return "".join(secrets.choice(_TEMP_CHARS) for _ in range(8))


def describe_kind(st: os.stat_result | None) -> str:
    mode = st.st_mode if st is not None else 0
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "a file"


def not_own_file(path: Path, st: os.stat_result | None, what: str = "file") -> OwnershipError:
    """The refusal for something other than a regular file (what="folder": a real folder) where the
    program expects its own."""
    target = ""
    if st is not None and stat.S_ISLNK(st.st_mode):
        try:
            target = f" (to {os.readlink(path)})"
        except OSError:
            pass
    return OwnershipError(
        f"{path} is {describe_kind(st)}{target} where the program keeps a {what} of its own; it is never "
        "followed, opened or replaced: move it away (or choose another directory) and run again"
    )


def shared_file(path: Path, num_links: int) -> OwnershipError:
    """The refusal for a file of ours whose bytes another name shares (a hard link: a `cp -al` copy of a
    run or cache), which an in-place write (append, truncate) would change under that other name too."""
    return OwnershipError(
        f"{path} has {num_links} hard links: another name shares its bytes (a `cp -al` copy?), and writing it "
        f"in place would change that one too; give it bytes of its own (cp {path} {path}.own && mv {path}.own "
        f"{path}) and run again"
    )


class Dir:
    """An open directory; see the module docstring. Use as a context manager (closes the descriptor)."""

    def __init__(self, fd: int, path: Path):
        self.fd = fd
        self.path = path  # for messages only: nothing is opened through it

    # ---- opening directories -----------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path, *, create: bool = False) -> Dir:
        """The directory `path` as the user named it; create: made first (parents too) when absent.
        A dangling link there is refused: making the directory would create it where the link points."""
        path = Path(path)
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(path)
            except FileExistsError:
                pass
        try:
            return cls(os.open(path, _DIR_FLAGS), path)
        except FileNotFoundError:
            if not create or not os.path.islink(path):
                raise
            raise not_own_file(path, os.lstat(path), "folder") from None
        except NotADirectoryError:
            raise OwnershipError(f"{path} is {describe_kind(_lstat(path))}, not a directory; choose another") from None

    @classmethod
    @contextmanager
    def opened(cls, root: str | Path, *parts: str, create: bool = False) -> Iterator[Dir]:
        """`root` as the user named it, then each of `parts` below it without following a link."""
        d = cls.open(root, create=create)
        try:
            for part in parts:
                inner = d.child(part, create=create)
                d.close()
                d = inner
            yield d
        finally:
            d.close()

    def child(self, name: str, *, create: bool = False) -> Dir:
        """The folder `name` in this one (made when absent with create); a link or a file there is refused."""
        if create:
            try:
                os.mkdir(name, dir_fd=self.fd)
            except FileExistsError:
                pass
        try:
            return Dir(os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.fd), self.path / name)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            raise not_own_file(self.path / name, self.lstat(name), "folder") from None

    def make_temp_dir(self, prefix: str) -> tuple[str, Dir]:
        """(name, folder) of a new folder `prefix` + 8 random characters, created exclusively (mode 0o700)."""
        while True:
            name = prefix + random_suffix()
            try:
                os.mkdir(name, 0o700, dir_fd=self.fd)
            except FileExistsError:
                continue
            return name, self.child(name)

    # ---- looking -----------------------------------------------------------------------------------
    def lstat(self, name: str) -> os.stat_result | None:
        """`name`'s own status (a link's, not its target's); None when there is nothing of that name."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def is_file(self, name: str) -> bool:
        st = self.lstat(name)
        return st is not None and stat.S_ISREG(st.st_mode)

    def is_dir(self, name: str) -> bool:
        st = self.lstat(name)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def pinned_path(self, name: str) -> str:
        """A path naming `name` in this very directory for a library that takes paths (/proc/self/fd/N/NAME:
        the kernel resolves it to the open descriptor, whatever happens to this directory's own name)."""
        proc = _PROC_FD / str(self.fd)
        return str(proc / name) if proc.is_dir() else str(self.path / name)

    # ---- files of our own --------------------------------------------------------------------------
    def open_own(self, name: str, flags: int, mode: int = FILE_MODE) -> int:
        """A descriptor of the regular file `name` (os.open flags; O_CREAT makes it when absent)."""
        st = self.lstat(name)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise not_own_file(self.path / name, st)  # never opened: a FIFO's open blocks, a device's can act
        try:
            fd = os.open(name, flags | _OWN_FLAGS, mode, dir_fd=self.fd)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise not_own_file(self.path / name, self.lstat(name)) from None
        try:
            st = os.fstat(fd)  # what was opened, had the name changed since the lstat
            if not stat.S_ISREG(st.st_mode):
                raise not_own_file(self.path / name, st)
            if flags & (os.O_WRONLY | os.O_RDWR) and st.st_nlink > 1:
                raise shared_file(self.path / name, st.st_nlink)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_bytes(self, name: str) -> bytes:
        """The content of our regular file `name` (FileNotFoundError when absent)."""
        with os.fdopen(self.open_own(name, os.O_RDONLY), "rb") as f:
            return f.read()

    def read_text(self, name: str) -> str:
        return self.read_bytes(name).decode("utf-8")

    def open_append(self, name: str) -> IO[str]:
        """Our text file `name` for appending, line-buffered (created when absent)."""
        fd = self.open_own(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        return os.fdopen(fd, "a", buffering=1, encoding="utf-8")

    def create(self, name: str, mode: int = FILE_MODE) -> int:
        """A descriptor of a new file `name`, created exclusively (whatever exists there is left alone)."""
        try:
            fd = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd
            )
        except FileExistsError:
            st = self.lstat(name)
            if st is not None and stat.S_ISREG(st.st_mode):
                raise
            raise not_own_file(self.path / name, st) from None
        os.fchmod(fd, mode)  # the umask does not decide who may read our outputs
        return fd

    def write_atomic(self, name: str, write: Callable[[BinaryIO], None], mode: int = FILE_MODE) -> None:
        """Call write(f) on a new temporary of ours, then make it appear as `name` in one step (fsynced
        file and directory): a reader never sees a partial file, and only a regular file is replaced."""
        self.refuse_other_than_file(name)
        while True:
            tmp = f"{TMP_PREFIX}{name}.{random_suffix()}"
            try:
                fd = self.create(tmp, mode)
                break
            except FileExistsError:
                continue
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            self.refuse_other_than_file(name)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            # Covers disk-full and KeyboardInterrupt alike: the final name never holds a partial file.
            self.unlink(tmp, missing_ok=True)
            raise
        self.fsync()

    def refuse_other_than_file(self, name: str) -> None:
        """Refuse (OwnershipError naming it) anything but a regular file under `name`; nothing there is fine."""
        st = self.lstat(name)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise not_own_file(self.path / name, st)

    # ---- changing names ----------------------------------------------------------------------------
    def unlink(self, name: str, *, missing_ok: bool = False) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)  # a link is removed itself, never its target
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmdir(self, name: str) -> None:
        os.rmdir(name, dir_fd=self.fd)

    def rmtree(self, name: str) -> None:
        """Delete the folder `name` and everything in it; a link there is refused (never followed)."""
        st = self.lstat(name)
        if st is None:
            return
        if not stat.S_ISDIR(st.st_mode):
            raise not_own_file(self.path / name, st)
        shutil.rmtree(name, dir_fd=self.fd)  # descriptor-based: links inside are unlinked, not followed

    def replace(self, name: str, into: Dir, new_name: str) -> None:
        """Rename `name` here to `new_name` in `into` (may be this directory), replacing what is there."""
        os.replace(name, new_name, src_dir_fd=self.fd, dst_dir_fd=into.fd)

    def chmod(self, mode: int) -> None:
        os.fchmod(self.fd, mode)

    def fsync(self) -> None:
        os.fsync(self.fd)

    # ---- temporaries -------------------------------------------------------------------------------
    def temporary_final(self, name: str) -> str | None:
        """The final name an atomic-write temporary of ours was for; None for anything else (another
        name, a folder, a link)."""
        match = _TEMPORARY.fullmatch(name)
        return match["final"] if match is not None and self.is_file(name) else None

    def remove_temporaries(self, finals: Callable[[str], bool] | None = None) -> list[str]:
        """Delete the temporaries killed writers of ours left here (with `finals`: only those whose final
        name it accepts); returns their names."""
        removed = []
        for name in self.names():
            final = self.temporary_final(name)
            if final is None or (finals is not None and not finals(final)):
                continue
            self.unlink(name, missing_ok=True)
            removed.append(name)
        return removed

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None
