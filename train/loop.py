"""The training loop: owns data, cadence, checkpoints and evaluation; the step owns the math.

run_training(cfg):
  validate the config against the cache (resolve_run: no model, no GPU) -> join the process group
  -> build drafter (fp32 master), frozen target head, static batch, optimizer, schedule
  -> resume from the newest valid checkpoint when asked -> capture the step (CUDA) -> per step:
  next batch (timed) -> copy to the device -> count tokens -> step -> log / eval / checkpoint.

Each step consumes exactly one shard on every rank; train/data.py says how skipped shards keep the
ranks in step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shards import ShardReader, load_target_head
from shards.common.durable import atomic_write_text, check_writable
from shards.common.lock import DirectoryLock
from shards.common.progress import format_duration, plural
from shards.common.provenance import provenance
from shards.common.runtime import DistInfo, all_gather_objects, barrier, rank_info, resolve_device
from shards.ownership import describe
from train.batch import StaticBatch
from train.blocks import anchor_seed
from train.checkpoint.async_save import CheckpointWriter
from train.checkpoint.export import load_drafter_weights_
from train.checkpoint.store import (
    Checkpoint,
    check_resume_compatible,
    checkpoint_folders,
    checkpoint_name,
    decode_rng,
    encode_rng,
    latest_checkpoint,
    load_model_state,
    load_optimizer_state,
)
from train.config import ResolvedRun, TrainConfig, resolve_run, resolved_identity
from train.data import Batch, rank_batches
from train.distributed import FlatGrads, broadcast_parameters, init_distributed
from train.drafter.attention import BlockAttentionLayout, choose_backend
from train.drafter.model import DFlashDrafter, Linear, TargetHead, count_parameters
from train.drafter.pointwise import compile_pointwise_
from train.eval.evaluate import EvalResult, eval_copy, evaluate_drafter
from train.metrics.flops import drafter_step_flops, peak_flops
from train.metrics.logger import MetricsLogger, StepTotals
from train.outputs import write_eval_json
from train.precision import WorkingWeights, autocast_dtype, torch_dtype
from train.preempt import StopOnSigterm, stop_together
from train.rundir import RUN_RECORD_FILE, check_run_dir, clean_stale_temporaries, truncate_metrics
from train.step import StepRunner, StepState, WarmupCosine, load_optimizer_state_, make_optimizer

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    steps: int
    tokens_seen: int
    last_record: dict[str, Any] | None
    last_checkpoint: Path | None
    eval: EvalResult | None
    skipped_shards: list[tuple[int, str]]
    eval_before: EvalResult | None = None  # the untrained drafter, when a fresh run has held-out shards
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


def run_training(cfg: TrainConfig) -> TrainSummary:
    """Train a drafter as configured; returns what happened. Raises ValueError on bad settings/data."""
    start = time.monotonic()
    # Every check that needs no model, GPU or process group comes first.
    run = resolve_run(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    check_run_dir(cfg.out_dir, cfg.cache)
    check_writable(cfg.out_dir, f"--out {cfg.out_dir}")
    device = resolve_device(cfg.device, 0)
    if cfg.attention == "flex" and device.type != "cuda":
        raise ValueError(
            f"--attention flex on {device}: FlexAttention has no backward pass off CUDA, so it cannot train "
            "here; use --attention sdpa (or auto, which picks sdpa on CPU)"
        )
    # Rank 0 holds the run directory's lock for the whole run (its ranks share it); a second run is refused.
    lock = DirectoryLock(cfg.out_dir, "dflash-train")
    try:
        if rank_info().is_main:
            Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
            lock.acquire()
            clean_stale_temporaries(cfg.out_dir)
        newest = latest_checkpoint(cfg.out_dir)
        folders = checkpoint_folders(cfg.out_dir)
        if not cfg.resume and folders:
            raise ValueError(
                f"{cfg.out_dir} already holds checkpoints; pass --resume to continue that run or choose another --out"
            )
        if cfg.resume and newest is None and folders:
            raise ValueError(
                f"--resume: {cfg.out_dir} holds checkpoint folders but none is valid ({describe(folders)}: "
                "damaged or partial, see the warnings above); nothing was changed. Restore a checkpoint, or "
                "start afresh in another --out"
            )
        if cfg.resume and newest is not None and newest.step >= run.total_steps:
            check_resume(newest, cfg, run, int(os.environ.get("WORLD_SIZE", "1")))
            return TrainSummary(
                newest.step, newest.state.get("tokens_seen", 0), None, newest.path, None, [], already_complete=True
            )
        dist_info = init_distributed(device.type)
        device = resolve_device(cfg.device, dist_info.local_rank)
        trainer = Trainer(cfg, run, dist_info, device)
        try:
            summary = trainer.train()
        finally:
            trainer.close()
        summary.wall_s, summary.out_dir = time.monotonic() - start, Path(cfg.out_dir)
        summary.tokens_this_run = summary.tokens_seen - trainer.tokens_at_start
        summary.start_step = trainer.step_at_start
        if trainer.metrics.has_tensorboard:
            summary.tensorboard_dir = Path(cfg.out_dir) / "tb"
        return summary
    finally:
        lock.release()


def check_resume(ckpt: Checkpoint, cfg: TrainConfig, run: ResolvedRun, world_size: int) -> None:
    """Refuse (ValueError naming each flag) to resume `ckpt` under other resolved settings or another cache."""
    identity = resolved_identity(cfg, run)
    recorded = (ckpt.state.get("resolved_identity") or {}).get("init_from")
    if _same_directory(recorded, cfg.init_from):  # written before --init-from was compared by content
        identity["init_from"] = recorded
    check_resume_compatible(
        ckpt,
        identity,
        world_size,
        run.cache_config.target.config_hash,
        cache_identity(run),
        legacy_identity=cfg.identity(),
        drafter=_drafter_dict(run),
    )


def _same_directory(recorded: Any, now: str | None) -> bool:
    """A checkpoint's --init-from recorded as a path (before its content was recorded) names `now`."""
    if not isinstance(recorded, str) or now is None or recorded.startswith("content crc32"):
        return False
    try:
        return recorded == now or os.path.samefile(recorded, now)
    except OSError:
        return False


