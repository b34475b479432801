"""One training step, and its capture as a CUDA graph.

`train_step` is what the graph captures, so it reads top to bottom with no I/O, no .item(), no
data-dependent shapes or branches: sample blocks -> forward (fused context, blocks, drafter) ->
chunked loss -> backward -> (metrics, on metrics steps) -> gradient all-reduce -> clip ->
optimizer -> scheduler -> zero grads. The only branch, `with_metrics`, is a host decision from the
step number; on CUDA each of its two values is its own captured graph (sharing one memory pool).

Precision: fp32 master parameters and optimizer state, activations in bf16 under autocast (the
cast weights are not cached across graph replays: autocast's cache is off), loss and metrics in
fp32. With working weights (precision.WorkingWeights) the linear weights are rounded to bf16 once,
at the top of the step (= after the previous step's optimizer update, and after a resume or the
capture's state restore), instead of at each use. The learning rate lives in a device tensor that
the scheduler rewrites inside the step, so a replayed graph always uses the current value.

Legend: T token budget, K taps, H hidden, NB blocks, B block size.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from train.batch import StaticBatch
from train.blocks import sample_blocks
from train.distributed import FlatGrads
from train.drafter.attention import BlockAttentionLayout
from train.drafter.model import DFlashDrafter, TargetHead
from train.loss.chunked import LossConfig, block_loss
from train.metrics.block_metrics import block_metrics
from train.metrics.logger import StepTotals
from train.precision import WorkingWeights, compute_autocast

log = logging.getLogger(__name__)


class WarmupCosine:
    """lr(s) = lr * (s+1)/W for s < W, then min + (lr - min) * (1 + cos(pi * (s-W)/(N-1-W))) / 2.

    s is the 0-based index of the step about to run; `lr_t` always holds lr(step_t). The last step
    (s = N-1) runs at the floor min = lr * --min-lr-ratio, as its help says, whenever the warmup ends
    before it (W <= N-1; a warmup that lasts to the end leaves no cosine step).
    """

    def __init__(
        self, *, peak_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float, device: torch.device
    ):
        self.peak_lr, self.warmup_steps, self.total_steps = peak_lr, warmup_steps, total_steps
        self.min_lr = peak_lr * min_lr_ratio
        self.step_t = torch.zeros((), dtype=torch.float64, device=device)
        self.lr_t = torch.zeros((), dtype=torch.float32, device=device)
        self._refresh()

    def lr_at(self, s: torch.Tensor) -> torch.Tensor:
        warm = self.peak_lr * (s + 1) / max(self.warmup_steps, 1)
        span = self.total_steps - 1 - self.warmup_steps  # 0: the warmup ends at N-2, the last step is the floor
        progress = ((s - self.warmup_steps) / span).clamp(0, 1) if span > 0 else torch.ones_like(s)
        cosine = self.min_lr + (self.peak_lr - self.min_lr) * 0.5 * (1 + torch.cos(math.pi * progress))
        return torch.where(s < self.warmup_steps, warm, cosine)

    def host_lr(self, s: int) -> float:
        """lr of 0-based step s, computed on the host (for logs)."""
        return float(self.lr_at(torch.tensor(float(s), dtype=torch.float64)))

    def _refresh(self) -> None:
        self.lr_t.copy_(self.lr_at(self.step_t))

    def step(self) -> None:
        self.step_t += 1
        self._refresh()

    def set_step(self, step: int) -> None:
        self.step_t.fill_(step)
        self._refresh()


@dataclass
class StepState:
    """Everything one step touches; built once by the loop, every tensor at a fixed address.

    Shapes come from their owners: block size and MASK id from model.config, the number of blocks
    from layout, the loss settings (gamma included) from loss."""

    model: DFlashDrafter
    head: TargetHead
    batch: StaticBatch
    layout: BlockAttentionLayout
    optimizer: torch.optim.Optimizer
    schedule: WarmupCosine
    grads: FlatGrads
    totals: StepTotals
    loss: LossConfig
    grad_clip: float  # clip the global gradient L2 norm to this; 0 = off
    metrics_topk: int  # k of the top-k metrics
    autocast_dtype: torch.dtype | None  # None = no autocast (fp32 compute)
    generator: torch.Generator | None  # None on CUDA = the default CUDA generator (graph-safe)
    checkpoint_layers: bool = False  # recompute each drafter layer in backward (activation checkpointing)
    params: list[nn.Parameter] = field(default_factory=list)
    working_weights: WorkingWeights | None = None  # compute-dtype copies of the linear weights; None = cast per use

    def autocast(self):
        return compute_autocast(self.batch.device, self.autocast_dtype)


def train_step(s: StepState, *, with_metrics: bool) -> None:
    b, drafter = s.batch, s.model.config
    if s.working_weights is not None:
        s.working_weights.refresh()  # this step's weights, rounded once
    blocks = sample_blocks(
        input_ids_T=b.input_ids_T,
        position_ids_T=b.position_ids_T,
        loss_mask_T=b.loss_mask_T,
        cu_seqlens_S1=b.cu_seqlens_S1,
        num_blocks=s.layout.num_blocks,
        block_size=drafter.block_size,
        mask_token_id=drafter.mask_token_id,
        gamma=s.loss.gamma,
        generator=s.generator,
    )
    s.layout.update(blocks.seq_start_N, blocks.anchor_N)
    with s.autocast():
        block_embed_NBH = s.head.embed(blocks.block_ids_NB)  # [NB, B, H]
        hidden_NBH = s.model(
            b.hidden_TKH,
            b.position_ids_T,
            block_embed_NBH,
            blocks.block_pos_NB,
            s.layout,
            checkpoint_layers=s.checkpoint_layers,
        )
        loss = block_loss(hidden_NBH, s.head, blocks, s.loss, b.topk_ids_TK, b.topk_logprobs_TK)
    loss.total.backward()
    if with_metrics:
        with s.autocast():
            s.totals.add_metrics(
                block_metrics(
                    hidden_NBH.detach(), s.head, blocks, topk=s.metrics_topk, chunk_blocks=s.loss.chunk_blocks
                )
            )
    s.grads.average_across_ranks()
    grad_norm = torch.linalg.vector_norm(s.grads.flat)  # global L2 norm, before clipping
    if s.grad_clip > 0:
        s.grads.flat.mul_((s.grad_clip / (grad_norm + 1e-6)).clamp(max=1.0))
    s.totals.add_step(
        loss,
        grad_norm,
        blocks.label_valid_NB,
        blocks.block_valid_N,
        s.schedule.step_t,
        b.batch_id,
        torch.isfinite(b.hidden_TKH).all(),
    )
    s.optimizer.step()
    s.schedule.step()
    s.grads.zero()


def make_optimizer(
    params: list[nn.Parameter], schedule: WarmupCosine, *, betas: tuple[float, float], eps: float, weight_decay: float
) -> torch.optim.AdamW:
    """Fused AdamW (graph-capturable on CUDA) reading lr from the schedule's device tensor.

    Its state is created here by one zero-lr step on zero gradients (parameters unchanged) and then
    zeroed, so every state tensor exists before capture and checkpoints can be loaded into it in place.
    """
    # capturable: step() refuses graph capture without it; the fused kernel itself is graph-safe.
    opt = torch.optim.AdamW(
        params,
        lr=schedule.lr_t,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        fused=True,
        capturable=params[0].device.type == "cuda",
    )
    saved_lr = schedule.lr_t.clone()
    schedule.lr_t.zero_()
    for p in params:
        p.grad.zero_()
    opt.step()
    for state in opt.state.values():
        for t in state.values():
            t.zero_()
    schedule.lr_t.copy_(saved_lr)
    return opt


def optimizer_state_tensors(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[torch.Tensor]:
    return [t for p in params for _, t in sorted(opt.state[p].items())]


def load_optimizer_state_(opt: torch.optim.Optimizer, params: list[nn.Parameter], saved: dict) -> None:
    """Copy a saved optimizer.state_dict() into the live state tensors (addresses kept for the graph)."""
    saved_state = saved["state"]
    if len(saved_state) != len(params):
        raise ValueError(f"optimizer state holds {len(saved_state)} parameters, the model has {len(params)}")
    for i, p in enumerate(params):
        live = opt.state[p]
        if set(saved_state[i]) != set(live):
            raise ValueError(
                f"optimizer state of parameter {i} has keys {sorted(saved_state[i])}, expected {sorted(live)}"
            )
        for key, t in live.items():
            t.copy_(saved_state[i][key])


def _persistent_tensors(s: StepState) -> list[torch.Tensor]:
    return (
        [p.data for p in s.params]
        + optimizer_state_tensors(s.optimizer, s.params)
        + [s.schedule.step_t, s.schedule.lr_t, s.grads.flat]
        + s.totals.tensors()
    )


class StepRunner:
    """Runs train_step eagerly, or replays its captured CUDA graphs."""

    def __init__(self, state: StepState, *, cuda_graphs: bool, warmup_iters: int = 3):
        self.state = state
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        if cuda_graphs:
            self._capture(warmup_iters)

    def run(self, *, with_metrics: bool) -> None:
        if self.graphs:
            self.graphs[with_metrics].replay()
        else:
            train_step(self.state, with_metrics=with_metrics)

    def _capture(self, warmup_iters: int) -> None:
        """Warm up on a side stream, capture both variants, then restore every state tensor.

        Warm-up and capture really execute steps (optimizer included); the snapshot taken before and
        copied back after makes capture invisible to training: same weights, state, RNG and totals.
        """
        s = self.state
        device = s.batch.device
        snapshot = [t.clone() for t in _persistent_tensors(s)]
        rng = torch.cuda.get_rng_state(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup_iters):
                for with_metrics in (False, True):
                    train_step(s, with_metrics=with_metrics)
        torch.cuda.current_stream(device).wait_stream(side)
        pool = None
        for with_metrics in (False, True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                train_step(s, with_metrics=with_metrics)
            pool = graph.pool()
            self.graphs[with_metrics] = graph
        torch.cuda.synchronize(device)
        for live, saved in zip(_persistent_tensors(s), snapshot):
            live.copy_(saved)
        torch.cuda.set_rng_state(rng, device)
        log.info("step: captured as CUDA graphs (with and without metrics), %d warm-up iterations", warmup_iters)
