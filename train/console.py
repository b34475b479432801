"""What a training run tells its user: the start-up lines (announce_run, before the first step) and the
final summary (TrainSummary.report, after the last); the step lines are train/metrics/logger.py's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shards.common.progress import format_duration, plural
from train.config import TrainConfig
from train.drafter.model import count_parameters
from train.eval.evaluate import EvalResult
from train.resolve import ResolvedRun

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    steps: int
    tokens_seen: int
    last_record: dict[str, Any] | None
    last_checkpoint: Path | None
    eval: EvalResult | None
    skipped_shards: list[tuple[int, str]]
    eval_before: EvalResult | None = (
        None  # before step 1 (untrained, or --init-from's weights), when a fresh run has held-out shards
    )
    already_complete: bool = False  # --resume found the run finished: nothing was trained
    stopped: bool = False  # SIGTERM or SIGINT: checkpointed at `steps` and stopped early; --resume continues
    stop_signal: str = "SIGTERM"  # which of the two, when stopped
    wall_s: float = 0.0  # the whole run: checks, set-up, steps, checkpoints, evaluations
    out_dir: Path | None = None
    tensorboard_dir: Path | None = None  # OUT/tb when TensorBoard scalars were written
    tokens_this_run: int = 0  # tokens_seen minus what a resumed checkpoint had seen
    start_step: int = 0  # the step this invocation resumed at (0: a fresh run)

    def report(self) -> str:
        """The final summary: what was done, how long it took, how fast, and where every output is."""
        rec = self.last_record or {}
        rate = self.tokens_this_run / self.wall_s if self.wall_s > 0 else 0.0
        loss = f"final loss {rec.get('loss/total', float('nan')):.4f}"
        skipped = plural(len(self.skipped_shards), "shard")
        if self.start_step == 0:
            first = (
                f"done in {format_duration(self.wall_s)}: {plural(self.steps, 'step')}, {self.tokens_seen:,} tokens "
                f"({rate:,.0f} tok/s over the whole run, set-up and evaluations included), {loss}, {skipped} skipped"
            )
        else:  # a resume: each figure says which span it covers
            first = (
                f"done in {format_duration(self.wall_s)} this invocation (resumed at step {self.start_step}): "
                f"{plural(self.steps - self.start_step, 'step')}, {self.tokens_this_run:,} tokens ({rate:,.0f} tok/s, "
                f"set-up and evaluations included), {skipped} skipped; the whole run: {plural(self.steps, 'step')}, "
                f"{self.tokens_seen:,} tokens, {loss}"
            )
        lines = [first]
        out = self.out_dir
        if out is not None:
            where = [
                f"checkpoint {self.last_checkpoint}",
                f"metrics {out / 'metrics.jsonl'}",
                f"run record {out / 'run.json'}",
            ]
            if self.eval is not None:
                where.append(f"evaluation {out / 'eval.json'}")
            if self.tensorboard_dir is not None:
                where.append(f"TensorBoard {self.tensorboard_dir}")
            lines.append("outputs: " + ", ".join(where))
            lines.append(f"plot it: dflash-train plot {out}; export it: dflash-train export {out} DRAFTER_DIR")
        return "\n".join(lines)


def announce_run(
    cfg: TrainConfig,
    run: ResolvedRun,
    *,
    world_size: int,
    device: torch.device,
    backend: str,
    compute_dtype: torch.dtype,
    cuda_graphs: bool,
    flops_per_step: float,
    peak_flops: float | None,
    peak_source: str,
) -> None:
    """The start-up lines (rank 0): the run's shards and steps, the drafter, FLOPs and MFU basis, the
    kernels and elementwise options chosen."""
    log.info(
        "run: %s, %d held out; %s; %s (%d per epoch), warmup %d",
        plural(len(run.train_ids), "train shard"),
        len(run.eval_ids),
        plural(world_size, "rank"),
        plural(run.total_steps, "step"),
        run.steps_per_epoch,
        run.warmup_steps,
    )
    left_out = len(run.train_ids) % world_size
    if left_out:
        log.warning(
            "%d of the %d training shards are left out of each epoch (a different set each epoch, "
            "drawn by the epoch's shuffle): each of the %d ranks must run the same number of steps. "
            "Use a shard count divisible by the rank count to train on every shard every epoch",
            left_out,
            len(run.train_ids),
            world_size,
        )
    log.info(
        "drafter: %s parameters, %d layers, hidden %d, MLP %d, heads %d/%d x %d, block %d, %d blocks per batch",
        f"{count_parameters(run.drafter):,}",
        run.drafter.num_layers,
        run.drafter.hidden_size,
        run.drafter.intermediate_size,
        run.drafter.num_attention_heads,
        run.drafter.num_key_value_heads,
        run.drafter.head_dim,
        run.drafter.block_size,
        run.num_blocks,
    )
    mfu = (
        f"MFU against {peak_flops / 1e12:.0f} TFLOP/s bf16 peak ({peak_source})"
        if peak_flops
        else f"no MFU figure: {peak_source}"
    )
    log.info(
        "FLOPs per step: %.4g (drafter and LM-head matmuls, forward and backward, per rank; attention "
        "not counted, see train/metrics/flops.py); %s",
        flops_per_step,
        mfu,
    )
    if run.drafter.attention_window is not None:
        log.info(
            "drafter layers: %s (sliding: %s, window %d tokens)",
            ",".join("sliding" if s else "full" for s in run.drafter.sliding_layers),
            "causal" if run.drafter.sliding_causal else "block both ways (is_causal false)",
            run.drafter.attention_window,
        )
    log.info(
        "kernels: attention %s, compute %s (fp32 master weights), step %s on %s",
        backend,
        str(compute_dtype).removeprefix("torch."),
        "CUDA graph" if cuda_graphs else "eager",
        device,
    )
    cuda = device.type == "cuda"
    log.info(
        "elementwise: working weight copies %s, fused loss %s, compiled pointwise regions %s",
        "on" if cfg.weight_copies and compute_dtype != torch.float32 else "off",
        ("on (compiled)" if cuda else "on (eager)") if cfg.loss.fused else "off",
        "on" if cfg.pointwise_compiled(device.type) else "off",
    )
