"""Progress of long work: rate, ETA, a JSON Lines record, and the human units both stages print.

On an interactive terminal a ProgressLog draws a tqdm bar; when stderr is a file or a pipe it logs
plain lines instead (a bar redrawn with carriage returns and ANSI codes is noise in a log file).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import IO, TextIO

_BYTE_UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3))
_BAR_WITHOUT_ETA = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"


def format_duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def format_figure(value: float | None, spec: str) -> str:
    """A figure in a printed table or line: `-` where it is undefined (None, NaN or infinite: a draft
    slot never reached, a walk with no response), as the JSON outputs write null; else format(value, spec)."""
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return "-"
    return format(value, spec)


def format_bytes(num_bytes: float) -> str:
    """A size in the decimal unit that fits its magnitude: 649 B, 333.3 KB, 1.47 MB, 51.20 GB."""
    for unit, size in _BYTE_UNITS:
        if abs(num_bytes) >= size:
            value = num_bytes / size
            return f"{value:.1f} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"
    return f"{int(num_bytes)} B"


def plural(count: int, word: str, words: str | None = None) -> str:
    """'1 rank', '2 ranks' (`words` for irregular plurals)."""
    return f"{count} {word if count == 1 else (words or word + 's')}"


def is_interactive(stream: TextIO | None = None) -> bool:
    """Whether `stream` (default stderr, where logging writes) is a terminal a bar can redraw on."""
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _terminal_columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


class ProgressLog:
    """Progress over `total_units`: a JSONL record per `report` (at most every `interval_s` seconds)
    into `jsonl` (an open text file the log then owns and closes; the caller opens it, inside a cache
    through shards/common/owned so that no planted link gets the records) and, for people, either a
    tqdm bar (`bar=True`) or one plain log line per record.

    bar=None: a bar when stderr is an interactive terminal. The bar advances on every report; the
    record and, without a bar, the line are emitted at most every `interval_s` seconds or when forced.
    Rates are over the whole run (since start), which is what an ETA should use. eta_after_units: no
    ETA (`?`) before that many units are done: work done `c` at a time finishes in waves, and the rate
    of the first unit of the first wave (one unit in the time of a whole wave) would put the end c times
    too far (`regenerate` at concurrency 64 said 23m19s for a job that ended 10 s later).
    """

    def __init__(
        self,
        logger: logging.Logger,
        jsonl: IO[str] | None,
        total_units: int,
        interval_s: float = 10.0,
        *,
        bar: bool | None = None,
        desc: str = "",
        unit: str = "batch",
        eta_after_units: int = 1,
    ):
        self.logger = logger
        self.total_units = total_units
        self.eta_after_units = min(eta_after_units, total_units)
        self.interval_s = interval_s
        self.start = time.monotonic()
        self._last = -float("inf")
        self._file = jsonl
        self._bar = None
        if bar if bar is not None else is_interactive():
            from tqdm import tqdm

            # A terminal that reports no size (some pseudo-terminals) would get no bar at all:
            # tqdm hides bars past the terminal's row count, which is 0 there.
            sized = _terminal_columns() > 0
            self._bar = tqdm(
                total=total_units,
                desc=desc or None,
                unit=unit,
                leave=True,
                dynamic_ncols=sized,
                ncols=None if sized else 100,
                nrows=None if sized else 20,
                # tqdm's own ETA knows nothing of waves: the caller's postfix carries eta() instead.
                bar_format=_BAR_WITHOUT_ETA if self.eta_after_units > 1 else None,
            )

    @property
    def has_bar(self) -> bool:
        return self._bar is not None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def eta(self, done_units: int) -> float:
        """Seconds left at the run's average rate; NaN (printed `?`) before eta_after_units are done."""
        if done_units < self.eta_after_units:
            return float("nan")
        rate = done_units / max(self.elapsed(), 1e-9)
        return (self.total_units - done_units) / rate if rate > 0 else float("inf")

    def report(
        self, record: dict, line: str, force: bool = False, *, done_units: int | None = None, postfix: str = ""
    ) -> None:
        """done_units moves the bar; postfix is the bar's figures (the line's, without the counts)."""
        if self._bar is not None and done_units is not None:
            self._bar.update(done_units - self._bar.n)
            if postfix:
                self._bar.set_postfix_str(postfix, refresh=False)
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        if self._bar is None:
            self.logger.info(line)
        else:
            self._bar.refresh()
        if self._file is not None:
            self._file.write(json.dumps({"time": time.time(), "elapsed_s": round(self.elapsed(), 3), **record}) + "\n")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None
