"""What produced a cache or checkpoint: recorded next to it, shown when something differs."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import time
from pathlib import Path

_PACKAGES = ("dflash-pipeline", "torch", "triton", "fla-core", "causal-conv1d", "safetensors", "pyarrow", "numpy")


def provenance() -> dict:
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),  # what relative paths in argv were relative to
        "git_sha": _git_sha(),
        "python": sys.version.split()[0],
        "versions": versions,
    }


def _git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
