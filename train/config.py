"""Typed configuration of a dflash-train run, and its resolution against the cache.

`TrainConfig` holds what the user chose and validates each field on its own (__post_init__).
`resolve_run(cfg)` then reads only the cache's JSON and the target head's shapes (no model, no GPU)
and returns a `ResolvedRun`: the drafter shape, the train / held-out shard split and the step
budget, refusing a cache that does not fit the config with both sides named.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shards import CacheConfig, ShardReader, read_cache_config
from shards.common.cli_options import cli_field, config_error, flag_name, shown
from shards.container import read_header
from shards.format import TARGET_HEAD_FILE, canonical_precision, shard_path, target_head_shapes
from train.blocks import default_num_blocks
from train.drafter.config import FULL_ATTENTION, LAYER_TYPES, SLIDING_ATTENTION, DrafterConfig
from train.loss.chunked import LossConfig

log = logging.getLogger(__name__)

# MLP width / hidden of the published Qwen3.5-27B drafter (17408 / 5120); the default for other widths.
_MLP_RATIO = 3.4


@dataclass(kw_only=True)
class TrainConfig:
    """One training run. Each field is a dflash-train option (shards.common.cli_options: dashes for underscores,
    the docstring is its --help)."""

    cache: str = cli_field(path="existing_dir")
    """Hidden-state cache directory (dflash-extract --out)."""
    out_dir: str = cli_field(flag="--out", path="dir")
    """Run directory: checkpoints step-NNNNNNNN/, metrics.jsonl, run.json, eval.json."""
    epochs: int = 6
    """Passes over the training shards (the DFlash recipe trains 6)."""
    max_steps: int = -1
    """Stop after N optimizer steps (one shard per rank per step); -1 = all epochs. Also sets the
    schedule's length."""
    lr: float = 6e-4
    """Peak AdamW learning rate (recipe: 6e-4)."""
    warmup_ratio: float = 0.04
    """Fraction of the steps in linear warmup from 0 to --lr (recipe: 0.04)."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of --lr, reached at the last step (unless the warmup lasts to the end)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (recipe: 0)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW beta1,beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this; 0 = off."""
    seed: int = 0
    """Seed of the weight init, the shard order and the anchor sampling (per rank: seed + rank)."""
    num_blocks: int | None = None
    """Draft blocks (anchors) per packed batch (x block size = query tokens per step). Default: one per
    24 context tokens, rounded to 128-token tiles (2048 for a 49152 budget: fits the 27B-width drafter
    on one H200)."""
    block_size: int = 16
    """Tokens per draft block: anchor plus block_size-1 MASK slots (published drafters: 16)."""
    gamma: float = 7.0
    """Loss decay: slot k is weighted exp(-(k-1)/gamma) (recipe: 7 for block 16)."""
    kl_lambda: float = 0.0
    """Weight of KL(target || drafter) on the cache's stored target top-k; 0 = off."""
    cap_lambda: float = 0.0
    """Weight of the CAP term (minus expected accepted length / (block_size-1)); 0 = off."""
    loss_chunk_blocks: int = 32
    """Blocks per LM-head chunk of the loss and metrics (memory: blocks x block size x vocab x 4 bytes
    per live copy)."""
    metrics_every: int = 8
    """Monitoring metrics (accuracy, streaks) every N steps; values < 1 are clamped to 1."""
    metrics_topk: int = 4
    """k of the top-k accuracy and top-k streak metrics."""
    log_every: int = 10
    """Log (console line + metrics.jsonl) at step 1 and every N steps; each log is one host sync."""
    checkpoint_every: int = 1000
    """Save step-NNNNNNNN/ every N steps (and at the end); 0 = only at the end."""
    keep_checkpoints: int = 3
    """Keep the newest N valid checkpoints (and the one a --resume started from), delete older ones; a
    damaged folder is not counted (and left while it is among the newest)."""
    checkpoint_write: Literal["async", "sync"] = "async"
    """async: at a save the loop copies weights and optimizer state into host buffers kept for the run
    (rank 0 only; 12 bytes per parameter: 20.8 GB of page-locked RAM for the 1.73B-parameter 27B drafter)
    and a background thread makes the checkpoint durable while training goes on (the loop is blocked for
    the copy only); sync: the loop writes the files itself and waits for the whole write (no buffers)."""
    resume: bool = False
    """Continue from the newest valid checkpoint in --out (refused if the run's settings differ)."""
    cuda_graphs: bool | None = None
    """Capture the whole step as one CUDA graph. Default: on with CUDA; ignored on CPU."""
    checkpoint_layers: bool = False
    """Recompute each drafter layer in backward (activation checkpointing): same loss and gradients,
    less activation memory for about one more forward; what makes denser anchors fit at 27B width."""
    weight_copies: bool = True
    """Keep compute-dtype working copies of the drafter's linear weights, refreshed once per step inside
    the step, instead of autocast casting each fp32 master weight at every use (forward and recompute);
    the same step bit for bit, ~2 bytes per parameter more memory. Only with --compute-dtype bfloat16."""
    fused_loss: bool = True
    """Loss chunks take a hand-written gradient (train/loss/fused.py): one reduction and one pointwise
    pass over the bf16 logits (two compiled kernels on CUDA) instead of float32 log-softmax under
    autograd; the same loss and gradients to float32 rounding."""
    compile_pointwise: bool | None = None
    """torch.compile the drafter's pointwise regions (RMSNorm, SwiGLU, RoPE) for the fixed shapes, captured
    with the step (train/drafter/pointwise.py). Default: on with CUDA, off on CPU."""
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    """Block attention backend: flex (CUDA), sdpa (dense mask; CPU, tests); auto = flex on CUDA, sdpa on
    CPU."""
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Activation dtype: bfloat16 (autocast over fp32 master weights; bf16 is taken too) or float32."""
    skip_bad_shards: bool = False
    """Skip a shard that fails its checks (counted in the log) instead of stopping the run."""
    verify_checksums: bool = True
    """Verify each shard's checksum as it is read (on the loader thread)."""
    eval_shards: int = 0
    """Hold out the last N shards of the cache (highest batch ids) for evaluation; never trained on."""
    eval_every: int = 0
    """Evaluate on the held-out shards every N steps; 0 = at the end of every epoch (with --eval-shards > 0; also before training and at the end)."""
    eval_max_shards: int = 8
    """Evaluate on at most this many held-out shards each time."""
    eval_tree_budgets: list[int] = field(default_factory=list)
    """DDTree node budgets the in-training evaluation also walks, e.g. 16,32,64 (each costs about one
    more chain walk per shard). Default: none, the chain walk only (dflash-train eval walks 16,32,64
    by default)."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to OUT/tb (needs the tensorboard package)."""
    device: str = "auto"
    """auto = cuda:LOCAL_RANK when CUDA exists, else cpu."""
    num_buffers: int = 3
    """Host shard buffers of the background loader (read-ahead = N - 1 shards)."""
    mask_token_id: int | None = None
    """MASK token id of the drafter. Default: the cache's (cache.json mask_token_id; 248070 for
    Qwen3.5)."""
    tap_layer_ids: list[int] | None = cli_field(None, flag="--taps")
    """Expected tapped target layers, e.g. 1,16,31,46,61; refused if the cache differs. Default: whatever
    the cache holds."""
    num_layers: int | None = None
    """Drafter decoder layers. Default: 5, or as many as --layer-types names (or the --init-from
    drafter's)."""
    intermediate_size: int | None = None
    """Drafter MLP width. Default: the target's, from cache.json (17408 for Qwen3.5-27B), as DFlash
    drafters copy it."""
    num_attention_heads: int | None = None
    """Drafter query heads (give with --num-key-value-heads and --head-dim). Default: derived from the
    width (32 for a 5120-wide target, else width / head dim)."""
    num_key_value_heads: int | None = None
    """Drafter key/value heads. Default: derived from the width (8 at 5120, else a quarter of the query
    heads)."""
    head_dim: int | None = None
    """Drafter head dim. Default: derived from the width (128 from width 1024 up, width / 8 below)."""
    rope_theta: float | None = None
    """RoPE base of the drafter. Default: 1e7, as Qwen3.5 targets (or the --init-from drafter's)."""
    layer_types: list[str] | None = None
    """Per drafter layer full or sliding (e.g. sliding,sliding,sliding,sliding,full: the published
    Qwen3.6-27B layout). Sliding layers are causal with a window (train/drafter/attention.py). Default: all full
    (or the --init-from drafter's)."""
    sliding_window: int | None = None
    """Tokens a sliding layer's query sees, itself included (published 27B: 2048); needed iff a layer
    slides. Default: none (or the --init-from drafter's)."""
    init_from: str | None = cli_field(None, path="existing_dir")
    """Start from this exported or published DFlashDraftModel directory (config.json + safetensors) instead
    of random weights; its shape is used (shape options may stay unset or must agree) and it must fit the
    cache (hidden size, taps, target layers, vocab, mask id) and --block-size. Default: random init."""

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)
        self.compute_dtype = canonical_precision(self.compute_dtype, ("bfloat16", "float32"))  # bf16 taken too
        if self.tap_layer_ids is not None:
            self.tap_layer_ids = [int(t) for t in self.tap_layer_ids]
        _positive_ints(
            self,
            "epochs",
            "block_size",
            "loss_chunk_blocks",
            "metrics_topk",
            "log_every",
            "keep_checkpoints",
            "num_buffers",
            "eval_max_shards",
        )
        if self.num_layers is not None:
            _positive_ints(self, "num_layers")
        if self.rope_theta is not None and not self.rope_theta > 1:
            raise config_error(self, "rope_theta", "must be > 1; omit it for 1e7")
        _nonnegative_ints(self, "checkpoint_every", "eval_shards", "eval_every", "seed")
        self.eval_tree_budgets = [int(b) for b in self.eval_tree_budgets or ()]  # the CLI passes None for []
        if any(b < 1 for b in self.eval_tree_budgets):
            raise config_error(self, "eval_tree_budgets", "must be positive node counts")
        if self.max_steps != -1 and self.max_steps < 1:
            raise config_error(self, "max_steps", "must be >= 1, or -1 for no limit")
        if not self.lr > 0:
            raise config_error(self, "lr", "must be > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise config_error(self, "warmup_ratio", "must be in [0, 1), a fraction of the steps")
        if not 0 <= self.min_lr_ratio <= 1:
            raise config_error(self, "min_lr_ratio", "must be in [0, 1], a fraction of --lr")
        if self.weight_decay < 0:
            raise config_error(self, "weight_decay", "must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise config_error(self, "betas", "must be two values in [0, 1), e.g. --betas 0.9,0.999")
        if not self.adam_eps > 0:
            raise config_error(self, "adam_eps", "must be > 0")
        if self.grad_clip < 0:
            raise config_error(self, "grad_clip", "must be >= 0 (0 = off)")
        if self.block_size < 2:
            raise config_error(self, "block_size", "must be >= 2 (an anchor plus at least one draft slot)")
        if not self.gamma > 0:
            raise config_error(self, "gamma", "must be > 0")
        for name in ("kl_lambda", "cap_lambda"):
            if getattr(self, name) < 0:
                raise config_error(self, name, "must be >= 0 (0 = off)")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise config_error(self, "num_blocks", "must be >= 1; omit it for the default density")
        if self.metrics_every < 1:
            log.warning("--metrics-every %d < 1: clamped to 1 (metrics every step)", self.metrics_every)
            self.metrics_every = 1
        if self.attention not in ("auto", "flex", "sdpa"):
            raise config_error(self, "attention", "must be auto, flex or sdpa")
        if self.checkpoint_write not in ("async", "sync"):
            raise config_error(self, "checkpoint_write", "must be async or sync")
        if self.compute_dtype not in ("bfloat16", "float32"):
            raise config_error(self, "compute_dtype", "must be bfloat16 or float32")
        for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "mask_token_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < (0 if name == "mask_token_id" else 1)):
                raise config_error(self, name, "must be a positive integer; omit it for the default")
        heads = ("num_attention_heads", "num_key_value_heads", "head_dim")
        given = [getattr(self, h) is not None for h in heads]
        if any(given) and not all(given):
            flags = ", ".join(f"{flag_name(TrainConfig, h)} {shown(getattr(self, h))}" for h in heads)
            raise ValueError(
                f"{flags}: give the three together or none of them (then they are derived from the target's width)"
            )
        # Messages quote --layer-types as the user typed it (sliding,full), not as normalised below.
        self._layer_types_typed = shown(self.layer_types)
        layer_types_given = f"--layer-types {self._layer_types_typed}"
        if self.layer_types is not None:
            aliases = {"full": FULL_ATTENTION, "sliding": SLIDING_ATTENTION}
            self.layer_types = [aliases.get(str(t).strip(), str(t).strip()) for t in self.layer_types]
            unknown = [t for t in self.layer_types if t not in LAYER_TYPES]
            if not self.layer_types or unknown:
                what = f"{', '.join(map(repr, unknown))} is not a layer type" if unknown else "names no layer"
                raise ValueError(
                    f"{layer_types_given}: {what}; give full or sliding (or {' / '.join(LAYER_TYPES)}) per "
                    "layer, e.g. --layer-types sliding,sliding,sliding,sliding,full"
                )
            if self.num_layers is not None and len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"{layer_types_given}: {len(self.layer_types)} entries for --num-layers {self.num_layers}; "
                    f"give one per layer (or --num-layers {len(self.layer_types)})"
                )
        sliding = self.layer_types is not None and SLIDING_ATTENTION in self.layer_types
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool) or self.sliding_window < 1
        ):
            raise config_error(self, "sliding_window", "must be a positive number of tokens; omit it for none")
        if sliding and self.sliding_window is None and self.init_from is None:
            raise ValueError(
                f"{layer_types_given}: has sliding layers but --sliding-window is not set; pass "
                "--sliding-window TOKENS (the published 27B drafter uses 2048)"
            )
        if self.sliding_window is not None and self.layer_types is not None and not sliding:
            raise config_error(
                self,
                "sliding_window",
                f"would be ignored: {layer_types_given} has no sliding layer; drop --sliding-window "
                "or make a layer sliding",
            )
        if self.init_from is not None and not Path(self.init_from).is_dir():
            raise config_error(
                self,
                "init_from",
                "is not a directory (an exported or published DFlashDraftModel: config.json + safetensors)",
            )
        if not Path(self.cache).is_dir():
            raise config_error(self, "cache", "is not a directory; pass the --out of dflash-extract")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def identity(self) -> dict[str, Any]:
        """Settings that decide the training trajectory: a resumed run must match them exactly."""
        d = self.to_dict()
        for name in (
            "out_dir",
            "resume",
            "log_every",
            "checkpoint_every",
            "keep_checkpoints",
            "checkpoint_write",
            "tensorboard",
            "num_buffers",
            "eval_every",
            "eval_max_shards",
            "eval_tree_budgets",
            "verify_checksums",
            "device",
            "cache",
            "metrics_every",
            "metrics_topk",
            "skip_bad_shards",
            "cuda_graphs",
            "checkpoint_layers",
            "weight_copies",
            "fused_loss",
            "compile_pointwise",
        ):
            d.pop(name)
        d["betas"] = list(d["betas"])
        return d

    def pointwise_compiled(self, device_type: str) -> bool:
        """Whether --compile-pointwise applies on this device type (unset: on with CUDA)."""
        return bool(self.compile_pointwise) or (self.compile_pointwise is None and device_type == "cuda")

    def loss_config(self) -> LossConfig:
        """The loss settings of this run (LossConfig owns them from here on)."""
        return LossConfig(
            gamma=self.gamma,
            kl_lambda=self.kl_lambda,
            cap_lambda=self.cap_lambda,
            chunk_blocks=self.loss_chunk_blocks,
            fused=self.fused_loss,
        )

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]


