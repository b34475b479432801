"""The proxy target's training loop: AdamW, warmup then cosine, the step, logs, held-out evaluations.

The schedule's progress is the larger of steps done / steps planned and time spent / --time-limit,
so a slower machine still anneals fully within the limit. One host sync per log line (the mean loss,
checked for being finite there, with the step number).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from shards.common.progress import format_duration
from tools.testbed.target_data import PAD_LABEL, Batch, Samples, epoch_batches, make_batch
from tools.testbed.target_eval import heldout_loss, token_losses
from tools.testbed.train_config import TrainTargetConfig

logger = logging.getLogger(__name__)


def make_optimizer(model, cfg: TrainTargetConfig, device: torch.device) -> torch.optim.AdamW:
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]  # norms, A_log, dt_bias
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def lr_at(cfg: TrainTargetConfig, step: int, progress: float) -> float:
    """Linear warmup over warmup_steps, then cosine from lr to lr * min_lr_ratio as progress goes 0 -> 1."""
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


class Trainer:
    """Owns the loop: data order, schedule, cadence of logs and evaluations, the time limit."""

    def __init__(
        self, cfg: TrainTargetConfig, model, train: Samples, heldout: Samples, pad_id: int, device, log_path: Path
    ):
        self.cfg, self.model, self.train, self.heldout = cfg, model, train, heldout
        self.pad_id, self.device, self.log_path = pad_id, device, log_path
        self.optimizer = make_optimizer(model, cfg, device)
        self.rng = np.random.default_rng(cfg.seed)
        first_epoch = epoch_batches(train, cfg.batch_tokens, np.random.default_rng(cfg.seed))
        self.steps_per_epoch = len(first_epoch)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        self.curve: list[dict] = []

    def run(self) -> dict:
        cfg, model = self.cfg, self.model
        model.train()
        start = time.perf_counter()
        step = tokens = 0
        loss_sum = torch.zeros((), device=self.device)
        window_tokens, window_start, stopped_by = 0, start, "steps"
        batches: list[list[int]] = []
        progress = 0.0
        while progress < 1.0:
            if not batches:
                batches = epoch_batches(self.train, cfg.batch_tokens, self.rng)
            batch = make_batch(self.train, batches.pop(), self.pad_id)
            lr = lr_at(cfg, step, progress)
            loss_sum += self.step(batch, lr)
            step += 1
            tokens += batch.num_real_tokens
            window_tokens += batch.num_real_tokens
            elapsed = time.perf_counter() - start
            progress = max(step / self.total_steps, elapsed / cfg.time_limit)
            if progress >= 1.0 and step < self.total_steps:
                stopped_by = "time"
            if step % cfg.log_every == 0 or progress >= 1.0:
                mean_loss = loss_sum.item() / (step % cfg.log_every or cfg.log_every)  # the one host sync
                if not math.isfinite(mean_loss):
                    raise RuntimeError(f"step {step}: the training loss is {mean_loss}; lower --lr or check the data")
                now = time.perf_counter()
                self._log(step, elapsed, tokens, mean_loss, lr, window_tokens / max(1e-9, now - window_start))
                loss_sum.zero_()
                window_tokens, window_start = 0, now
            if cfg.eval_every and step % cfg.eval_every == 0 and progress < 1.0:
                self._evaluate(step)
        seconds = time.perf_counter() - start
        return {
            "steps": step,
            "planned_steps": self.total_steps,
            "stopped_by": stopped_by,
            "epochs": step / self.steps_per_epoch,
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
        }

    def step(self, batch: Batch, lr: float) -> torch.Tensor:
        """One optimizer step on `batch`: forward, mean loss over its targets, backward, clip, update.
        Returns the loss, on the device (no host sync)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        labels = batch.labels if self.cfg.loss_on == "all" else batch.assistant_labels
        num_targets = max(1, int((labels != PAD_LABEL).sum()))  # labels live on the host: no sync
        loss = token_losses(self.model, batch.input_ids, labels, self.device) / num_targets
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def _log(self, step: int, elapsed: float, tokens: int, loss: float, lr: float, tokens_per_s: float) -> None:
        cfg = self.cfg
        left = min((self.total_steps - step) * elapsed / step, cfg.time_limit - elapsed)
        logger.info(
            "step %d/%d  epoch %.2f  loss %.4f  lr %.2e  %.0f tokens/s  elapsed %s  eta %s",
            step, self.total_steps, step / self.steps_per_epoch, loss, lr, tokens_per_s,
            format_duration(elapsed), format_duration(max(0.0, left)),
        )  # fmt: skip
        record = {"step": step, "epoch": step / self.steps_per_epoch, "loss": loss, "lr": lr,
                  "tokens": tokens, "tokens_per_s": tokens_per_s, "elapsed_s": elapsed}  # fmt: skip
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _evaluate(self, step: int) -> None:
        losses = heldout_loss(self.model, self.heldout, self.cfg.batch_tokens, self.pad_id, self.device)
        self.curve.append({"step": step, "epoch": step / self.steps_per_epoch, **losses})
        logger.info(
            "step %d  held-out loss %.4f (all tokens), %.4f (reply tokens)", step, losses["all"], losses["assistant"]
        )
