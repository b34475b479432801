"""Training metrics: device-side totals written by the step, and the one object that logs them.

Loss is not metrics (SPEC, STYLE 7-8):
- `StepTotals` lives on the device. Every step adds its loss terms, gradient norm and label count;
  every metrics_every-th step (its own cadence, decided on the host from the step number) also adds
  the monitoring metrics as (sum, count) pairs. Non-finite inputs or loss are recorded as the first
  offending (step, batch id). Nothing here syncs with the host.
- `MetricsLogger` decides when to log, and at a log step packs all totals into one flat tensor,
  SUM-all-reduces it once, copies it to the host once (the interval's only sync), divides sums by
  counts and emits one dict with namespaced keys to metrics.jsonl, one console line on rank 0 and,
  optionally, TensorBoard.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import IO, Any

import torch

from shards.common.errors import UserError
from shards.common.owned import Dir
from shards.common.owned.dirfd import random_suffix
from shards.common.progress import format_duration, format_figure
from train.distributed import all_reduce_sum_
from train.metrics import METRICS_FILE
from train.metrics.block_metrics import metric_sizes
from train.metrics.sums import COUNT, HostSums, Sums

log = logging.getLogger(__name__)

# (name in train.metrics.block_metrics.block_metrics, key prefix in the log)
_SLOT_METRICS = (("top1_slot", "acc/slot_"), ("topk_slot", "acc/top{k}_slot_"), ("ce_slot", "ce/slot_"))
_BLOCK_METRICS = (
    ("accept_streak", "accept/streak"),
    ("topk_streak", "accept/top{k}_streak"),
    ("expected_accept", "accept/expected"),
    # DFlash 2 only (no count otherwise, so no key): the selector loss (every step) and its metrics.
    ("selector_loss", "loss/selector"),
    ("selector_recall", "selector/recall_at_k"),
    ("selector_accuracy", "selector/tf_accuracy"),
    ("selector_accept", "selector/path_accept"),
)
# Summed once per step and logged as the mean over the interval's steps (sum / "steps"), under these keys.
_PER_STEP = (
    "loss/total",
    "loss/ce",
    "loss/kl",
    "loss/cap",
    "opt/grad_norm",
    "data/labels_per_step",
    "data/blocks_per_step",
)
_BAD = ("loss_step", "loss_batch", "input_step", "input_batch")  # first_bad's slots


class NonFiniteError(UserError, RuntimeError):
    """A batch produced non-finite hidden states or loss; the message names the step and batch id."""


class StepTotals:
    """Device accumulators of one log interval: named sums (train/metrics/sums.py) plus the first bad step.

    sums: "steps" and the _PER_STEP fields (one add per step); per monitoring metric of
    block_metrics.block_metrics its (sum, count) pair (one add per metrics step); "nonfinite_ranks"
    (how many ranks saw each kind of bad step, filled at log time so it rides the same all-reduce).
    """

    def __init__(self, block_size: int, device: torch.device):
        sizes = {"steps": 1, **{key: 1 for key in _PER_STEP}}
        for name, size in metric_sizes(block_size).items():
            sizes[name], sizes[name + COUNT] = size, size
        sizes["nonfinite_ranks"] = len(_BAD)
        self.sums = Sums(sizes, device)
        # First offending (step, batch id) for non-finite loss and for non-finite inputs; -1 = none.
        # Rank-local and never summed: each rank names what it saw itself.
        self.first_bad = torch.full((len(_BAD),), -1, dtype=torch.int64, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.sums.flat, self.first_bad]

    def add_step(
        self,
        loss_parts,
        grad_norm: torch.Tensor,
        label_valid_NB: torch.Tensor,
        block_valid_N: torch.Tensor,
        step_t: torch.Tensor,
        batch_id: torch.Tensor,
        inputs_finite: torch.Tensor,
    ) -> None:
        total, ce, kl, cap = (p.detach() for p in loss_parts)
        for key, value in zip(_PER_STEP, (total, ce, kl, cap, grad_norm, label_valid_NB.sum(), block_valid_N.sum())):
            self.sums.add(key, value)
        self.sums.add("steps", 1.0)
        loss_finite = torch.isfinite(torch.stack([total, ce, kl, cap])).all() & torch.isfinite(grad_norm)
        here = torch.cat([step_t.view(1).long(), batch_id.view(1)])
        self._first(slice(0, 2), loss_finite, here)
        self._first(slice(2, 4), inputs_finite, here)

    def _first(self, sl: slice, ok: torch.Tensor, here: torch.Tensor) -> None:
        unset = self.first_bad[sl][0] < 0
        self.first_bad[sl] = torch.where(unset & ~ok, here, self.first_bad[sl])

    def add_metrics(self, counted: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for name, (value, count) in counted.items():
            self.sums.add(name, value)
            self.sums.add(name + COUNT, count)

    def reduce_to_host(self) -> HostSums:
        """The interval's one all-reduce and host sync; resets the sums. HostSums.local = first_bad."""
        self.sums.add("nonfinite_ranks", self.first_bad >= 0)  # summed across ranks: any rank bad
        host = self.sums.reduce_to_host(local=self.first_bad)
        self.sums.reset()
        return host


