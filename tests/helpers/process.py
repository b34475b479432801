"""Helpers for tests that run the CLIs as child processes (no tests here): the repository root, the
environment a child needs to import this checkout, and the torchrun command line of a multi-rank run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])


def child_env(**extra: str) -> dict[str, str]:
    """os.environ plus this checkout on PYTHONPATH and one OpenMP thread per child (2 shared cores)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, **extra}


def torchrun_command(module: str, *args: str, nproc: int = 2, log_dir: str | Path | None = None) -> list[str]:
    """`python -m torch.distributed.run` of `python -m module args` on nproc local ranks; with `log_dir`,
    each rank's stderr goes to its own file (rank_stderr reads them)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *(["--redirects=2", f"--log-dir={log_dir}"] if log_dir is not None else []),
        "-m",
        module,
        *args,
    ]


def rank_stderr(log_dir: str | Path) -> dict[int, str]:
    """Local rank -> its stderr, from a torchrun_command(..., log_dir=log_dir) run."""
    return {int(p.parent.name): p.read_text() for p in Path(log_dir).rglob("stderr.log")}


def sigkill_when(proc: subprocess.Popen, ready: Callable[[], bool], timeout_s: float = 120.0) -> None:
    """SIGKILL a child as soon as ready() holds (a deterministic point it signals, such as a file it writes);
    fails when the child exits first or ready() never holds. The child is dead when this returns."""
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if proc.poll() is not None:
                err = proc.stderr.read().decode()[-2000:] if proc.stderr else ""
                raise AssertionError(f"the child exited ({proc.returncode}) before the point to kill it at: {err}")
            assert time.monotonic() < deadline, f"the child never reached the point to kill it at in {timeout_s} s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
