"""SIGTERM as a flag: what schedulers send before pre-emption becomes a request to stop cleanly.

Both stages use it (extraction between batches, training at step boundaries); the handler only sets
`signalled`, the caller decides where stopping is safe. Only the main thread may install handlers;
elsewhere the context manager does nothing.
"""

from __future__ import annotations

import signal
import threading


class SigtermFlag:
    """`with SigtermFlag() as stop:` ... `if stop.signalled:` at a safe point."""

    def __init__(self) -> None:
        self.signalled = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.signalled = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
