"""Typed configuration of a dflash-train run: what the user chose, each field checked on its own.

`TrainConfig` nests one config per component, as torchtitan nests them: the optimizer and schedule
(train/optim.py: OptimConfig), the loss (train/loss/config.py: LossConfig), the held-out evaluation
(train/eval/config.py: TrainEvalConfig) and the drafter's shape (train/drafter/config.py:
DrafterOptions); each validates its own fields. The command line stays flat: every nested field is a
top-level flag (shards.common.cli_options), and run.json and the resume identities record the options
as one flat dict (`to_dict`, `identity`), as before the nesting. Checking the config against a cache
is train/resolve.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shards.common.cli_options import at_least, cli_field, config_error, to_options
from shards.common.compile_cache import CompileCacheConfig
from shards.format import canonical_precision
from train.drafter.config import DrafterOptions
from train.drafter.fp8 import AUTO, FP8_MODES, FP8_RECIPES
from train.eval.config import TrainEvalConfig
from train.loss.config import LossConfig
from train.optim import OptimConfig

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TrainConfig:
    """One training run. Each leaf field is a dflash-train option (shards.common.cli_options: dashes for
    underscores, the docstring is its --help). `identity=False` marks what a resumed run may change: where
    the run reads and writes, how often it logs, saves and evaluates, and how fast it computes the same
    steps; everything else decides the trajectory and must match the checkpoint's."""

    cache: str = cli_field(path="existing_dir", identity=False)
    """Hidden-state cache directory (dflash-extract --out)."""
    out_dir: str = cli_field(flag="--out", path="dir", identity=False)
    """Run directory: checkpoints step-NNNNNNNN/, metrics.jsonl, run.json, eval.json."""
    epochs: int = 6
    """Passes over the training shards (the DFlash recipe trains 6)."""
    max_steps: int = -1
    """Stop after N optimizer steps (one shard per rank per step); -1 = all epochs. Also sets the
    schedule's length."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW, its warmup-cosine schedule and the gradient clip (--lr ... --grad-clip)."""
    seed: int = 0
    """Seed of the weight init, the shard order and the anchor sampling (per rank: seed + rank)."""
    num_blocks: int | None = None
    """Draft blocks (anchors) per packed batch (x block size = query tokens per step). Default: one per
    24 context tokens, rounded to 128-token tiles (2048 for a 49152 budget: fits the 27B-width drafter
    on one H200)."""
    block_size: int | None = None
    """Tokens per draft block: anchor plus block_size-1 MASK slots. Default: the --init-from drafter's, else
    8 for --arch dflash2 (the published DFlash 2 layout) and 16 for dflash (the published DFlash drafters)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Loss weights and chunking (--gamma ... --fused-loss)."""
    metrics_every: int = cli_field(8, identity=False)
    """Monitoring metrics (accuracy, streaks) every N steps; values < 1 are clamped to 1."""
    metrics_topk: int = cli_field(4, identity=False)
    """k of the top-k accuracy and top-k streak metrics."""
    log_every: int = cli_field(10, identity=False)
    """Log (console line + metrics.jsonl) at step 1 and every N steps; each log is one host sync."""
    checkpoint_every: int = cli_field(1000, identity=False)
    """Save step-NNNNNNNN/ every N steps (and at the end); 0 = only at the end."""
    keep_checkpoints: int = cli_field(3, identity=False)
    """Keep the newest N valid checkpoints (and the one a --resume started from), delete older ones; a
    damaged folder is not counted (and left while it is among the newest)."""
    checkpoint_write: Literal["async", "sync"] = cli_field("async", identity=False)
    """async: at a save the loop copies weights and optimizer state into host buffers kept for the run
    (rank 0 only; 12 bytes per parameter: 20.8 GB of page-locked RAM for the 1.73B-parameter 27B drafter)
    and a background thread makes the checkpoint durable while training goes on (the loop is blocked for
    the copy only); sync: the loop writes the files itself and waits for the whole write (no buffers)."""
    resume: bool = cli_field(False, identity=False)
    """Continue from the newest valid checkpoint in --out (refused if the run's settings differ)."""
    cuda_graphs: bool | None = cli_field(None, identity=False)
    """Capture the whole step as one CUDA graph. Default: on with CUDA; ignored on CPU."""
    checkpoint_layers: bool = cli_field(False, identity=False)
    """Recompute each drafter layer in backward (activation checkpointing): same loss and gradients,
    less activation memory for about one more forward; what makes denser anchors fit at 27B width."""
    weight_copies: bool = cli_field(True, identity=False)
    """Keep compute-dtype working copies of the drafter's linear weights, refreshed once per step inside
    the step, instead of autocast casting each fp32 master weight at every use (forward and recompute);
    the same step bit for bit, ~2 bytes per parameter more memory. Only with --compute-dtype bfloat16."""
    fp8: Literal["auto", "off", "linears", "linears+head"] = AUTO
    """FP8 matmuls in training: linears = the drafter's linear layers (fc, q/k/v/o, MLP) run torchao float8
    training, e4m3 forward and e5m2 gradients, over the same fp32 master weights and optimizer; linears+head
    = also the frozen LM head's logits GEMM and its input-gradient GEMM in the loss (e4m3 head, per-tensor
    scales), 1.44x bf16's speed at 27B width; off = bf16. auto = linears+head for a DFlash 1 drafter where
    it runs (a CUDA GPU of compute capability 8.9+, e.g. H100/H200, with torchao: pip install
    'dflash-pipeline[fp8]'; bf16 compute; linears if the LM head's sizes are not multiples of 16), else
    off: on the acceptance testbed's small target FP8-trained drafters are within the seed spread of bf16
    ones (DFlash 2 not yet judged: bf16 unless asked). A resumed run keeps its checkpoint's mode."""
    fp8_recipe: Literal["tensorwise", "rowwise"] = FP8_RECIPES[0]
    """With --fp8: the linears' scaling (torchao's recipes): tensorwise = one scale per tensor (cuBLAS, the
    fastest); rowwise = one per row, e4m3 gradients too, power-of-two scales (CUTLASS, more accurate)."""
    compile_pointwise: bool | None = cli_field(None, identity=False)
    """torch.compile the drafter's pointwise regions (RMSNorm, SwiGLU, RoPE) for the fixed shapes, captured
    with the step (train/drafter/pointwise.py). Default: on with CUDA, off on CPU."""
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    """Block attention backend: flex (CUDA), sdpa (dense mask; CPU, tests); auto = flex on CUDA, sdpa on
    CPU."""
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Activation dtype: bfloat16 (autocast over fp32 master weights; bf16 is taken too) or float32."""
    skip_bad_shards: bool = cli_field(False, identity=False)
    """Skip a shard that fails its checks (counted in the log) instead of stopping the run."""
    verify_checksums: bool = cli_field(True, identity=False)
    """Verify each shard's checksum as it is read (on the loader thread)."""
    eval: TrainEvalConfig = field(default_factory=TrainEvalConfig)
    """Held-out evaluation during the run (--eval-shards ... --eval-tree-budgets)."""
    tensorboard: bool = cli_field(False, identity=False)
    """Also write TensorBoard scalars to OUT/tb (needs the tensorboard package)."""
    device: str = cli_field("auto", identity=False)
    """auto = cuda:LOCAL_RANK when CUDA exists, else cpu."""
    num_buffers: int = cli_field(3, identity=False)
    """Host shard buffers of the background loader (read-ahead = N - 1 shards)."""
    drafter: DrafterOptions = field(default_factory=DrafterOptions)
    """The drafter's shape as far as pinned (--mask-token-id ... --init-from); the rest is derived."""
    compile: CompileCacheConfig = field(default_factory=CompileCacheConfig)
    """Where the step's compiled regions (pointwise, flex attention, loss) persist (--compile-cache DIR)."""

    def __post_init__(self) -> None:
        self.compute_dtype = canonical_precision(self.compute_dtype, ("bfloat16", "float32"))  # bf16 taken too
        at_least(self, 1, "epochs", "metrics_topk", "log_every", "keep_checkpoints", "num_buffers")
        at_least(self, 0, "checkpoint_every", "seed")
        if self.max_steps != -1 and self.max_steps < 1:
            raise config_error(self, "max_steps", "must be >= 1, or -1 for no limit")
        if self.block_size is not None:
            at_least(self, 1, "block_size")
            if self.block_size < 2:
                raise config_error(self, "block_size", "must be >= 2 (an anchor plus at least one draft slot)")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise config_error(self, "num_blocks", "must be >= 1; omit it for the default density")
        if self.metrics_every < 1:
            log.warning("--metrics-every %d < 1: clamped to 1 (metrics every step)", self.metrics_every)
            self.metrics_every = 1
        if self.attention not in ("auto", "flex", "sdpa"):
            raise config_error(self, "attention", "must be auto, flex or sdpa")
        if self.checkpoint_write not in ("async", "sync"):
            raise config_error(self, "checkpoint_write", "must be async or sync")
        if self.fp8 not in (AUTO, *FP8_MODES):
            raise config_error(self, "fp8", f"must be one of {', '.join((AUTO, *FP8_MODES))}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise config_error(self, "fp8_recipe", f"must be one of {', '.join(FP8_RECIPES)}")
        if self.fp8 == "off" and self.fp8_recipe != FP8_RECIPES[0]:  # part of the run's identity: no silent no-op
            raise config_error(
                self, "fp8_recipe", "applies only with --fp8 auto, linears or linears+head; drop it or change --fp8"
            )
        if self.compute_dtype not in ("bfloat16", "float32"):
            raise config_error(self, "compute_dtype", "must be bfloat16 or float32")
        if not Path(self.cache).is_dir():
            raise config_error(self, "cache", "is not a directory; pass the --out of dflash-extract")

    def to_dict(self) -> dict[str, Any]:
        """Every option by its flat name (run.json's "config"), nested configs' fields in place."""
        return to_options(self)

    def identity(self) -> dict[str, Any]:
        """Settings that decide the training trajectory: a resumed run must match them exactly."""
        d = to_options(self, identity_only=True)
        d["betas"] = list(d["betas"])
        return d

    def pointwise_compiled(self, device_type: str) -> bool:
        """Whether --compile-pointwise applies on this device type (unset: on with CUDA)."""
        return bool(self.compile_pointwise) or (self.compile_pointwise is None and device_type == "cuda")

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]