def cache_identity(run: ResolvedRun) -> dict[str, Any]:
    """What a resumed run must find again in its cache: the same target weights, data and shards."""
    cc = run.cache_config
    return {
        "target_head_checksum": cc.target_head_checksum,
        "dataset_fingerprint": cc.dataset.fingerprint if cc.dataset is not None else None,
        "num_shards": len(run.train_ids) + len(run.eval_ids),
        "cache_id": cc.cache_id(),
    }


def build_step_state(
    cfg: TrainConfig, run: ResolvedRun, head: dict[str, torch.Tensor], device: torch.device, rank: int = 0
) -> StepState:
    """Everything train_step touches, on `device`: seeded fp32 drafter (rank 0's weights on every rank),
    frozen head in the compute dtype, flat grads, schedule, optimizer, static batch, attention layout,
    totals, the seeded anchor generator, and the elementwise options (working weight copies, compiled
    pointwise regions)."""
    compute_dtype = torch_dtype(cfg.compute_dtype)
    torch.manual_seed(cfg.seed)  # identical init on every rank; the broadcast makes sure
    model = DFlashDrafter(run.drafter).to(device)  # fp32 master weights
    if cfg.init_from is not None:  # a resumed run overwrites these with its checkpoint's
        load_drafter_weights_(model, cfg.init_from)
    broadcast_parameters(model)
    if cfg.pointwise_compiled(device.type):
        compile_pointwise_(model)
    target_head = TargetHead(head["embed_tokens"].to(device, compute_dtype), head["lm_head"].to(device, compute_dtype))
    params = list(model.parameters())
    grads = FlatGrads(params)
    schedule = WarmupCosine(
        peak_lr=cfg.lr,
        warmup_steps=run.warmup_steps,
        total_steps=run.total_steps,
        min_lr_ratio=cfg.min_lr_ratio,
        device=device,
    )
    optimizer = make_optimizer(params, schedule, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    cc = run.cache_config
    batch = StaticBatch(cc, device, compute_dtype, with_topk=cfg.kl_lambda > 0)
    backend = choose_backend(cfg.attention, device)
    layout = BlockAttentionLayout.for_drafter(
        run.drafter, num_ctx=cc.token_budget, num_blocks=run.num_blocks, backend=backend, device=device
    )
    # Anchor sampling: the default CUDA generator on GPU (graph-safe); a private one on CPU.
    generator = None if device.type == "cuda" else torch.Generator(device)
    if generator is None:
        torch.cuda.manual_seed(anchor_seed(cfg.seed, rank=rank))
    else:
        generator.manual_seed(anchor_seed(cfg.seed, rank=rank))
    return StepState(
        model=model,
        head=target_head,
        batch=batch,
        layout=layout,
        optimizer=optimizer,
        schedule=schedule,
        grads=grads,
        totals=StepTotals(cfg.block_size, device),
        loss=cfg.loss_config(),
        grad_clip=cfg.grad_clip,
        metrics_topk=cfg.metrics_topk,
        autocast_dtype=autocast_dtype(compute_dtype),
        generator=generator,
        checkpoint_layers=cfg.checkpoint_layers,
        params=params,
        working_weights=(
            WorkingWeights([m for m in model.modules() if isinstance(m, Linear)], compute_dtype)
            if cfg.weight_copies and autocast_dtype(compute_dtype) is not None
            else None
        ),
    )


class Trainer:
    def __init__(self, cfg: TrainConfig, run: ResolvedRun, dist_info: DistInfo, device: torch.device):
        self.cfg, self.run, self.dist, self.device = cfg, run, dist_info, device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.use_graphs = device.type == "cuda" and cfg.cuda_graphs is not False
        if cfg.cuda_graphs and device.type != "cuda":
            log.warning("--cuda-graphs ignored: running on %s, the step runs eagerly", device)
        self.out_dir = Path(cfg.out_dir)
        if dist_info.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        compute_dtype = torch_dtype(cfg.compute_dtype)
        self.loss_terms = tuple(t for t, w in (("kl", cfg.kl_lambda), ("cap", cfg.cap_lambda)) if w > 0)
        self.flops_per_step = drafter_step_flops(run.drafter, run.cache_config.token_budget, run.num_blocks)
        self.peak_flops, self._peak_source = peak_flops(device, compute_dtype)
        self._announce(choose_backend(cfg.attention, device), compute_dtype)

        head = load_target_head(cfg.cache)
        self.state = build_step_state(cfg, run, head, device, rank=dist_info.rank)
        self.model, self.head, self.batch = self.state.model, self.state.head, self.state.batch
        self.generator = self.state.generator
        self.reader = ShardReader(cfg.cache)
        self.step, self.epoch, self.cursor, tokens_seen, skipped = 0, 0, 0, 0, 0
        self.last_checkpoint: Path | None = None
        if cfg.resume:
            tokens_seen, skipped = self._resume()
        if dist_info.is_main:
            self._write_run_record()  # first: what marks the directory as a run's (train/rundir.py)
            # Records after the resumed step belong to the run that died: dropped, so no step has two.
            dropped = truncate_metrics(self.out_dir, self.step)
            if dropped:
                log.info(
                    "metrics.jsonl: %d record(s) after step %d dropped (they are trained again)", dropped, self.step
                )
        self.metrics = MetricsLogger(
            out_dir=self.out_dir,
            total_steps=run.total_steps,
            log_every=cfg.log_every,
            metrics_every=cfg.metrics_every,
            metrics_topk=cfg.metrics_topk,
            is_main=dist_info.is_main,
            device=device,
            tensorboard=cfg.tensorboard,
            start_step=self.step,
            loss_terms=self.loss_terms,
            flops_per_step=self.flops_per_step,
            peak_flops=self.peak_flops,
        )
        self.metrics.tokens_seen, self.metrics.skipped_shards = tokens_seen, skipped
        if cfg.resume:
            self.metrics.write_event(
                {
                    "event": "resume",
                    "step": self.step,
                    "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
                }
            )
        self.tokens_at_start = tokens_seen  # a resumed run's earlier tokens, left out of its tokens/s
        self.step_at_start = self.step
        self.checkpoints = CheckpointWriter(
            self.out_dir,
            keep=cfg.keep_checkpoints,
            mode=cfg.checkpoint_write,
            device=device,
            write_event=self.metrics.write_event,
            active=dist_info.is_main,
            resumed_step=self.step if self.last_checkpoint is not None else None,
        )
        self.checkpoints.allocate(self.model.state_dict(), self.state.optimizer.state_dict())
        self.skipped: list[tuple[int, str]] = []
        self._last_record: dict[str, Any] | None = None
        self._logged_step = -1
        self.runner = StepRunner(self.state, cuda_graphs=self.use_graphs)

    # ---- setup ---------------------------------------------------------------------------------
    def _announce(self, backend: str, compute_dtype: torch.dtype) -> None:
        if not self.dist.is_main:
            return
        r = self.run
        log.info(
            "run: %d train shards, %d held out; %s; %d steps (%d per epoch), warmup %d",
            len(r.train_ids),
            len(r.eval_ids),
            plural(self.dist.world_size, "rank"),
            r.total_steps,
            r.steps_per_epoch,
            r.warmup_steps,
        )
        left_out = len(r.train_ids) % self.dist.world_size
        if left_out:
            log.warning(
                "%d of the %d training shards are left out of each epoch (a different set each epoch, "
                "drawn by the epoch's shuffle): each of the %d ranks must run the same number of steps. "
                "Use a shard count divisible by the rank count to train on every shard every epoch",
                left_out,
                len(r.train_ids),
                self.dist.world_size,
            )
        log.info(
            "drafter: %s parameters, %d layers, hidden %d, MLP %d, heads %d/%d x %d, block %d, %d blocks per batch",
            f"{count_parameters(r.drafter):,}",
            r.drafter.num_layers,
            r.drafter.hidden_size,
            r.drafter.intermediate_size,
            r.drafter.num_attention_heads,
            r.drafter.num_key_value_heads,
            r.drafter.head_dim,
            r.drafter.block_size,
            r.num_blocks,
        )
        mfu = (
            f"MFU against {self.peak_flops / 1e12:.0f} TFLOP/s bf16 peak ({self._peak_source})"
            if self.peak_flops
            else f"no MFU figure: {self._peak_source}"
        )
        log.info(
            "FLOPs per step: %.4g (drafter and LM-head matmuls, forward and backward, per rank; attention "
            "not counted, see train/metrics/flops.py); %s",
            self.flops_per_step,
            mfu,
        )
        if r.drafter.attention_window is not None:
            log.info(
                "drafter layers: %s (sliding: causal, window %d tokens)",
                ",".join("sliding" if s else "full" for s in r.drafter.sliding_layers),
                r.drafter.attention_window,
            )
        log.info(
            "kernels: attention %s, compute %s (fp32 master weights), step %s on %s",
            backend,
            str(compute_dtype).removeprefix("torch."),
            "CUDA graph" if self.use_graphs else "eager",
            self.device,
        )
        cfg, cuda = self.cfg, self.device.type == "cuda"
        log.info(
            "elementwise: working weight copies %s, fused loss %s, compiled pointwise regions %s",
            "on" if cfg.weight_copies and compute_dtype != torch.float32 else "off",
            ("on (compiled)" if cuda else "on (eager)") if cfg.fused_loss else "off",
            "on" if cfg.pointwise_compiled(self.device.type) else "off",
        )

    def _rng_state(self) -> dict[str, str | None]:
        cuda = self.device.type == "cuda"
        return {
            "torch_cpu": encode_rng(torch.get_rng_state()),
            "torch_cuda": encode_rng(torch.cuda.get_rng_state(self.device)) if cuda else None,
            "block_generator": encode_rng(self.generator.get_state()) if self.generator is not None else None,
        }

    def _set_rng_state(self, s: dict[str, str | None]) -> None:
        torch.set_rng_state(decode_rng(s["torch_cpu"]))
        if s.get("torch_cuda") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(decode_rng(s["torch_cuda"]), self.device)
        if s.get("block_generator") is not None and self.generator is not None:
            self.generator.set_state(decode_rng(s["block_generator"]))

    def _write_run_record(self) -> None:
        record = {
            "config": self.cfg.to_dict(),
            "config_hash": self.cfg.config_hash(),
            "drafter": _drafter_dict(self.run),
            "num_blocks": self.run.num_blocks,
            "total_steps": self.run.total_steps,
            "world_size": self.dist.world_size,
            "shards_left_out_per_epoch": len(self.run.train_ids) % self.dist.world_size,
            "cache_target": self.run.cache_config.target.__dict__,
            "provenance": provenance(),
        }
        fresh = not self.cfg.resume or not (self.out_dir / RUN_RECORD_FILE).is_file()
        name = RUN_RECORD_FILE if fresh else f"run-resume-{self.step:08d}.json"
        atomic_write_text(self.out_dir / name, json.dumps(record, indent=1, default=str) + "\n")

    def _resume(self) -> tuple[int, int]:
        ckpt = latest_checkpoint(self.out_dir)
        if ckpt is None:
            log.info("resume: no checkpoint in %s, starting from step 0", self.out_dir)
            return 0, 0
        check_resume(ckpt, self.cfg, self.run, self.dist.world_size)
        model_state = load_model_state(ckpt)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(model_state[name])
        load_optimizer_state_(self.state.optimizer, self.state.params, load_optimizer_state(ckpt))
        st = ckpt.state
        self.step, self.epoch, self.cursor = st["step"], st["epoch"], st["cursor"]
        self.state.schedule.set_step(self.step)
        self._set_rng_state(st["rng"][self.dist.rank])
        self.last_checkpoint = ckpt.path
        log.info("resume: %s (step %d, epoch %d, shard %d of the epoch)", ckpt.path, self.step, self.epoch, self.cursor)
        return st["tokens_seen"], st["skipped_shards"]

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> TrainSummary:
        run = self.run
        # A fresh run measures its starting point, so every run reports what training bought.
        eval_before = self._evaluate(one_off=True) if run.eval_ids and self.step == 0 else None
        batches = self._batches()
        stopped = False
        try:
            with StopOnSigterm(self.device, self.dist.world_size) as stop:
                stopped = self._steps(batches, stop)
        finally:
            batches.close()
            self.batch.close()
        # A rank that stops because another rank was signalled: torchrun passes signals on as SIGTERM.
        stop_signal = stop.signal_name or "SIGTERM"
        if self.step > 0 and (self.last_checkpoint is None or self.last_checkpoint.name != f"step-{self.step:08d}"):
            self._save()
        self.checkpoints.wait()  # the last checkpoint is durable (or its error raised) before it is reported
        if stopped:
            self.metrics.write_event(
                {"event": "stopped", "step": self.step, "reason": stop_signal, "checkpoint": str(self.last_checkpoint)}
            )
            log.warning(
                "%s: stopped after step %d, checkpoint %s; --resume continues",
                stop_signal,
                self.step,
                self.last_checkpoint,
            )
            stop_together(self.dist.world_size)
            return TrainSummary(
                self.step,
                self.metrics.tokens_seen,
                self._last_record,
                self.last_checkpoint,
                None,
                self.skipped,
                eval_before,
                stopped=True,
                stop_signal=stop_signal,
            )
        eval_result = self._evaluate() if run.eval_ids else None
        return TrainSummary(
            self.step,
            self.metrics.tokens_seen,
            self._last_record,
            self.last_checkpoint,
            eval_result,
            self.skipped,
            eval_before,
        )

    def _steps(self, batches: Iterator[Batch], stop: StopOnSigterm) -> bool:
        """Run steps until the budget or the data is used up (False) or SIGTERM / SIGINT asks to stop (True)."""
        cfg, run = self.cfg, self.run
        while self.step < run.total_steps:
            wait_start = time.monotonic()
            batch = next(batches)  # this rank's next shard, read ahead on the loader thread
            self.metrics.add_data_wait(time.monotonic() - wait_start)
            self._count_skipped(batch.skipped)
            self.epoch, self.cursor = batch.epoch, batch.cursor
            if batch.end:  # every epoch used up: shards were skipped, so fewer steps than planned
                break
            if batch.shard is not None:  # None: a skipped shard's stand-in, the buffers hold the last batch
                self.batch.load(batch.shard)
            self.metrics.add_tokens(batch.num_tokens)

            self.step += 1
            self.runner.run(with_metrics=self.metrics.should_compute_metrics(self.step))
            self.checkpoints.poll()  # a background write that finished: reported, or its error raised

            done = self.step >= run.total_steps
            checkpoint_due = bool(cfg.checkpoint_every) and self.step % cfg.checkpoint_every == 0
            if self.metrics.should_log(self.step) or checkpoint_due or done:
                self._log()
            # In-training eval by default: every epoch, or every --eval-every steps (the end is evaluated below).
            every = cfg.eval_every or run.steps_per_epoch
            if run.eval_ids and self.step % every == 0 and not done:
                self._evaluate()
            if checkpoint_due and not done:
                self._save()
            if stop.poll() and not done:
                if self._logged_step != self.step:
                    self._log()
                return True
        return False

    def _batches(self) -> Iterator[Batch]:
        """This rank's batches from the resume point (epoch, cursor) to the end of the last epoch."""
        cfg = self.cfg
        return rank_batches(
            self.reader,
            self.run.train_ids,
            epoch=self.epoch,
            cursor=self.cursor,
            epochs=cfg.epochs,
            seed=cfg.seed,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            num_buffers=cfg.num_buffers,
            pin_memory=self.device.type == "cuda",
            verify_checksum=cfg.verify_checksums,
            skip_bad_shards=cfg.skip_bad_shards,
        )

    def _log(self) -> None:
        """The log: one all-reduce and one host sync; raises NonFiniteError naming a bad step/batch."""
        lr = self.state.schedule.host_lr(self.step - 1)
        self._last_record = self.metrics.log(self.step, self.epoch, self.state.totals, lr=lr)
        self._logged_step = self.step

    def _count_skipped(self, skipped: list[tuple[int, str]]) -> None:
        for batch_id, reason in skipped:
            self.skipped.append((batch_id, reason))
            self.metrics.skipped_shards += 1
            self.metrics.write_event(
                {"event": "skipped_shard", "step": self.step, "batch_id": batch_id, "reason": reason}
            )

    def _save(self) -> None:
        if self._logged_step != self.step:
            self._log()  # never save a checkpoint without the non-finite check of its steps
        blocked_since = time.monotonic()  # the stall: from here until the writer returns
        rngs = all_gather_objects(self._rng_state())
        if self.dist.is_main:
            train_state = {
                "step": self.step,
                "epoch": self.epoch,
                "cursor": self.cursor,
                "tokens_seen": self.metrics.tokens_seen,
                "skipped_shards": self.metrics.skipped_shards,
                "world_size": self.dist.world_size,
                "config_hash": self.cfg.config_hash(),
                "config_identity": self.cfg.identity(),
                "resolved_identity": resolved_identity(self.cfg, self.run),
                "drafter": _drafter_dict(self.run),
                "target_config_hash": self.run.cache_config.target.config_hash,
                "rng": rngs,
                "cache_identity": cache_identity(self.run),
                "train_ids": self.run.train_ids,  # what `eval` warns about as not held out
                "provenance": provenance(),
            }
            self.checkpoints.save(
                self.step,
                self.model.state_dict(),
                self.state.optimizer.state_dict(),
                train_state,
                blocked_since=blocked_since,
            )
        self.last_checkpoint = self.out_dir / checkpoint_name(self.step)
        barrier()

    def _evaluate(self, *, one_off: bool = False) -> EvalResult:
        cfg, run = self.cfg, self.run
        started = time.monotonic()
        ids = run.eval_ids[: cfg.eval_max_shards]
        # One number per set of weights: the fp32 master weights rounded to the compute dtype, no autocast.
        model = eval_copy(self.model, torch_dtype(cfg.compute_dtype))
        result = evaluate_drafter(
            model,
            self.head,
            cfg.cache,
            ids,
            device=self.device,  # eval's own anchors: the same as `eval`'s
            attention=self.state.layout.backend,
            chunk_blocks=self.state.loss.chunk_blocks,
            budgets=cfg.eval_tree_budgets,  # default none: trees cost a walk each, dflash-train eval has them
            gamma=self.state.loss.gamma,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
        )
        del model
        self.metrics.write_event(
            {"event": "eval", "step": self.step, **result.to_record(), "eval/batch_ids": result.batch_ids}
        )
        if self.dist.is_main:
            log.info("eval at step %d: %s", self.step, result.summary_line())
            write_eval_json(self.out_dir / "eval.json", result.to_dict())
        # An evaluation is not training: its time stays out of the next step line's rates.
        self.metrics.exclude_time(time.monotonic() - started, from_eta=one_off)
        return result

    def close(self) -> None:
        self.checkpoints.close()  # after an error: the write in flight still finishes
        self.metrics.close()


def _drafter_dict(run: ResolvedRun) -> dict[str, Any]:
    return dataclasses.asdict(run.drafter)
