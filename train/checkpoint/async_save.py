"""Checkpoints off the critical path: the loop snapshots the state between steps, a thread writes it.

`CheckpointWriter.save(step, model_state, optimizer_state, train_state)` (rank 0; other ranks hold
an inactive writer) in mode "async":
  1. waits for the previous save's writer thread: never two saves at once (they share the host
     buffers and the directory's retention); its error is raised here, in the loop;
  2. snapshots: copies every tensor of the model and optimizer state into host buffers allocated
     once per run and reused (the state's exact bytes: 12 bytes per parameter for fp32 weights and
     AdamW's two moments, 20.8 GB for the 1.73B-parameter 27B drafter); on CUDA the buffers are
     page-locked (cudaHostRegister, exactly sized: torch's pinned allocator rounds each tensor up to
     a power of two, +50% here), so the copies run at PCIe DMA speed and one synchronize ends them;
  3. starts a thread running train.checkpoint.store.save_checkpoint on the snapshot: the same temporary
     folder, fsync, rename, directory fsync and checksums as a synchronous save; older checkpoints
     are pruned only after the new one is durable.
The loop is blocked for 1 + 2 (and the RNG states and provenance it gathers first): recorded per save
as a "checkpoint" event in metrics.jsonl (stall_s in all, of which snapshot_s copying and wait_s
waiting for the previous write). poll() (every step) and wait() (end of training, SIGTERM) report a
finished write (one console line with the stall, and a "checkpoint_durable" event: background write
time, bytes) or raise a failed one (CheckpointError naming the file, DiskFullError for a full disk).
A kill mid-write leaves only .tmp-step-* (ignored by readers, removed at the next start): the previous
checkpoint stays the newest valid one. Mode "sync" writes in the calling thread (stall = the whole
write), no buffers.

Disk space: a checkpoint is the state's tensor bytes (checkpoint_bytes, known at start-up). The start
says how many fit under OUT, and warns when the next one does not; a save with less free space than that
is refused before it writes anything, and a write that fills the disk anyway (another writer, a quota) is
refused as it fails; both as DiskFullError, one line naming the checkpoint, the sizes and the --resume to
run once space is freed. The previous checkpoint stays intact either way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from shards.common.diskfull import free_bytes, refuse_short_space, refusing_when_full
from shards.common.progress import format_bytes
from train.checkpoint.store import Retention, checkpoint_name, save_checkpoint

log = logging.getLogger(__name__)

CheckpointMode = Literal["async", "sync"]
# Tensors from this size up are page-locked with cudaHostRegister on their own allocation (glibc mmaps
# anything above 32 MB, so no two registrations share a page); smaller ones come from torch's pinned
# allocator, whose power-of-two rounding costs little on them.
_REGISTER_MIN_BYTES = 64 << 20


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3g} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3g} MB"


def state_nbytes(state: Any) -> int:
    """Bytes of the tensors in nested state (dicts, lists, tuples), each tensor once: what a checkpoint
    of it writes, file headers aside (12 bytes a parameter for fp32 weights and AdamW's two moments)."""
    seen: dict[int, int] = {}
    pending = [state]
    while pending:
        obj = pending.pop()
        if isinstance(obj, torch.Tensor):
            seen[id(obj)] = obj.nbytes
        elif isinstance(obj, dict):
            pending.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            pending.extend(obj)
    return sum(seen.values())


class HostSnapshot:
    """Host copies of nested state (dicts, lists, tuples of tensors and plain values), one reused buffer
    per tensor position; `pin` (CUDA) page-locks them so device-to-host copies are asynchronous DMA."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.nbytes = 0  # bytes of all buffers
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._registered: list[torch.Tensor] = []  # cudaHostRegister'ed: unregistered by close()

    def capture(self, state: Any) -> Any:
        """A copy of `state` whose tensors live in this snapshot's buffers (valid until the next capture)."""
        seen: dict[int, torch.Tensor] = {}  # one tensor at two places (a shared lr) stays one tensor
        out = self._copy(state, (), seen)
        if self.pin:
            torch.cuda.synchronize()  # the non-blocking copies have landed
        return out

    def _copy(self, obj: Any, path: tuple, seen: dict[int, torch.Tensor]) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:
                buf = self._buffer(path, obj)
                buf.copy_(obj.detach(), non_blocking=self.pin)
                seen[id(obj)] = buf
            return seen[id(obj)]
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k), seen) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, (*path, i), seen) for i, v in enumerate(obj))
        return obj  # numbers, strings, None: immutable

    def _buffer(self, path: tuple, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._allocate(t)
            self._buffers[path] = buf
            self.nbytes += buf.nbytes
        return buf

    def _allocate(self, t: torch.Tensor) -> torch.Tensor:
        if not self.pin:
            return torch.empty(t.shape, dtype=t.dtype)
        if t.nbytes >= _REGISTER_MIN_BYTES:
            buf = torch.empty(t.shape, dtype=t.dtype)
            try:
                failed = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.nbytes, 0))
            except (AttributeError, RuntimeError) as e:  # a torch build without the cudart binding
                failed = str(e)
            if not failed:
                self._registered.append(buf)
                return buf
            log.warning(
                "cudaHostRegister of %s failed (%s): torch's pinned allocator instead (rounds up to a power of two)",
                _gb(t.nbytes),
                failed,
            )
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)

    def close(self) -> None:
        for buf in self._registered:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        self._registered.clear()
        self._buffers.clear()
        self.nbytes = 0


