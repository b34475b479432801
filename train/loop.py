"""The training loop: owns data, cadence, checkpoints and evaluation; the step owns the math.

run_training(cfg):
  validate the config against the cache (train/resolve.py: no model, no GPU) -> join the process group
  -> build drafter (fp32 master), frozen target head, static batch, optimizer, schedule
  (train/step.py: build_step_state) -> resume from the newest valid checkpoint when asked
  (train/resume.py says whether it may) -> capture the step (CUDA) -> per step: next batch (timed)
  -> copy to the device -> count tokens -> step -> log / eval / checkpoint.
What the run prints at start and end is train/console.py's.

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
from pathlib import Path
from typing import Any

import torch

from shards import ShardReader, load_target_head
from shards.common.compile_cache import use_compile_cache
from shards.common.durable import atomic_write_text, check_writable
from shards.common.errors import UserError
from shards.common.lock import DirectoryLock
from shards.common.owned import Dir, describe
from shards.common.progress import format_duration
from shards.common.provenance import provenance
from shards.common.runtime import (
    DistInfo,
    all_gather_objects,
    barrier,
    process_group_scope,
    rank_info,
    resolve_device,
)
from shards.common.startup import StartupClock
from train.checkpoint.async_save import CheckpointWriter
from train.checkpoint.serving import trained_for
from train.checkpoint.store import (
    MODEL_FILE,
    STATE_FILE,
    Checkpoint,
    CheckpointError,
    checkpoint_folders,
    checkpoint_name,
    decode_rng,
    encode_rng,
    latest_checkpoint,
    load_model_state,
    load_optimizer_state,
)
from train.checkpoint.weight_shapes import check_weight_shapes
from train.config import TrainConfig
from train.console import TrainSummary, announce_run
from train.data import Batch, rank_batches
from train.distributed import init_distributed, same_on_every_rank
from train.drafter.attention import choose_backend
from train.drafter.fp8 import AUTO, FP8_MODES, FP8_RECIPES, require_fp8, resolve_fp8
from train.eval.evaluate import EvalResult, eval_copy, evaluate_drafter
from train.loss.head_gemms import require_fp8_head
from train.metrics.flops import drafter_step_flops, peak_flops
from train.metrics.logger import MetricsLogger
from train.optim import load_optimizer_state_
from train.outputs import write_eval_json
from train.precision import torch_dtype
from train.preempt import StopOnSigterm, stop_together
from train.resolve import ResolvedRun, resolve_run, resolved_identity
from train.resume import cache_identity, check_resume, recorded_setting
from train.rundir import RUN_RECORD_FILE, check_run_dir, clean_stale_temporaries, truncate_metrics
from train.step import StepRunner, build_step_state

log = logging.getLogger(__name__)


def run_training(cfg: TrainConfig) -> TrainSummary:
    """Train a drafter as configured; returns what happened. Raises ValueError on bad settings/data."""
    # Every rank reads the cache from the first check to the last step: a job rewriting it meanwhile
    # (dflash-extract --overwrite, dflash-shards index) is refused, as is this run while one writes it.
    with DirectoryLock(cfg.cache, "dflash-train train", shared=True):
        return _train(cfg)


def _train(cfg: TrainConfig) -> TrainSummary:
    start = time.monotonic()
    # Every check that needs no model, GPU or process group comes first.
    run = resolve_run(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    check_run_dir(cfg.out_dir, cfg.cache)
    check_writable(cfg.out_dir, f"--out {cfg.out_dir}")
    device = resolve_device(cfg.device, 0)
    # --fp8: no torchao, a CPU, a GPU before FP8 tensor cores: refused before the run directory
    if cfg.fp8 not in (AUTO, "off"):
        _require_fp8(cfg.fp8, run, device)
    if not cfg.resume:
        cfg = _fp8_resolved(cfg, run, device, None)
    if device.type == "cuda" or cfg.compile_pointwise:  # where the step compiles
        use_compile_cache(cfg.compile)
    if cfg.attention == "flex" and device.type != "cuda":
        raise ValueError(
            f"--attention flex on {device}: FlexAttention has no backward pass off CUDA, so it cannot train "
            "here; use --attention sdpa (or auto, which picks sdpa on CPU)"
        )
    # Rank 0 holds the run directory's lock for the whole run (its ranks share it); a second run is refused.
    lock = DirectoryLock(cfg.out_dir, "dflash-train")
    try:
        if rank_info().is_main:
            Dir.open(cfg.out_dir, create=True).close()
            lock.acquire()
            clean_stale_temporaries(cfg.out_dir)
        newest = latest_checkpoint(cfg.out_dir)
        folders = checkpoint_folders(cfg.out_dir)
        cfg = _fp8_resolved(cfg, run, device, newest)  # a resume's auto: its checkpoint's mode
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
        with process_group_scope():  # the group ends here on every rank, its threads with it
            device = resolve_device(cfg.device, dist_info.local_rank)
            # --fp8 auto resolves on each rank's machine: a job of mixed machines must not mix modes
            same_on_every_rank(cfg.fp8, "--fp8 (auto picks per machine: pass off, linears or linears+head)", device)
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


def _require_fp8(mode: str, run: ResolvedRun, device: torch.device) -> None:
    require_fp8(device, emulate=False)
    if mode == "linears+head":
        require_fp8_head(run.cache_config.target.vocab_size, run.cache_config.target.hidden_size)


def _fp8_resolved(cfg: TrainConfig, run: ResolvedRun, device: torch.device, resumed: Checkpoint | None) -> TrainConfig:
    """cfg with --fp8 auto made concrete (train/drafter/fp8.py: resolve_fp8), before anything records the
    run's identity; a resumed run keeps the mode its checkpoint trained with, wherever it resumes."""
    if cfg.fp8 != AUTO:
        return cfg
    if resumed is None:
        target = run.cache_config.target
        mode = resolve_fp8(
            AUTO,
            device,
            arch=run.drafter.arch,
            compute_dtype=cfg.compute_dtype,
            head_shape=(target.vocab_size, target.hidden_size),
            recipe=cfg.fp8_recipe,
        )
        return dataclasses.replace(cfg, fp8=mode)
    mode = recorded_setting(resumed, "fp8")
    if mode not in FP8_MODES:
        raise CheckpointError(f"{resumed.path}: records --fp8 {mode!r}, not one of {', '.join(FP8_MODES)}")
    log.info("--fp8 auto: %s, as %s trained", mode, resumed.path.name)
    if mode == "off" and cfg.fp8_recipe != FP8_RECIPES[0]:
        raise UserError(f"--fp8-recipe {cfg.fp8_recipe}: {resumed.path.name} trained in bf16 (--fp8 off); drop it")
    if mode != "off" and resumed.step < run.total_steps:  # a finished run trains nothing more
        try:
            _require_fp8(mode, run, device)
        except UserError as e:
            raise UserError(
                f"{resumed.path.name} trained with --fp8 {mode}, which a resumed run keeps, and that cannot run "
                f"here ({e}): resume on a GPU of compute capability 8.9+ with torchao"
            ) from e
    return dataclasses.replace(cfg, fp8=mode)