class MetricsLogger:
    """Cadence, counters, the one all-reduce + host sync per log, and the outputs (rank 0 writes)."""

    def __init__(
        self,
        *,
        out_dir: str | Path,
        total_steps: int,
        log_every: int,
        metrics_every: int,
        metrics_topk: int,
        is_main: bool,
        device: torch.device,
        tensorboard: bool = False,
        start_step: int = 0,
        loss_terms: tuple[str, ...] = (),
        flops_per_step: int | None = None,
        peak_flops: float | None = None,
    ):
        """loss_terms: the optional loss terms that are on ("kl", "cap"), printed in the console line.
        flops_per_step / peak_flops: for perf/mfu (train/metrics/flops.py); no MFU when either is None."""
        self.total_steps, self.log_every, self.metrics_every = total_steps, log_every, metrics_every
        self.topk, self.is_main, self.device = metrics_topk, is_main, device
        self.tokens_seen = 0  # real tokens of all steps so far, every rank's (summed at each log)
        self.skipped_shards = 0
        self._interval_tokens = 0
        self._interval_wait_s = 0.0
        self._interval_start = time.monotonic()
        self._run_start = time.monotonic()
        self.eval_s = 0.0  # seconds in held-out evaluations (add_eval_time), shown apart from the rates
        self._start_step = start_step
        self._last_log_step = start_step
        self.loss_terms = tuple(loss_terms)
        self.flops_per_step, self.peak_flops = flops_per_step, peak_flops
        self._pending_eval: dict[str, Any] | None = None  # an evaluation since the last console line
        self._file: IO[str] | None = None
        self._tb = None
        self._tb_dir: Dir | None = None  # tb/'s descriptor, which the writer's path goes through
        self._tb_used = False  # a writer existed (it is None again after close)
        if is_main:
            with Dir.open(out_dir, create=True) as run_dir:
                self._file = run_dir.open_append(METRICS_FILE)  # a link or FIFO there is refused
                if tensorboard:
                    self._tb, self._tb_dir = _tensorboard_writer(run_dir)

    # ---- cadence: host-side decisions from the step number alone -------------------------------
    def should_compute_metrics(self, step: int) -> bool:
        """Metrics on step 1, 1 + metrics_every, ... (1-based step numbers; their own counter)."""
        return (step - 1) % self.metrics_every == 0

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_every == 0 or step == self.total_steps

    # ---- host counters -------------------------------------------------------------------------
    def add_eval_time(self, seconds: float) -> None:
        """Time spent in a held-out evaluation is not training: it stays out of the interval's tokens/s,
        data-wait share and MFU and out of the ETA's time per step (before, the evaluation before step 1
        read as "4 tok/s ... ETA 27h", and each later one made the ETA jump), and is reported apart
        (perf/eval_s: every evaluation of this invocation so far)."""
        self._interval_start += seconds
        self._run_start += seconds
        self.eval_s += seconds

    def add_data_wait(self, seconds: float) -> None:
        self._interval_wait_s += seconds

    def add_tokens(self, num_tokens: int) -> None:
        """This rank's real tokens of a step (host count from the shard header)."""
        self._interval_tokens += num_tokens

    # ---- the log -------------------------------------------------------------------------------
    def log(self, step: int, epoch: int, totals: StepTotals, lr: float) -> dict:
        """Reduce, check, divide and emit. Raises NonFiniteError when a step since the last log was bad."""
        host = totals.reduce_to_host()
        _raise_if_bad(host, step)
        # Every rank logs at the same steps, so this small all-reduce pairs up like the one above.
        self.tokens_seen += int(all_reduce_sum_(torch.tensor([self._interval_tokens], device=self.device)).item())
        record = self._record(step, epoch, host, lr)
        self._emit(record)
        return record

    def _record(self, step: int, epoch: int, host: HostSums, lr: float) -> dict:
        now = time.monotonic()
        interval_s = max(now - self._interval_start, 1e-9)
        steps = max(host.scalar("steps"), 1.0)
        per_step = {key: host.scalar(key) / steps for key in _PER_STEP}
        tokens_per_s = self._interval_tokens / interval_s
        done = step - self._start_step
        eta_s = (now - self._run_start) / max(done, 1) * (self.total_steps - step)
        record: dict[str, Any] = {
            "step": step,
            "epoch": epoch,
            **per_step,
            "opt/lr": lr,
            "data/tokens_seen": self.tokens_seen,
            "data/skipped_shards": self.skipped_shards,
            "perf/tokens_per_s": tokens_per_s,  # this rank's real (context) tokens per second
            "perf/data_wait_frac": self._interval_wait_s / interval_s,  # share of the interval spent waiting on shards
            "perf/eta_s": eta_s,  # the remaining steps at the average step time; evaluations not included
            "perf/eval_s": self.eval_s,
        }
        record.update(self._monitoring(host))
        if self.device.type == "cuda":
            record["mem/peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if self.flops_per_step and self.peak_flops:
            # This rank's steps in the interval (host count: the summed "steps" counts every rank's).
            record["perf/mfu"] = self.flops_per_step * (step - self._last_log_step) / interval_s / self.peak_flops
        self._last_log_step = step
        self._interval_tokens, self._interval_wait_s, self._interval_start = 0, 0.0, now
        return record

    def _monitoring(self, host: HostSums) -> dict:
        """Per-slot and per-block metrics of the interval's metrics steps (none when there were none)."""
        out = {}
        for name, prefix in _SLOT_METRICS:
            prefix = prefix.format(k=self.topk)
            for k, value in enumerate(host.mean(name), start=1):
                if value is not None:
                    out[f"{prefix}{k:02d}"] = value
        for name, key in _BLOCK_METRICS:
            (value,) = host.mean(name)
            if value is not None:
                out[key.format(k=self.topk)] = value
        return out

    def _emit(self, record: dict) -> None:
        if not self.is_main:
            return
        self._file.write(json.dumps({"time": time.time(), **record}) + "\n")
        log.info(self.console_line(record))
        self._pending_eval = None
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, record["step"])

    def console_line(self, record: dict) -> str:
        """One line of a step record: the loss terms that are on, optimiser, speed, data wait, MFU,
        ETA, monitoring metrics when computed, memory, and the figures of an evaluation since the last line."""
        terms = " ".join(f"{t} {record[f'loss/{t}']:.4f}" for t in ("ce", *self.loss_terms) if f"loss/{t}" in record)
        line = (
            f"step {record['step']}/{self.total_steps} ep {record['epoch']} | loss {record['loss/total']:.4f} {terms} "
            f"| lr {record['opt/lr']:.2e} gnorm {record['opt/grad_norm']:.3f} "
            f"| {record['perf/tokens_per_s']:,.0f} tok/s, data wait {100 * record['perf/data_wait_frac']:.0f}%"
        )
        if "perf/mfu" in record:
            line += f", MFU {100 * record['perf/mfu']:.1f}%"
        line += f" | ETA {format_duration(record['perf/eta_s'])}"
        if record.get("perf/eval_s"):
            line += f" (steps; evaluations took {format_duration(record['perf/eval_s'])} so far)"
        if "accept/streak" in record:
            line += f" | acc1 {record.get('acc/slot_01', float('nan')):.3f} streak {record['accept/streak']:.2f}"
        if "loss/selector" in record:
            line += f" | selector {record['loss/selector']:.4f}"
        if "selector/path_accept" in record:
            line += f" recall {record['selector/recall_at_k']:.3f} path {record['selector/path_accept']:.2f}"
        if "mem/peak_gib" in record:
            line += f" | {record['mem/peak_gib']:.1f} GiB"
        if self._pending_eval is not None:
            line += " | " + eval_figures(self._pending_eval)
        return line

    def write_event(self, record: dict) -> None:
        """A non-step record (eval results, skipped shards) into metrics.jsonl; eval scalars also to TensorBoard
        and into the next console line."""
        if not (self.is_main and self._file is not None):
            return
        self._file.write(json.dumps({"time": time.time(), **record}) + "\n")
        if record.get("event") == "eval":
            self._pending_eval = record
            if self._tb is not None:
                for key, value in record.items():
                    if key.startswith("eval/") and isinstance(value, (int, float)) and not isinstance(value, bool):
                        self._tb.add_scalar(key, value, record["step"])

    @property
    def has_tensorboard(self) -> bool:
        return self._tb is not None or self._tb_used

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb, self._tb_used = None, True
        if self._tb_dir is not None:
            self._tb_dir.close()
            self._tb_dir = None


