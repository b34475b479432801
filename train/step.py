"""One training step, and its capture as a CUDA graph.

`train_step` is what the graph captures, so it reads top to bottom with no I/O, no .item(), no
data-dependent shapes or branches: sample blocks -> forward (fused context, blocks, drafter) ->
chunked loss (+ DFlash 2's selector loss on the candidates it found) -> backward -> (metrics, on metrics steps) -> gradient all-reduce -> clip ->
optimizer -> scheduler -> zero grads. The only branch, `with_metrics`, is a host decision from the
step number; on CUDA each of its two values is its own captured graph (sharing one memory pool).

Precision: fp32 master parameters and optimizer state, activations in bf16 under autocast (the
cast weights are not cached across graph replays: autocast's cache is off), loss and metrics in
fp32. With working weights (precision.WorkingWeights) the linear weights are rounded to bf16 once,
at the top of the step (= after the previous step's optimizer update, and after a resume or the
capture's state restore), instead of at each use. With --fp8 the drafter's linears run FP8 GEMMs
(train/drafter/fp8.py) and, with "linears+head", the loss's lm_head GEMMs too (loss/head_gemms.py); both
scale on the device, nothing syncs. The learning rate lives in a device tensor that
the scheduler rewrites inside the step, so a replayed graph always uses the current value (the
optimizer and the schedule are train/optim.py's). `build_step_state` builds everything the step
touches, once, before capture.

Legend: T token budget, K taps, H hidden, NB blocks, B block size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from shards.common.startup import StartupClock
from shards.projection import applied_matrix, load_projection
from train.batch import StaticBatch
from train.blocks import anchor_seed, sample_blocks
from train.checkpoint.export import load_drafter_weights_
from train.config import TrainConfig
from train.distributed import FlatGrads, broadcast_parameters
from train.drafter.attention import BlockAttentionLayout, choose_backend
from train.drafter.fp8 import AUTO, float8_linears_, require_fp8, resolve_fp8
from train.drafter.model import DFlashDrafter, Linear, TargetHead
from train.drafter.pointwise import compile_pointwise_
from train.loss.chunked import block_loss
from train.loss.config import LossConfig
from train.loss.head_gemms import Fp8HeadGemms, HeadGemms
from train.loss.selector import CandidateSet, selector_loss, selector_ramp
from train.metrics.block_metrics import block_metrics
from train.metrics.logger import StepTotals
from train.metrics.selector_metrics import selector_metrics
from train.optim import WarmupCosine, build_optimizer, optimizer_state_tensors
from train.precision import WorkingWeights, autocast_dtype, compute_autocast, torch_dtype
from train.resolve import ResolvedRun

log = logging.getLogger(__name__)


@dataclass
class StepState:
    """Everything one step touches; built once (build_step_state), every tensor at a fixed address.

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
    candidates: CandidateSet | None = None  # DFlash 2: each slot's top-K, filled by the loss; None = DFlash 1
    head_gemms: HeadGemms | None = None  # the loss's lm_head GEMMs (--fp8 linears+head: FP8); None = plain

    def autocast(self):
        return compute_autocast(self.batch.device, self.autocast_dtype)


def build_step_state(
    cfg: TrainConfig,
    run: ResolvedRun,
    head: dict[str, torch.Tensor],
    device: torch.device,
    rank: int = 0,
    *,
    fp8_emulate: bool = False,
) -> StepState:
    """Everything train_step touches, on `device`: seeded fp32 drafter (rank 0's weights on every rank),
    frozen head in the compute dtype, flat grads, schedule, optimizer, static batch, attention layout,
    totals, the seeded anchor generator, and the elementwise options (working weight copies, compiled
    pointwise regions, FP8 linears). fp8_emulate: --fp8 in torchao's emulation on any device (tests on
    CPU; not a user flag, train/drafter/fp8.py)."""
    compute_dtype = torch_dtype(cfg.compute_dtype)
    if cfg.fp8 == AUTO:  # a library caller's config; dflash-train resolves it before recording the run
        head_shape = tuple(head["lm_head"].shape)
        fp8 = resolve_fp8(
            AUTO,
            device,
            arch=run.drafter.arch,
            compute_dtype=cfg.compute_dtype,
            head_shape=head_shape,
            recipe=cfg.fp8_recipe,
        )
        cfg = replace(cfg, fp8=fp8)
    if cfg.fp8 != "off":  # before any weight is built
        require_fp8(device, emulate=fp8_emulate)
    torch.manual_seed(cfg.seed)  # identical init on every rank; the broadcast makes sure
    # fp32 master weights, built and initialised on the device: at 27B width an initialisation on the
    # CPU and the copy over took ~20 s of every start.
    with torch.device(device):
        model = DFlashDrafter(run.drafter)
    projection = None
    if run.drafter.context_width is not None:  # a projected cache: A = P D, checked against cache.json
        projection = load_projection(cfg.cache, run.cache_config)
        model.context_projection.copy_(applied_matrix(*projection))
    if cfg.drafter.init_from is not None:  # a resumed run overwrites these with its checkpoint's
        load_drafter_weights_(model, cfg.drafter.init_from, projection)
    broadcast_parameters(model)
    if cfg.fp8 != "off":
        float8_linears_(model, cfg.fp8_recipe, emulate=fp8_emulate)
    if cfg.pointwise_compiled(device.type):
        compile_pointwise_(model)
    target_head = TargetHead(head["embed_tokens"].to(device, compute_dtype), head["lm_head"].to(device, compute_dtype))
    params = list(model.parameters())
    grads = FlatGrads(params)
    schedule, optimizer = build_optimizer(
        cfg.optim, params, warmup_steps=run.warmup_steps, total_steps=run.total_steps, device=device
    )
    cc = run.cache_config
    batch = StaticBatch(cc, device, compute_dtype, with_topk=cfg.loss.kl_lambda > 0)
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
        totals=StepTotals(run.drafter.block_size, device),
        loss=cfg.loss,
        grad_clip=cfg.optim.grad_clip,
        metrics_topk=cfg.metrics_topk,
        autocast_dtype=autocast_dtype(compute_dtype),
        generator=generator,
        checkpoint_layers=cfg.checkpoint_layers,
        params=params,
        working_weights=_working_weights(cfg, model, compute_dtype),
        candidates=(
            CandidateSet.empty(
                run.num_blocks,
                run.drafter.block_size,
                run.drafter.selector_top_k,
                cfg.loss.selector_gold,
                device,
                compute_dtype,
            )
            if run.drafter.is_dflash2
            else None
        ),
        head_gemms=Fp8HeadGemms(target_head.lm_head_VH) if cfg.fp8 == "linears+head" else None,
    )


