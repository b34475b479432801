"""Where a run's start-up goes: seconds per phase (weights, compile, warm-up, graph capture, first batch or
step), logged once and recorded (extraction's progress JSONL and summary, training's metrics.jsonl, the
benchmarks' JSON).

StartupClock.mark(name) closes the phase that began at the previous mark: it waits for the GPU (a phase
is done when its kernels are), then records its seconds and, of those, the seconds torch.compile spent
compiling in it (dynamo, AOTAutograd and inductor, from torch's own timers) and the graphs it compiled
(`second_batch_graphs` would be a recompile: batches differ in length, and the token dimension is dynamic
from the first call). The record ends with the process's compile counts (graphs, FX graph cache hits,
misses, bypasses), which tell a warm run that loaded every graph from one that did not. What a phase spent beyond
compiling on its first batch is the Triton kernels' JIT and autotuning (fla's, the FP8 feed kernels') and
the work itself. `since_process_start_s` counts from the process's start (Python's imports included),
which is what a user waits for.
"""

from __future__ import annotations

import logging
import os
import time

import torch

log = logging.getLogger(__name__)


def compile_counts() -> dict[str, int]:
    """What torch.compile did so far in this process: graphs compiled (a recompile is one more) and
    inductor's FX graph cache hits, misses and bypasses (a warm run should hit every graph)."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        **{f"fxgraph_cache_{k}": int(counters["inductor"][f"fxgraph_cache_{k}"]) for k in ("hit", "miss", "bypass")},
    }


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling frames in this process (0.0 where torch keeps no such timer)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("entire_frame_compile", 0.0))
    except (ImportError, AttributeError):
        return 0.0


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), or None where that cannot be read."""
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in clock ticks
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Seconds per start-up phase, each mark closing the phase begun at the one before."""

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()
        self._compiled = compile_seconds()
        self._graphs = compile_counts()["graphs"]

    def mark(self, name: str) -> float:
        """Close phase `name` (after the GPU finished it); returns its seconds."""
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now, compiled = time.perf_counter(), compile_seconds()
        seconds = now - self._last
        self.phases[f"{name}_s"] = round(seconds, 3)
        if compiled - self._compiled > 0.0005:
            self.phases[f"{name}_compile_s"] = round(compiled - self._compiled, 3)
        graphs = compile_counts()["graphs"]
        if graphs > self._graphs:  # a phase after the first batch or step that compiles is a recompile
            self.phases[f"{name}_graphs"] = graphs - self._graphs
        self._last, self._compiled, self._graphs = now, compiled, graphs
        return seconds

    def record(self) -> dict[str, float | None]:
        """The phases so far, and the seconds since the process started."""
        age = process_age_s()
        return {
            **self.phases,
            "since_process_start_s": None if age is None else round(age, 3),
            "compile_counts": compile_counts(),
        }

    def log(self, what: str) -> dict[str, float | None]:
        """One line naming every phase; returns record()."""
        record = self.record()
        parts = []
        for name, seconds in self.phases.items():
            if not name.endswith("_s") or name.endswith("_compile_s"):
                continue
            compiling = self.phases.get(f"{name[:-2]}_compile_s")
            spent = "" if compiling is None else f" ({compiling:.1f}s of it compiling)"
            parts.append(f"{name[:-2].replace('_', ' ')} {seconds:.1f}s{spent}")
        since = record["since_process_start_s"]
        log.info("start-up of %s: %s%s", what, ", ".join(parts), "" if since is None else f"; {since:.1f}s since start")
        return record
