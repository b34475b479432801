"""The GPU never waits for the disk: device-to-host copies into pinned buffers, a writer thread.

The forward of batch i+1 runs while the thread writes batch i, and on CUDA the finite check, the
storage encoding and the copies of batch i to the host run on a stream of their own (copy_stream),
beside that forward instead of before it (for a 49152-token batch of an fp8 cache: ~50 GB of eager
passes and 1.26 GB at 54 GB/s, ~40 ms). Buffers cycle through a free queue;
when the disk is slower than the GPU the queue runs dry and the loop waits (backpressure), which the
run reports as `wait_s`. The thread only syncs on a CUDA event and writes files; it launches nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shards import (
    CacheConfig,
    SampleEntry,
    allocate_shard_buffers,
    encode_codes,
    encode_hidden,
    shard_path,
    write_shard,
)
from shards.common.diskfull import DiskFullError, refusing_when_full
from shards.common.errors import UserError
from shards.format import bytes_per_shard
from shards.projection import applied_matrix, codes_of, load_projection

log = logging.getLogger(__name__)


class NonFiniteHiddenError(UserError, RuntimeError):
    """The target produced NaN or Inf for a batch; the run stops and names it."""


@dataclass
class _Job:
    batch_id: int
    buffers: dict[str, torch.Tensor]
    num_tokens: int
    samples: list[SampleEntry]
    finite: torch.Tensor  # host bool scalar, valid after `ready`
    ready: torch.cuda.Event | None


class AsyncShardWriter:
    def __init__(
        self,
        cache_dir: str | Path,
        cfg: CacheConfig,
        device: torch.device,
        num_buffers: int = 2,
        copy_stream: bool = True,
    ):
        """copy_stream: on CUDA, check, encode and copy to the host on a side stream (False: on the
        forward's stream, which then waits for them; kept so tools/bench/extract.py can time both)."""
        self.cache_dir = Path(cache_dir)
        self.cfg = cfg
        self.device = device
        pin = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if pin and copy_stream else None
        self._free: queue.Queue = queue.Queue()
        for _ in range(num_buffers):
            self._free.put(allocate_shard_buffers(cfg, pin_memory=pin))
        self._jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.bytes_written = 0
        self.shards_written = 0
        self.wait_s = 0.0  # time the forward loop waited for a free buffer (the disk being slower)
        self.shard_bytes = bytes_per_shard(cfg)  # what a full disk's message says one shard needs
        # A projected cache: A = P D on the device, cast to the taps' dtype at the first batch.
        self._applied_RF = applied_matrix(*load_projection(cache_dir, cfg)).to(device) if cfg.projection else None
        self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self._thread.start()

    def submit(
        self,
        batch_id: int,
        arrays: dict[str, np.ndarray],
        hidden_nKH: torch.Tensor,
        topk: tuple[torch.Tensor, torch.Tensor] | None,
        samples: list[SampleEntry],
    ) -> None:
        """Queue one batch: `hidden_nKH` holds the real tokens only (n <= token_budget), on the device."""
        self.raise_if_failed()
        n = hidden_nKH.shape[0]
        side = self._copy_stream
        produced = [hidden_nKH, *(topk or ())]  # made by the forward, on its stream
        if side is not None:
            # The side stream starts after the kernels that produced them; record_stream keeps the
            # caching allocator from handing their memory to the next forward before the side stream
            # is done with them. The check, the encoding and the copies then run beside that forward.
            side.wait_stream(torch.cuda.current_stream(self.device))
            for t in produced:
                t.record_stream(side)
        with torch.cuda.stream(side):  # None (CPU, or copy_stream=False): the current stream
            finite = torch.isfinite(hidden_nKH).all()
            encoded = self._encode(hidden_nKH)
            t0 = time.monotonic()
            buffers = self._free.get()
            self.wait_s += time.monotonic() - t0
            self.raise_if_failed()
            non_blocking = self.device.type == "cuda"
            for name, t in encoded.items():
                buffers[name][:n].copy_(t, non_blocking=non_blocking)
            if topk is not None:
                buffers["target_topk_ids"][:n].copy_(topk[0], non_blocking=non_blocking)
                buffers["target_topk_logprobs"][:n].copy_(topk[1], non_blocking=non_blocking)
            finite_host = torch.empty((), dtype=torch.bool, pin_memory=non_blocking)
            finite_host.copy_(finite, non_blocking=non_blocking)
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()  # on the stream the copies went to
        for name in ("input_ids", "position_ids", "loss_mask", "anchor_mask", "cu_seqlens"):
            if name in buffers:  # anchor_mask: version 3 caches
                buffers[name].copy_(torch.from_numpy(arrays[name]))
        self._jobs.put(_Job(batch_id, buffers, n, samples, finite_host, ready))

    def _encode(self, hidden_nKH: torch.Tensor) -> dict[str, torch.Tensor]:
        """The storage encoding of one batch's taps: themselves, or (a projected cache) their codes, one
        GEMM on the device before the copy to the host (which the codes shrink by K*H / R)."""
        if self._applied_RF is None:
            return encode_hidden(hidden_nKH, self.cfg.storage_dtype)
        if self._applied_RF.dtype != hidden_nKH.dtype:
            self._applied_RF = self._applied_RF.to(hidden_nKH.dtype)
        codes_nR = codes_of(hidden_nKH, self._applied_RF)
        return encode_codes(codes_nR, self.cfg.storage_dtype, self.cfg.projection.group_size)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._write(job)
            except BaseException as e:  # surfaced to the forward loop by raise_if_failed
                self.error = e
                self._free.put(job.buffers)
                return
            self._free.put(job.buffers)

    def _write(self, job: _Job) -> None:
        if job.ready is not None:
            job.ready.synchronize()
        if not bool(job.finite):
            ids = [s.sample_id for s in job.samples]
            raise NonFiniteHiddenError(
                f"batch {job.batch_id}: the target produced NaN/Inf hidden states for samples {ids}; "
                "check the checkpoint and dtype (no shard was written for this batch)"
            )
        n = job.num_tokens
        for name in ("hidden", "hidden_scale", "codes", "code_scale", "target_topk_ids", "target_topk_logprobs"):
            if name in job.buffers:
                job.buffers[name][n:].zero_()  # padding rows: zeros, not a previous batch's data
        target = shard_path(self.cache_dir, job.batch_id)
        kept = f"batch {job.batch_id} was not written, the shards before it are kept"
        try:
            with refusing_when_full(
                target, f"{kept}: free space and re-run the same command to resume", self.shard_bytes
            ):
                path = write_shard(self.cache_dir, self.cfg, job.batch_id, job.buffers, job.samples)
        except DiskFullError:
            raise
        except OSError as e:
            raise OSError(
                e.errno,
                f"batch {job.batch_id}: writing {target} failed: {e.strerror or e}; "
                "free space and re-run the same command to resume",
            ) from e
        self.bytes_written += path.stat().st_size
        self.shards_written += 1

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def close_quietly(self) -> None:
        """Stop after what is queued without raising: the caller is already handling an error."""
        self._jobs.put(None)
        self._thread.join()

    def close(self) -> None:
        """Write everything queued, stop the thread, raise its error if it had one."""
        self._jobs.put(None)
        self._thread.join()
        self.raise_if_failed()
