"""Which entries of a directory the program wrote: the one judgement behind every "may we write, replace
or delete here" of the four commands (a cache, a run directory, an exported drafter, a result file).

A Layout declares what one program writes in a directory of one kind: which names, with which content,
are its own (`claim`), whose atomic-write temporaries it leaves (`temporaries`), which folders of its own
it fills (`folders`, judged entry by entry with their own layout), and what makes the whole directory
recognisably one of its own (`marked`: a cache.json of ours, a run.json of ours, ...). `survey` sorts
every entry, seen with lstat through the directory's descriptor (a link is judged as the link, never as
its target), into
  ours         files and folders the program wrote: the only ones it replaces or deletes;
  scaffolding  the lock file, its readers' records and temporaries of killed writers: never make a directory non-empty;
  foreign      everything else: a user's file, a link, a FIFO or device, a file of one of our names
               holding something else. Its presence makes a command refuse (OwnershipError).
A link, FIFO or device is never ours, whatever its name: only a regular file or a real folder can be.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shards.common.owned.dirfd import PROBE, Dir, OwnershipError, not_own_file

LOCK_FILE = ".dflash.lock"  # shards/common/lock.py's DirectoryLock
# A shared holder's record of itself beside the lock (shards/common/lock.py: one per reading process).
READER_PREFIX = ".dflash.reader-"
READER_RECORD = re.compile(re.escape(READER_PREFIX) + r"[a-z0-9_]{8}")  # the prefix and random_suffix()


@dataclass(frozen=True)
class Entry:
    """One name in a surveyed directory, with its own lstat (a link's, not its target's)."""

    folder: str | None  # the folder of ours it lies in, None at the top
    name: str
    st: os.stat_result
    path: Path  # for messages

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.st.st_mode)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.st.st_mode)

    def __str__(self) -> str:
        return str(self.path)


# claim(directory holding the entry, the entry, whether the whole directory is marked as ours)
Claim = Callable[[Dir, Entry, bool], bool]


def _never(*args: object) -> bool:
    return False


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What one program writes in a directory of one kind; see the module docstring."""

    claim: Claim = _never
    temporaries: Callable[[str], bool] = _never  # final names whose atomic-write temporaries here are ours
    temporary_folders: re.Pattern | None = None  # folders a writer of ours builds before renaming them
    folders: Mapping[str, Layout] = field(default_factory=dict)
    marked: Callable[[Dir], bool] = _never


@dataclass
class Survey:
    marked: bool
    ours: list[Entry] = field(default_factory=list)
    scaffolding: list[Entry] = field(default_factory=list)
    foreign: list[Entry] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Nothing but the lock and temporaries."""
        return not self.ours and not self.foreign


def survey(root: Dir, layout: Layout) -> Survey:
    """Sort every entry of `root` (and of its folders of ours) as the module docstring says."""
    result = Survey(marked=layout.marked(root))
    _sort(root, None, layout, result, top=True)
    return result


def _sort(d: Dir, folder: str | None, layout: Layout, result: Survey, top: bool) -> None:
    for name in d.names():
        st = d.lstat(name)
        if st is None:  # gone since the listing (a writer's temporary renamed into place)
            continue
        entry = Entry(folder, name, st, d.path / name)
        if entry.is_dir and top and name in layout.folders:
            with d.child(name) as sub:
                _sort(sub, name, layout.folders[name], result, top=False)
        elif _is_scaffolding(d, entry, layout, top):
            result.scaffolding.append(entry)
        elif (entry.is_file or entry.is_dir) and layout.claim(d, entry, result.marked):
            result.ours.append(entry)
        else:
            result.foreign.append(entry)


def _is_scaffolding(d: Dir, entry: Entry, layout: Layout, top: bool) -> bool:
    if entry.is_dir:
        return layout.temporary_folders is not None and layout.temporary_folders.fullmatch(entry.name) is not None
    if not entry.is_file:
        return False
    if top and (entry.name == LOCK_FILE or READER_RECORD.fullmatch(entry.name)):  # DirectoryLock's: the
        return True  # name is their only mark
    final = d.temporary_final(entry.name)
    return final is not None and ((top and final == PROBE) or layout.temporaries(final))


def judge(root: Dir, name: str, layout: Layout) -> bool:
    """Whether the top-level entry `name` of root is ours, as `survey` would judge it (False when absent)."""
    st = root.lstat(name)
    if st is None:
        return False
    entry = Entry(None, name, st, root.path / name)
    return (entry.is_file or entry.is_dir) and layout.claim(root, entry, layout.marked(root))


def remove_entries(root: Dir, entries: list[Entry]) -> None:
    """Delete these files (as `survey` listed them), in order, each by name relative to its folder's
    descriptor: a folder swapped for a link since the survey is refused, never followed."""
    for entry in entries:
        if entry.folder is None:
            root.unlink(entry.name, missing_ok=True)
        else:
            with root.child(entry.folder) as d:
                d.unlink(entry.name, missing_ok=True)


def remove_empty_folders(root: Dir, names: list[str]) -> None:
    for name in names:
        if root.is_dir(name):
            with root.child(name) as d:
                if d.names():
                    continue
            root.rmdir(name)


def describe(paths: list, limit: int = 5) -> str:
    shown = ", ".join(str(p) for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def nested(a: str | Path, b: str | Path) -> bool:
    """a and b are the same directory or one lies inside the other (links resolved)."""
    ra, rb = Path(os.path.realpath(a)), Path(os.path.realpath(b))
    return ra == rb or ra in rb.parents or rb in ra.parents


def check_output_file(path: str | Path, flag: str, is_ours: Callable[[Dir, str], bool], what: str) -> None:
    """A result file the user names (`eval --out`, `plot --out`): refuse (OwnershipError naming the flag)
    an output whose directory is missing (never created silently: a typo in it would scatter results),
    that is a folder, a link, FIFO or device, or a file that `is_ours(directory, name)` does not
    recognise as written by `what`."""
    path = Path(path)
    parent = path.parent
    if not parent.is_dir():
        raise OwnershipError(
            f"{flag} {path}: directory {parent} does not exist; create it first or choose another {flag}"
        )
    with Dir.open(parent) as d:
        st = d.lstat(path.name)
        if st is None:
            return
        if stat.S_ISDIR(st.st_mode):
            raise OwnershipError(f"{flag} {path} is a directory; name a file")
        if not stat.S_ISREG(st.st_mode):
            raise OwnershipError(f"{flag} {not_own_file(path, st)}")
        if not is_ours(d, path.name):
            raise OwnershipError(f"{flag} {path} exists and was not written by {what}; choose another {flag}")