class CheckpointWriter:
    """Starts every training checkpoint; see the module docstring. Not thread-safe: the loop's thread only."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        keep: int,
        mode: CheckpointMode,
        device: torch.device,
        write_event: Callable[[dict], None] = lambda record: None,
        active: bool = True,
        resumed_step: int | None = None,
    ):
        """write_event: receives the "checkpoint" / "checkpoint_durable" records (MetricsLogger.write_event).
        active=False (ranks other than 0): save, poll and wait do nothing. resumed_step: the checkpoint
        this run resumed from (verified), never pruned by it (checkpoint.Retention)."""
        if mode not in ("async", "sync"):
            raise ValueError(f"checkpoint mode must be async or sync, got {mode!r}")
        self.out_dir, self.keep, self.mode, self.active = Path(out_dir), keep, mode, active
        protected = set() if resumed_step is None else {resumed_step}
        self.retention = Retention(keep=keep, protected=protected, verified=set(protected))
        self.write_event = write_event
        self.snapshot = HostSnapshot(pin=device.type == "cuda") if mode == "async" and active else None
        self._thread: threading.Thread | None = None
        self._job: dict[str, Any] = {}  # the save in flight: step, start time, then path or error
        self.checkpoint_bytes: int | None = None  # one checkpoint's tensor bytes (allocate, else the first save)

    def allocate(self, model_state: dict[str, torch.Tensor], optimizer_state: dict) -> None:
        """At start-up: size a checkpoint and say whether the next one fits under OUT, then allocate the
        host buffers now rather than inside the first save's stall."""
        if not self.active:
            return
        self.checkpoint_bytes = state_nbytes((model_state, optimizer_state))
        self._announce_space()
        if self.snapshot is None:
            return
        started = time.monotonic()
        self.snapshot.capture((model_state, optimizer_state))
        log.info(
            "checkpoints: written in the background from %s of %s host buffers (allocated in %.1f s, kept for "
            "the run; --checkpoint-write sync writes from the loop instead)",
            _gb(self.snapshot.nbytes),
            "page-locked" if self.snapshot.pin else "ordinary",
            time.monotonic() - started,
        )

    def _announce_space(self) -> None:
        free, needed = free_bytes(self.out_dir), self.checkpoint_bytes
        if free is None or not needed:
            return
        if free < needed:
            log.warning(
                "checkpoints: the next checkpoint needs %s under %s, and %s is free there: free space before it "
                "is due, or training stops at it (nothing lost: --resume continues from the last checkpoint)",
                format_bytes(needed),
                self.out_dir,
                format_bytes(free),
            )
        else:
            log.info(
                "checkpoints: %s each under %s, %s free there (room for %d)",
                format_bytes(needed),
                self.out_dir,
                format_bytes(free),
                free // needed,
            )

    def _then(self, step: int) -> str:
        return (
            f"checkpoint {checkpoint_name(step)} was not kept, the checkpoints written before it are intact: free "
            f"space under {self.out_dir} (older step-* folders can go) and re-run with --resume to continue"
        )

    def save(
        self,
        step: int,
        model_state: dict[str, torch.Tensor],
        optimizer_state: dict,
        train_state: dict[str, Any],
        *,
        blocked_since: float | None = None,
    ) -> dict[str, Any]:
        """Checkpoint `step`; returns (and writes as an event) the stall record. blocked_since: when the
        loop stopped stepping for this save (time.monotonic(); default now), counted into stall_s."""
        if not self.active:
            return {}
        blocked_since = time.monotonic() if blocked_since is None else blocked_since
        previous = self._job.get("step")
        wait_start = time.monotonic()
        self.wait()
        waited = time.monotonic()
        record: dict[str, Any] = {"event": "checkpoint", "step": step, "checkpoint/mode": self.mode}
        if self.checkpoint_bytes is None:
            self.checkpoint_bytes = state_nbytes((model_state, optimizer_state))
        # After the previous write: what it took is taken. Nothing started, so nothing to clean up.
        refuse_short_space(self.out_dir, self.checkpoint_bytes, self._then(step))
        if self.snapshot is None:
            self._job = {"step": step, "started": waited}
            self._write(model_state, optimizer_state, train_state)
            record["checkpoint/stall_s"] = self._job["stall_s"] = time.monotonic() - blocked_since
            self._report_done()
            self.write_event(record)
            return record
        model_host, optimizer_host = self.snapshot.capture((model_state, optimizer_state))
        done = time.monotonic()
        # What the durable line reports: the stall, and what it waited for.
        self._job = {
            "step": step,
            "started": done,
            "stall_s": done - blocked_since,
            "wait_s": waited - wait_start,
            "previous": previous,
        }
        self._thread = threading.Thread(
            target=self._write,
            args=(model_host, optimizer_host, train_state),
            name=f"checkpoint-writer-{step}",
        )
        self._thread.start()
        record |= {
            "checkpoint/stall_s": done - blocked_since,
            "checkpoint/snapshot_s": done - waited,
            "checkpoint/wait_s": waited - wait_start,
        }
        self.write_event(record)
        return record

    def _write(self, model_state: dict[str, torch.Tensor], optimizer_state: dict, train_state: dict) -> None:
        # The writer thread's body (or the loop's, in sync mode): every outcome lands in self._job.
        step = self._job["step"]
        try:
            with refusing_when_full(self.out_dir / checkpoint_name(step), self._then(step), self.checkpoint_bytes):
                path = save_checkpoint(self.out_dir, step, model_state, optimizer_state, train_state, self.retention)
            self._job["bytes"] = sum(f.stat().st_size for f in path.iterdir())
            self._job["path"] = path
        except BaseException as e:  # re-raised in the loop's thread by _report_done
            self._job["error"] = e
        self._job["write_s"] = time.monotonic() - self._job["started"]

    @property
    def pending_step(self) -> int | None:
        """The step whose background write is in flight; None when none is."""
        return self._job.get("step") if self._thread is not None else None

    def poll(self) -> None:
        """Between steps: report a write that has finished; raise its error if it failed."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Block until no write is in flight; raise the error of a failed one (CheckpointError names the file,
        DiskFullError the checkpoint)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._report_done()

    def _report_done(self) -> None:
        job = self._job
        if "error" in job:
            raise job.pop("error")
        if "path" not in job:
            return  # already reported
        path = job.pop("path")
        self.write_event(
            {
                "event": "checkpoint_durable",
                "step": job["step"],
                "checkpoint": str(path),
                "checkpoint/write_s": job["write_s"],
                "checkpoint/bytes": job["bytes"],
            }
        )
        # One line per checkpoint, once it is durable: where, how big, and what it cost the loop.
        if self.mode == "async":
            waited = (
                f", {job['wait_s']:.2f} s of it waiting for the step-{job['previous']} write"
                if job.get("previous") is not None
                else ""
            )
            how = (
                f"written in the background in {job['write_s']:.1f} s; training blocked {job['stall_s']:.2f} s{waited}"
            )
        else:
            how = (
                f"written in {job['write_s']:.1f} s, training blocked {job['stall_s']:.2f} s (--checkpoint-write sync)"
            )
        log.info("checkpoint step %d durable: %s (%s, %s)", job["step"], path, _gb(job["bytes"]), how)

    def close(self) -> None:
        """Wait for a write in flight (a run stopping on an error still finishes its checkpoint); log, never
        raise, its failure (an exception is usually propagating already); free the buffers."""
        try:
            self.wait()
        except BaseException as e:
            log.error("checkpoint of step %s failed: %s", self._job.get("step", "?"), e)
        if self.snapshot is not None:
            self.snapshot.close()
