"""The work directory of the acceptance table, and what decides whether a result can be reused.

    WORK/.acceptance-table          marker: this directory is the table's (nothing else is ever written into
                                    a directory without it, unless it is new or empty)
    WORK/data/<digest>/             prompts split, the target's replies, train.parquet, heldout.parquet
    WORK/caches/<digest>/{train,heldout}/    dflash-extract caches, shared by rows with equal extraction
    WORK/runs/<row>/<digest>/seed-<s>/       dflash-train runs (resumed when cut)
    WORK/results/<row>/seed-<s>.json         one result per row and seed, written atomically
    WORK/logs/                      each command's whole output
    WORK/table.md, WORK/table.json  the table of the results so far

Every directory named by a digest is named by what decides its content (a sha256 over canonical JSON),
so a changed setting lands in a new directory and nothing made under other settings is reused. A
result records its fingerprint; a re-run keeps it only when the fingerprint is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from shards.common.durable import atomic_write_text
from shards.common.errors import UserError
from shards.common.lock import DirectoryLock

log = logging.getLogger(__name__)

MARKER = ".acceptance-table"
PROGRAM = "python -m tools.testbed.table"


class WorkDirError(UserError, ValueError):
    """--work cannot be the table's directory (another program's files, a link, a file)."""


def digest(obj: Any) -> str:
    """sha256 of obj as canonical JSON: equal settings, equal digest."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class WorkDir:
    """The table's directory: made or recognised by `open`, held by one run at a time (`lock`)."""

    def __init__(self, root: Path):
        self.root = root

    @classmethod
    def open(cls, path: str | Path) -> WorkDir:
        root = Path(path)
        if root.is_symlink() or (root.exists() and not root.is_dir()):
            raise WorkDirError(f"--work {root}: not a directory (a file or a link); choose a new or empty directory")
        marker = root / MARKER
        if root.exists() and any(root.iterdir()) and not _is_marker(marker):
            raise WorkDirError(
                f"--work {root} holds files the acceptance table did not make (no {MARKER} of ours); "
                "nothing was touched: choose a new or empty directory"
            )
        root.mkdir(parents=True, exist_ok=True)
        if not marker.exists():
            atomic_write_text(marker, json.dumps({"made_by": PROGRAM}) + "\n")
        return cls(root)

    def lock(self) -> DirectoryLock:
        return DirectoryLock(self.root, PROGRAM)

    def subdir(self, *parts: str) -> Path:
        """WORK/parts..., made where missing; a link or a file in its place is refused, never followed."""
        path = self.root
        for part in parts:
            path = path / part
            if path.is_symlink() or (path.exists() and not path.is_dir()):
                raise WorkDirError(f"{path} should be a directory of the table's and is a link or a file: move it away")
            path.mkdir(exist_ok=True)
        return path

    def file(self, *parts: str) -> Path:
        """WORK/parts... as a file the table writes: its directory made, a link in its place refused."""
        path = self.subdir(*parts[:-1]) / parts[-1]
        if path.is_symlink():
            raise WorkDirError(f"{path} should be a file of the table's and is a link: move it away")
        return path

    def log(self, name: str) -> Path:
        """WORK/logs/NAME.log, where one pipeline command's output goes."""
        return self.file("logs", f"{name}.log")

    def result_path(self, row: str, seed: int) -> Path:
        return self.file("results", row, f"seed-{seed}.json")

    def load_result(self, row: str, seed: int) -> dict | None:
        """The stored result of (row, seed), or None when there is none or it cannot be read."""
        path = self.result_path(row, seed)
        if not path.exists():
            return None
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.warning("result %s unreadable (%s): computed again", path, e)
            return None
        return record if isinstance(record, dict) else None

    def save_result(self, row: str, seed: int, record: dict) -> None:
        atomic_write_text(self.result_path(row, seed), json.dumps(record, indent=2, sort_keys=True) + "\n")

    def write_text(self, name: str, text: str) -> Path:
        path = self.file(name)
        atomic_write_text(path, text)
        return path


def _is_marker(path: Path) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("made_by") == PROGRAM
    except (OSError, ValueError, AttributeError):
        return False
