"""--cache-dir of tools/bench/extract.py: a directory the benchmark owns, whose folders it deletes and makes
again on every run. A directory it did not make is refused, and nothing in it is deleted.

    DIR/.dflash-bench-extract   the marker: DIR is the benchmark's (written into a new or empty DIR only)
    DIR/cache/                  the extraction cache of each configuration in turn
    DIR/data/                   the length mix, the target's config.json, the long samples

Everything inside DIR is reached through shards/common/owned's Dir: no link is followed, and a link, file
or FIFO where a folder of ours belongs is refused, never deleted through.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shards.common.errors import UserError
from shards.common.owned import Dir, OwnershipError

MARKER = ".dflash-bench-extract"
PROGRAM = "python -m tools.bench.extract"
CACHE, DATA = "cache", "data"


class ScratchDirError(UserError, ValueError):
    """--cache-dir is not the benchmark's to write and delete in."""


def claim_scratch_dir(path: str | Path) -> Path:
    """DIR made (or recognised by its marker) as the benchmark's own; refused when it holds anything else."""
    root = Path(path)
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        raise ScratchDirError(f"--cache-dir {root}: a link or a file, not a directory; name a new directory")
    with Dir.open(root, create=True) as d:
        if _is_marked(d):
            return root
        if d.names():
            raise ScratchDirError(
                f"--cache-dir {root} holds files the benchmark did not make (no {MARKER} of ours): nothing was "
                "deleted; name a new or empty directory"
            )
        d.write_atomic(MARKER, lambda f: f.write(json.dumps({"made_by": PROGRAM}).encode() + b"\n"))
    return root


def fresh_folder(root: Path, name: str) -> Path:
    """DIR/name emptied: what an earlier run (or configuration) left there deleted, the folder made again."""
    with _own(root) as d:
        d.rmtree(name)  # a link there is refused, never followed
        d.child(name, create=True).close()
    return root / name


def remove_folder(root: Path, name: str) -> None:
    """DIR/name deleted (the marker stays: DIR remains the benchmark's)."""
    with _own(root) as d:
        d.rmtree(name)


@contextmanager
def _own(root: Path) -> Iterator[Dir]:
    """DIR, still marked as the benchmark's (claim_scratch_dir marked it: a missing marker means it is not now)."""
    with Dir.open(root) as d:
        if not _is_marked(d):
            raise ScratchDirError(f"--cache-dir {root} lost its {MARKER}: nothing was deleted")
        yield d


def _is_marked(d: Dir) -> bool:
    try:
        return json.loads(d.read_text(MARKER)).get("made_by") == PROGRAM
    except (FileNotFoundError, OwnershipError, ValueError, AttributeError):
        return False
