"""SIGTERM as a flag: what schedulers send before pre-emption becomes a request to stop cleanly (training
also takes SIGINT, Ctrl-C, so).

Both stages use it (extraction between batches, training at step boundaries); the handler only sets
`signalled`, the caller decides where stopping is safe. Only the main thread may install handlers;
elsewhere the context manager does nothing.
"""

from __future__ import annotations

import signal
import threading


class SigtermFlag:
    """`with SigtermFlag() as stop:` ... `if stop.signalled:` at a safe point. `signals`: the signals
    that set the flag (default SIGTERM alone; training adds SIGINT)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
        self.signalled = False
        self._signals = signals
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum, frame) -> None:
        self.signalled = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self._signals}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}