def _working_weights(cfg: TrainConfig, model: DFlashDrafter, compute_dtype: torch.dtype) -> WorkingWeights | None:
    """Copies of the linears that compute in the compute dtype (an FP8 linear is no longer a Linear: it
    casts its master to FP8 itself); None without --weight-copies, in float32, or with no such linear."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not (cfg.weight_copies and autocast_dtype(compute_dtype) is not None and linears):
        return None
    return WorkingWeights(linears, compute_dtype)


def train_step(s: StepState, *, with_metrics: bool) -> None:
    b, drafter = s.batch, s.model.config
    if s.working_weights is not None:
        s.working_weights.refresh()  # this step's weights, rounded once
    blocks = sample_blocks(
        input_ids_T=b.input_ids_T,
        position_ids_T=b.position_ids_T,
        loss_mask_T=b.loss_mask_T,
        cu_seqlens_S1=b.cu_seqlens_S1,
        anchor_mask_T=b.anchor_mask_T,
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
        loss = block_loss(
            hidden_NBH,
            s.head,
            blocks,
            s.loss,
            b.topk_ids_TK,
            b.topk_logprobs_TK,
            s.candidates,
            s.model.logit_transform(),
            s.head_gemms,
        )
        objective = loss.total
        if s.candidates is not None:  # DFlash 2: the selector loss, ramped in over its warm-up
            selector = selector_loss(s.model, hidden_NBH, s.head.lm_head_VH, blocks, s.candidates)
            ramp = selector_ramp(s.schedule.step_t, s.loss.selector_warmup_steps)
            objective = objective + s.loss.selector_weight * ramp * selector
            s.totals.add_metrics({"selector_loss": (selector.detach(), torch.ones_like(selector))})
    objective.backward()
    if with_metrics:
        with s.autocast():
            s.totals.add_metrics(
                block_metrics(
                    hidden_NBH.detach(), s.head, blocks, topk=s.metrics_topk, chunk_blocks=s.loss.chunk_blocks
                )
            )
            if s.candidates is not None:
                s.totals.add_metrics(
                    selector_metrics(s.model, hidden_NBH.detach(), s.head.lm_head_VH, blocks, s.candidates)
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


def _persistent_tensors(s: StepState) -> list[torch.Tensor]:
    return (
        [p.data for p in s.params]
        + optimizer_state_tensors(s.optimizer, s.params)
        + [s.schedule.step_t, s.schedule.lr_t, s.grads.flat]
        + s.totals.tensors()
    )


class StepRunner:
    """Runs train_step eagerly, or replays its captured CUDA graphs."""

    def __init__(
        self, state: StepState, *, cuda_graphs: bool, warmup_iters: int = 3, clock: StartupClock | None = None
    ):
        self.state = state
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        if cuda_graphs:
            self._capture(warmup_iters, clock or StartupClock(state.batch.device))

    def run(self, *, with_metrics: bool) -> None:
        if self.graphs:
            self.graphs[with_metrics].replay()
        else:
            train_step(self.state, with_metrics=with_metrics)

    def _capture(self, warmup_iters: int, clock: StartupClock) -> None:
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
            for i in range(warmup_iters):
                for with_metrics in (False, True):
                    train_step(s, with_metrics=with_metrics)
                if i == 0:  # the first pass compiles (or loads from the compile cache) and tunes
                    clock.mark("compile")
        torch.cuda.current_stream(device).wait_stream(side)
        clock.mark("warmup")
        pool = None
        for with_metrics in (False, True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                train_step(s, with_metrics=with_metrics)
            pool = graph.pool()
            self.graphs[with_metrics] = graph
        torch.cuda.synchronize(device)
        clock.mark("capture")
        for live, saved in zip(_persistent_tensors(s), snapshot):
            live.copy_(saved)
        torch.cuda.set_rng_state(rng, device)
        log.info("step: captured as CUDA graphs (with and without metrics), %d warm-up iterations", warmup_iters)
