"""Where a dataset's files are: --data names a Parquet or JSON Lines file, a directory holding such
files (searched recursively), or a glob. Files are taken in sorted order, so the dataset order, and
with it the packing plan and every batch id, is the same on every run and every rank.

Also: whether a path lies under --data (a file written there would be read back as data), and the
<file> part of the ids derived for rows without one ("<file>:<row>"), unique across the files.
"""

from __future__ import annotations

import fnmatch
import glob
import logging
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from extract.dataset.rows import DataError

logger = logging.getLogger(__name__)

DATA_SUFFIXES = (".parquet", ".jsonl")


def is_glob(path: str | os.PathLike) -> bool:
    """`path` is a pattern: it has a wildcard and names no existing file or directory (a folder
    called `run[1]` is a folder)."""
    text = str(path)
    return any(c in text for c in "*?[") and not os.path.lexists(text)


def data_would_read(data: str | os.PathLike, path: str | os.PathLike) -> bool:
    """--data `data` (a file, directory or glob) names `path`: it is the input file, lies inside the
    input directory, or matches the pattern, so a file written there would be read back as data."""
    if not is_glob(data):
        root, p = Path(os.path.realpath(data)), Path(os.path.realpath(path))
        return p == root or root in p.parents
    pattern = Path(os.path.abspath(str(data))).parts
    return any(_glob_match(pattern, Path(q).parts) for q in (os.path.abspath(path), os.path.realpath(path)))


def _glob_match(pattern: Sequence[str], parts: Sequence[str]) -> bool:
    """glob.glob(recursive=True)'s match, one path segment at a time: `**` spans any number of
    directories, every other segment matches exactly one (its `*` never crosses a `/`)."""
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_glob_match(rest, parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], head) and _glob_match(rest, parts[1:])


def find_data_files(path: str | os.PathLike, suffixes: tuple[str, ...] = DATA_SUFFIXES) -> list[str]:
    """The data files named by `path` (file, directory or glob) whose names end in `suffixes`, sorted."""
    text = str(path)
    if is_glob(text):
        files = sorted(glob.glob(text, recursive=True))
        if not files:
            raise DataError(f"no files match {text!r}")
        bad = [f for f in files if not f.endswith(suffixes)]
        if bad:
            raise DataError(f"{text!r} matches files that are not {' or '.join(suffixes)}: {bad[:5]}")
        return files
    p = Path(text)
    if p.is_dir():
        found = sorted(str(f) for f in p.rglob("*") if f.is_file())
        files = [f for f in found if f.endswith(suffixes)]
        if len(files) < len(found):
            logger.info("%s: ignoring %d files that are not %s", p, len(found) - len(files), suffixes)
        if not files:
            raise DataError(f"directory {p} holds no {' or '.join(suffixes)} files")
        return files
    if not p.is_file():
        raise DataError(f"dataset path {p} does not exist")
    if not text.endswith(suffixes):
        raise DataError(f"{p}: unsupported file type; expected one of {suffixes}")
    return [text]


def derived_id_prefixes(files: list[str]) -> dict[str, str]:
    """The <file> part of each file's derived ids "<file>:<row>": its stem, unless another of `files`
    has the same stem; then its path relative to the folder common to all of them, suffix kept
    (chats.jsonl and chats.parquet of one folder share a stem), so derived ids never collide."""
    stems = Counter(Path(f).stem for f in files)
    if all(n == 1 for n in stems.values()):
        return {f: Path(f).stem for f in files}
    root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    return {
        f: Path(f).stem if stems[Path(f).stem] == 1 else Path(os.path.relpath(os.path.abspath(f), root)).as_posix()
        for f in files
    }
