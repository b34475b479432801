"""Pre-emption: SIGTERM (what schedulers send before they kill a job) and SIGINT (Ctrl-C) become a
clean stop. A second Ctrl-C raises KeyboardInterrupt at once (no checkpoint of the step in flight).

The handler only sets a flag. The loop polls it at every step boundary; the run then checkpoints
that step and exits, so at most the step in flight is lost. Under several ranks every rank must stop
after the same step (a rank that stops early hangs the others' all-reduce), so the flags are
MAX-all-reduced each step on the device, and the result is read one step later: no host sync in the
step, and all ranks decide on the same reduced value.

Under torchrun the first rank to exit non-zero makes the agent SIGTERM the others: a rank still
writing the checkpoint or its last record would die half way. So once the ranks have agreed and
rank 0's files are written, `stop_together` ignores any further SIGTERM (the stop is under way) and
makes the ranks meet once more: none exits before every rank is done, and each exits with 143.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from shards.common.runtime import barrier
from shards.common.sigterm import SigtermFlag


class StopOnSigterm(SigtermFlag):
    """`with StopOnSigterm(device, world_size) as stop:` ... `if stop.poll(): break` at step boundaries.
    SIGINT is handled as SIGTERM is; `signal_name` says which one this rank received first."""

    def __init__(self, device: torch.device, world_size: int):
        super().__init__((signal.SIGTERM, signal.SIGINT))  # self.signalled: this rank received one
        self.signal_name: str | None = None
        self._collective = world_size > 1 and dist.is_initialized()
        if self._collective:
            cuda = device.type == "cuda"
            self._flag = torch.zeros(1, dtype=torch.int32, device=device)
            self._host = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
            self._event = torch.cuda.Event() if cuda else None
            self._pending = False

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signal_name == "SIGINT":
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without the checkpoint
        super()._handle(signum, frame)
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def poll(self) -> bool:
        """True when every rank should stop after the step that just finished."""
        if not self._collective:
            return self.signalled
        decided = False
        if self._pending:  # the previous step's reduction: every rank reads the same value
            if self._event is not None:
                self._event.synchronize()
            decided = bool(self._host.item())
        self._flag.fill_(int(self.signalled))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        self._host.copy_(self._flag, non_blocking=self._event is not None)
        if self._event is not None:
            self._event.record()
        self._pending = True
        return decided


def stop_together(world_size: int) -> None:
    """After an agreed SIGTERM stop (checkpoint and events written): under several ranks, ignore
    torchrun's SIGTERM from here to exit and wait until every rank got here. One process: nothing."""
    if world_size > 1 and dist.is_initialized():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        barrier()
