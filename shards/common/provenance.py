"""What produced a cache or checkpoint: recorded next to it, shown when something differs."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_PACKAGES = ("dflash-pipeline", "torch", "triton", "fla-core", "causal-conv1d", "safetensors", "pyarrow", "numpy")


def provenance() -> dict:
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    sha, dirty = _code_git()
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),  # what relative paths in argv were relative to
        "git_sha": sha,
        "git_dirty": dirty,  # a copied tree may carry changes its HEAD does not name
        "python": sys.version.split()[0],
        "versions": versions,
    }


@functools.cache
def _code_git() -> tuple[str | None, bool | None]:
    """This code's commit and whether its checkout differs from it: asked once per process (the code that
    runs is what was imported, and a checkpoint save must not wait on git)."""
    return git(["rev-parse", "HEAD"], _HERE) or None, git_dirty(_HERE)


def git(args: list[str], directory: Path) -> str | None:
    """git's stripped output in `directory`; None where git is missing, slow or fails (not a checkout)."""
    try:
        out = subprocess.run(  # never takes the index lock a user's own git command may want
            ["git", "--no-optional-locks", *args], cwd=directory, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_dirty(directory: Path) -> bool | None:
    """Whether tracked files differ from HEAD in the checkout holding `directory`; None: not known."""
    status = git(["status", "--porcelain", "--untracked-files=no"], directory)
    return None if status is None else bool(status)
