"""Progress of long work: rate, ETA and a JSON Lines record, shared by both stages."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import IO


def format_duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class ProgressLog:
    """Emits one console line and one JSONL record per `report`, at most every `interval_s` seconds.

    Rates are over the whole run (since start), which is what an ETA should use.
    """

    def __init__(self, logger: logging.Logger, jsonl_path: str | Path | None, total_units: int, interval_s: float = 10.0):
        self.logger = logger
        self.total_units = total_units
        self.interval_s = interval_s
        self.start = time.monotonic()
        self._last = -float("inf")
        self._file: IO[str] | None = None
        if jsonl_path is not None:
            Path(jsonl_path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(jsonl_path, "a", buffering=1)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def eta(self, done_units: int) -> float:
        rate = done_units / max(self.elapsed(), 1e-9)
        return (self.total_units - done_units) / rate if rate > 0 else float("inf")

    def report(self, record: dict, line: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        self.logger.info(line)
        if self._file is not None:
            self._file.write(json.dumps({"time": time.time(), "elapsed_s": round(self.elapsed(), 3), **record}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
