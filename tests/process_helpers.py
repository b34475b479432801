"""Helpers for tests that run the CLIs as child processes (no tests here): the repository root, the
environment a child needs to import this checkout, and the torchrun command line of a multi-rank run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])


def child_env(**extra: str) -> dict[str, str]:
    """os.environ plus this checkout on PYTHONPATH and one OpenMP thread per child (2 shared cores)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, **extra}


def torchrun_command(module: str, *args: str, nproc: int = 2) -> list[str]:
    """`python -m torch.distributed.run` of `python -m module args` on nproc local ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *args,
    ]