def resolved_identity(cfg: TrainConfig, run: ResolvedRun) -> dict[str, Any]:
    """cfg.identity() with every option the cache or --init-from resolves (unset = derived) replaced by
    the value it resolved to: what a resume compares, so an unset flag and its resolved value given
    explicitly are the same run, and a cache whose MASK id (or taps) changed under an unset flag is not."""
    identity = cfg.identity()
    drafter = dataclasses.asdict(run.drafter)
    for name in identity.keys() & drafter.keys():
        identity[name] = drafter[name]
    identity["num_blocks"] = run.num_blocks
    if run.init_fingerprint is not None:  # the drafter's content, not the path it was read from
        identity["init_from"] = run.init_fingerprint
    return json.loads(json.dumps(identity))  # as train_state.json holds it: tuples as lists


def _positive_ints(cfg: TrainConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise config_error(cfg, name, "must be an integer >= 1")


def _nonnegative_ints(cfg: TrainConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 0:
            raise config_error(cfg, name, "must be an integer >= 0")


@dataclass(kw_only=True)
class ResolvedRun:
    """What a TrainConfig means for one cache: everything the loop needs before touching a model."""

    cache_config: CacheConfig
    drafter: DrafterConfig
    num_blocks: int
    train_ids: list[int]  # batch ids trained on
    eval_ids: list[int]  # held-out batch ids (never trained on)
    steps_per_epoch: int  # per rank: each step reads one shard on every rank
    total_steps: int  # optimizer steps of the whole run (the schedule's length)
    warmup_steps: int
    init_fingerprint: str | None = None  # export.drafter_fingerprint of --init-from


def planned_batch_ids(cache_cfg: CacheConfig, cache_dir: str | Path) -> list[int]:
    """Every planned shard's batch id, not just the files present (the shards the cache files, when
    cache.json records no plan): the train / held-out split of training and `eval --eval-shards`, so a
    missing file is refused by name (or skipped under --skip-bad-shards) instead of shifting the split."""
    planned = cache_cfg.planned_batches
    return list(range(planned)) if isinstance(planned, int) else ShardReader(cache_dir).batch_ids()


def default_intermediate_size(hidden_size: int) -> int:
    """For caches that do not record the target's MLP width: the 27B's, else ~3.4 x hidden."""
    if hidden_size == 5120:
        return 17408
    return int(math.ceil(hidden_size * _MLP_RATIO / 64) * 64)


def resolve_run(cfg: TrainConfig, world_size: int = 1) -> ResolvedRun:
    """Check the cache against the config and derive the run's shapes and step budget."""
    cache_cfg = read_cache_config(cfg.cache)
    _check_taps(cfg, cache_cfg)
    _check_target_head(cfg.cache, cache_cfg)
    if cfg.kl_lambda > 0 and cache_cfg.target_topk == 0:
        raise ValueError(
            f"--kl-lambda {cfg.kl_lambda} needs a cache with --target-topk > 0, but cache {cfg.cache} "
            "stores no target top-k; re-extract with --target-topk 8 or pass --kl-lambda 0"
        )
    mask_token_id = cfg.mask_token_id if cfg.mask_token_id is not None else cache_cfg.mask_token_id
    target = cache_cfg.target
    if mask_token_id is not None and not 0 <= mask_token_id < target.vocab_size:
        given = (
            f"--mask-token-id {mask_token_id}"
            if cfg.mask_token_id is not None
            else (f"cache {cfg.cache} records mask_token_id {mask_token_id} (cache.json) and --mask-token-id is unset:")
        )
        raise ValueError(
            f"{given} outside the target's vocabulary [0, {target.vocab_size}); pass --mask-token-id with the "
            f"target's MASK token (248070 for Qwen3.5)"
        )
    token_ids = {name: getattr(target, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if cfg.init_from is not None:
        drafter = _drafter_from_init(cfg, cache_cfg, mask_token_id)
        # The target's own ids win over whatever the published drafter recorded.
        drafter = drafter.replace(**{k: v for k, v in token_ids.items() if v is not None})
    else:
        if mask_token_id is None:
            raise ValueError(
                f"no MASK token id: cache {cfg.cache} records none (cache.json mask_token_id null); "
                "pass --mask-token-id (248070 for Qwen3.5)"
            )
        try:
            drafter = DrafterConfig.for_target(
                hidden_size=target.hidden_size,
                intermediate_size=(
                    cfg.intermediate_size or target.intermediate_size or default_intermediate_size(target.hidden_size)
                ),
                vocab_size=target.vocab_size,
                num_target_layers=target.num_layers,
                tap_layer_ids=list(cache_cfg.tap_layer_ids),
                mask_token_id=mask_token_id,
                **_shape_options(cfg),
            )
            if cfg.num_attention_heads is not None:
                try:
                    drafter = drafter.replace(
                        num_attention_heads=cfg.num_attention_heads,
                        num_key_value_heads=cfg.num_key_value_heads,
                        head_dim=cfg.head_dim,
                    )
                except ValueError as e:
                    raise ValueError(
                        f"--num-attention-heads {cfg.num_attention_heads} --num-key-value-heads "
                        f"{cfg.num_key_value_heads} --head-dim {cfg.head_dim}: {e}; pick query heads "
                        "divisible by the kv heads and an even head dim, or omit all three"
                    ) from e
            drafter = drafter.replace(**token_ids)
        except ValueError as e:
            raise ValueError(f"drafter shape for cache {cfg.cache}: {e}") from e

    num_blocks = cfg.num_blocks or default_num_blocks(cache_cfg.token_budget, cfg.block_size)
    if num_blocks > cache_cfg.token_budget:
        raise ValueError(
            f"--num-blocks {num_blocks} exceeds the cache's --token-budget {cache_cfg.token_budget} "
            f"(one anchor per token at most); pass a smaller --num-blocks or omit it"
        )
    all_ids = planned_batch_ids(cache_cfg, cfg.cache)
    _check_shards_present(cfg, all_ids)
    if cfg.eval_shards >= len(all_ids):
        raise ValueError(
            f"--eval-shards {cfg.eval_shards} leaves no training shards: cache "
            f"{cfg.cache} has {len(all_ids)}; pass --eval-shards {max(0, len(all_ids) - 1)} or fewer"
        )
    train_ids = all_ids[: len(all_ids) - cfg.eval_shards]
    eval_ids = all_ids[len(train_ids) :]
    steps_per_epoch = len(train_ids) // world_size
    if steps_per_epoch < 1:
        raise ValueError(
            f"cache {cfg.cache} has {len(train_ids)} training shards, fewer than the "
            f"{world_size} ranks: every rank needs at least one shard per epoch"
        )
    total_steps = cfg.epochs * steps_per_epoch
    if cfg.max_steps != -1:
        total_steps = min(total_steps, cfg.max_steps)
    return ResolvedRun(
        cache_config=cache_cfg,
        drafter=drafter,
        num_blocks=num_blocks,
        train_ids=train_ids,
        eval_ids=eval_ids,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        warmup_steps=int(math.ceil(cfg.warmup_ratio * total_steps)),
        init_fingerprint=_init_fingerprint(cfg),
    )


# TrainConfig shape options that DrafterConfig.for_target takes under the same names.
_FOR_TARGET_OPTIONS = ("num_layers", "block_size", "rope_theta", "layer_types", "sliding_window")


def _shape_options(cfg: TrainConfig) -> dict[str, Any]:
    """The shape options given, for DrafterConfig.for_target (its defaults for the rest); --layer-types
    alone sets the layer count."""
    given = {name: getattr(cfg, name) for name in _FOR_TARGET_OPTIONS if getattr(cfg, name) is not None}
    if cfg.layer_types is not None:
        given.setdefault("num_layers", len(cfg.layer_types))
    return given


# TrainConfig shape fields that --init-from takes from the drafter's config.json (and DrafterConfig names).
_INIT_SHAPE_FIELDS = {
    "num_layers": "num_layers",
    "intermediate_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "rope_theta": "rope_theta",
    "layer_types": "layer_types",
    "sliding_window": "sliding_window",
}


def _init_fingerprint(cfg: TrainConfig) -> str | None:
    from train.checkpoint.export import drafter_fingerprint

    return None if cfg.init_from is None else drafter_fingerprint(cfg.init_from)


def _drafter_from_init(cfg: TrainConfig, cache_cfg: CacheConfig, mask_token_id: int | None) -> DrafterConfig:
    """The --init-from drafter's shape, refused (every differing field named) when it does not fit."""
    from train.checkpoint.export import (  # export imports the model: imported here
        check_weight_files,
        read_drafter_config,
    )

    try:
        drafter = read_drafter_config(cfg.init_from, mask_token_id=mask_token_id)
        check_weight_files(cfg.init_from)  # a cut-short file refused now, not after the model is built
    except (OSError, ValueError) as e:
        raise ValueError(f"--init-from {cfg.init_from}: {e}") from e
    target = cache_cfg.target
    problems = []
    for option, field_name in _INIT_SHAPE_FIELDS.items():
        ours, theirs = getattr(cfg, option), getattr(drafter, field_name)
        if ours is not None and ours != theirs:
            flag = flag_name(TrainConfig, option)
            typed = cfg._layer_types_typed if option == "layer_types" else shown(ours)
            problems.append(f"{flag} {typed}: the drafter has {shown(theirs)} (drop {flag})")
    for name, theirs, cache_value in (
        ("hidden_size", drafter.hidden_size, target.hidden_size),
        ("tap_layer_ids", drafter.tap_layer_ids, list(cache_cfg.tap_layer_ids)),
        ("num_target_layers", drafter.num_target_layers, target.num_layers),
        ("vocab_size", drafter.vocab_size, target.vocab_size),
    ):
        if theirs != cache_value:
            problems.append(f"{name}: drafter {theirs!r}, cache {cache_value!r}")
    if drafter.block_size != cfg.block_size:
        problems.append(
            f"block_size: drafter {drafter.block_size}, this run {cfg.block_size} "
            f"(pass --block-size {drafter.block_size})"
        )
    if mask_token_id is not None and drafter.mask_token_id != mask_token_id:
        problems.append(f"mask_token_id: drafter {drafter.mask_token_id}, cache/run {mask_token_id}")
    if problems:
        raise ValueError(f"--init-from {cfg.init_from} does not fit cache {cfg.cache}: " + "; ".join(problems))
    return drafter


def _check_shards_present(cfg: TrainConfig, batch_ids: list[int]) -> None:
    """Every planned shard's file is there (a stat each, before any model or buffer): an unfinished or
    damaged cache is refused now, not at the first step that reads a missing shard."""
    missing = [b for b in batch_ids if not shard_path(cfg.cache, b).is_file()]
    if missing and not cfg.skip_bad_shards:
        raise ValueError(
            f"cache {cfg.cache}: {len(missing)} of its {len(batch_ids)} planned shards are missing (e.g. "
            f"{shard_path(cfg.cache, missing[0])}); finish the cache (re-run its dflash-extract command: "
            "`dflash-shards verify` prints it), or pass --skip-bad-shards to train on the rest"
        )


def _check_taps(cfg: TrainConfig, cache_cfg: CacheConfig) -> None:
    if cfg.tap_layer_ids is not None and list(cfg.tap_layer_ids) != list(cache_cfg.tap_layer_ids):
        raise ValueError(
            f"--taps {shown(cfg.tap_layer_ids)}: the run expects layers {cfg.tap_layer_ids}, cache "
            f"{cfg.cache} holds {cache_cfg.tap_layer_ids}; re-extract with these --taps or drop --taps"
        )


def _check_target_head(cache_dir: str, cache_cfg: CacheConfig) -> None:
    """The stored target head must have the [vocab, hidden] shapes cache.json declares (header only)."""
    path = Path(cache_dir) / TARGET_HEAD_FILE
    if not path.is_file():
        raise ValueError(f"{path}: not found; the cache has no target head (re-run dflash-extract)")
    entries = read_header(path).entries
    vocab, hidden = cache_cfg.target.vocab_size, cache_cfg.target.hidden_size
    for name, shape in target_head_shapes(cache_cfg.target).items():
        if name not in entries:
            raise ValueError(f"{path}: tensor {name} missing; expected shape {shape}")
        if tuple(entries[name].shape) != shape:
            raise ValueError(
                f"{path}: tensor {name} has shape {tuple(entries[name].shape)}, but cache.json "
                f"declares target vocab {vocab} x hidden {hidden}, i.e. {shape}"
            )