def _raise_if_bad(host: HostSums, step: int) -> None:
    if not any(host["nonfinite_ranks"]):
        return
    loss_step, loss_batch, input_step, input_batch = (int(x) for x in host.local)
    if input_step >= 0:
        raise NonFiniteError(
            f"batch {input_batch} holds non-finite hidden states (first used at step "
            f"{input_step + 1}); the run stopped: check or re-extract that shard"
        )
    if loss_step >= 0:
        raise NonFiniteError(
            f"non-finite loss or gradient at step {loss_step + 1} on batch {loss_batch}; "
            "the run stopped (lower lr, check that batch, or resume from the last checkpoint)"
        )
    raise NonFiniteError(f"another rank met a non-finite loss or batch before step {step}; see its log")


def _tensorboard_writer(run_dir: Dir):
    """(SummaryWriter, tb/ held open) for run_dir/tb, or (None, None) without tensorboard. The writer
    opens its events file by path: through tb/'s descriptor (a link planted as tb/ is refused), under
    a name with a random suffix, so no link can be planted where it writes."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("--tensorboard: the tensorboard package is not installed; writing metrics.jsonl only")
        return None, None
    tb = run_dir.child("tb", create=True)
    return SummaryWriter(tb.pinned_path(""), filename_suffix=f".{random_suffix()}"), tb


def eval_figures(record: dict) -> str:
    """`held-out @ step 6: accept len 1.234, loss 2.3456`: the decoding-walk acceptance length and the
    held-out loss of an eval record, in words; every other figure of it is in metrics.jsonl."""
    figures = [
        f"{name} {format_figure(record[key], spec)}"
        for name, key, spec in (("accept len", "eval/acceptance_length", ".3f"), ("loss", "eval/heldout_loss", ".4f"))
        if key in record
    ]
    return f"held-out @ step {record['step']}: {', '.join(figures)}"