class Trainer:
    def __init__(self, cfg: TrainConfig, run: ResolvedRun, dist_info: DistInfo, device: torch.device):
        self.cfg, self.run, self.dist, self.device = cfg, run, dist_info, device
        self.clock = StartupClock(device)  # start-up per phase, logged and recorded after the first step
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.use_graphs = device.type == "cuda" and cfg.cuda_graphs is not False
        if cfg.cuda_graphs and device.type != "cuda":
            log.warning("--cuda-graphs ignored: running on %s, the step runs eagerly", device)
        self.out_dir = Path(cfg.out_dir)
        if dist_info.is_main:
            Dir.open(self.out_dir, create=True).close()
        compute_dtype = torch_dtype(cfg.compute_dtype)
        self.loss_terms = tuple(t for t, w in (("kl", cfg.loss.kl_lambda), ("cap", cfg.loss.cap_lambda)) if w > 0)
        self.flops_per_step = drafter_step_flops(run.drafter, run.cache_config.token_budget, run.num_blocks)
        self.peak_flops, peak_source = peak_flops(device, compute_dtype)
        if dist_info.is_main:
            announce_run(
                cfg,
                run,
                world_size=dist_info.world_size,
                device=device,
                backend=choose_backend(cfg.attention, device),
                compute_dtype=compute_dtype,
                cuda_graphs=self.use_graphs,
                flops_per_step=self.flops_per_step,
                peak_flops=self.peak_flops,
                peak_source=peak_source,
            )

        head = load_target_head(cfg.cache)
        self.state = build_step_state(cfg, run, head, device, rank=dist_info.rank)
        self.model, self.head, self.batch = self.state.model, self.state.head, self.state.batch
        self.clock.mark("model")  # the drafter built (or loaded), the target's head loaded
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
        # The schedule as it runs, so that `dflash-train plot` draws every step's lr, not only the logged ones.
        schedule = self.state.schedule
        self.metrics.write_event(
            {
                "event": "schedule",
                "step": self.step,
                "schedule": "warmup_cosine",
                "opt/peak_lr": schedule.peak_lr,
                "opt/warmup_steps": schedule.warmup_steps,
                "opt/total_steps": schedule.total_steps,
                "opt/min_lr_ratio": self.cfg.optim.min_lr_ratio,
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
        self.runner = StepRunner(self.state, cuda_graphs=self.use_graphs, clock=self.clock)

    # ---- setup ---------------------------------------------------------------------------------
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
            "drafter": dataclasses.asdict(self.run.drafter),
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
        weights = ckpt.path / MODEL_FILE
        check_weight_shapes([weights], self.run.drafter, weights, described_by="this run's drafter")
        model_state = load_model_state(ckpt)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(model_state[name])
        load_optimizer_state_(self.state.optimizer, self.state.params, load_optimizer_state(ckpt))
        st = ckpt.state
        self.step, self.epoch, self.cursor = st["step"], st["epoch"], st["cursor"]
        self.state.schedule.set_step(self.step)
        try:
            self._set_rng_state(st["rng"][self.dist.rank])
        except RuntimeError as e:  # a state of another size than torch's generators keep
            raise CheckpointError(f"{ckpt.path / STATE_FILE}: rng[{self.dist.rank}] does not restore ({e})") from e
        self.last_checkpoint = ckpt.path
        log.info("resume: %s (step %d, epoch %d, shard %d of the epoch)", ckpt.path, self.step, self.epoch, self.cursor)
        return st["tokens_seen"], st["skipped_shards"]

    def _record_startup(self) -> None:
        """The first step done: start-up per phase into the log and metrics.jsonl (one host sync, once)."""
        self.clock.mark("first_step")
        record = self.clock.log(f"rank {self.dist.rank}'s training") if self.dist.is_main else self.clock.record()
        self.metrics.write_event({"event": "startup", "step": self.step, **record})

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> TrainSummary:
        run = self.run
        # A fresh run measures its starting point, so every run reports what training bought.
        eval_before = self._evaluate() if run.eval_ids and self.step == 0 else None
        if eval_before is not None:
            self.clock.mark("eval_before")
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
            if self.step == self.step_at_start + 1:
                self._record_startup()
            self.checkpoints.poll()  # a background write that finished: reported, or its error raised

            done = self.step >= run.total_steps
            checkpoint_due = bool(cfg.checkpoint_every) and self.step % cfg.checkpoint_every == 0
            if self.metrics.should_log(self.step) or checkpoint_due or done:
                self._log()
            # In-training eval by default: every epoch, or every --eval-every steps (the end is evaluated below).
            every = cfg.eval.every or run.steps_per_epoch
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
                "drafter": dataclasses.asdict(self.run.drafter),
                "target_config_hash": self.run.cache_config.target.config_hash,
                "rng": rngs,
                "cache_identity": cache_identity(self.run),
                "train_ids": self.run.train_ids,  # what `eval` warns about as not held out
                **trained_for(self.run.cache_config),  # what export tells serving and eval about it
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

    def _evaluate(self) -> EvalResult:
        cfg, run = self.cfg, self.run
        started = time.monotonic()
        ids = run.eval_ids[: cfg.eval.max_shards]
        # One number per set of weights: the fp32 master weights rounded to the compute dtype, no autocast.
        model = eval_copy(self.model, torch_dtype(cfg.compute_dtype))
        result = evaluate_drafter(
            model,
            self.head,
            cfg.cache,
            ids,
            device=self.device,  # eval's own anchors: the same as `eval`'s
            attention=self.state.layout.backend,
            loss=self.state.loss,  # held-out CE weighted and chunked as training's
            budgets=cfg.eval.tree_budgets,  # default none: trees cost a walk each, dflash-train eval has them
            rank=self.dist.rank,
            world_size=self.dist.world_size,
        )
        del model
        seconds = time.monotonic() - started
        self.metrics.write_event(
            {
                "event": "eval",
                "step": self.step,
                **result.to_record(),
                "eval/batch_ids": result.batch_ids,
                "eval/seconds": seconds,
            }
        )
        if self.dist.is_main:
            log.info("eval at step %d (%s): %s", self.step, format_duration(seconds), result.summary_line())
            write_eval_json(self.out_dir / "eval.json", result.to_dict())
        # An evaluation is not training: its time stays out of the step line's rates and ETA, said apart.
        self.metrics.add_eval_time(seconds)
        return result

    def close(self) -> None:
        self.checkpoints.close()  # after an error: the write in flight still finishes
        self.metrics.close()
