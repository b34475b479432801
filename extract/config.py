"""dflash-extract's settings, checked before any model loads or GPU is touched.

Each field is a dflash-extract option (shards.common.cli_options: dashes for underscores, the docstring is
its --help); a bad value is refused naming the flag and the value given.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from extract.chats.prepare import Thinking
from extract.dataset.index import LONG_SEQ_POLICIES, LongSeqPolicy
from extract.dataset.packing import PackingConfig
from extract.drafter_taps import read_drafter_taps
from shards.common.chat_mode import parse_template_kwargs
from shards.common.cli_options import cli_field, config_error
from shards.common.compile_cache import CompileCacheConfig
from shards.format import (
    PROJECTION_NORMALIZE,
    STORAGE_DTYPES,
    ProjectionNormalize,
    StorageDtype,
    canonical_precision,
)
from shards.sample_ids import MAX_SHARD_SAMPLES

# torch's names for what the target runs in; --storage names the cache encoding (shards/format.py says why two).
TargetDtype = Literal["bfloat16", "float16", "float32"]
DTYPES = get_args(TargetDtype)
# How the target's linear layers run: "dense" (matmuls in --dtype) or "fp8" (e4m3 matmuls).
ComputeMode = Literal["dense", "fp8"]
COMPUTE_MODES = get_args(ComputeMode)


# The projection estimate's settings where neither given nor taken from --pca-from's cache.
ESTIMATE_DEFAULTS = {"pca_normalize": "per-tap", "pca_sample_tokens": 262144, "pca_seed": 0}


@dataclass(kw_only=True)
class ExtractConfig:
    """One extraction run: target x dataset -> cache."""

    target: str = cli_field(path="existing_dir")
    """HF checkpoint directory of the Qwen3.5-style target (config.json + *.safetensors)."""
    data: str
    """Parquet or JSON Lines file, directory or glob; rows hold input_ids, optional loss_mask (0/1)
    and id. Or conversations (OpenAI messages or ShareGPT, also .json): rendered on the fly with the
    target's chat template and loss mask, as dflash-data prepare does."""
    thinking: Thinking | None = None
    """Conversations in --data only: render them as served with thinking on or off (as dflash-data
    prepare --thinking). Default: on. Refused with token rows."""
    template_kwargs: list[str] = cli_field(flag="--template-kwarg", repeat=True, default_factory=list)
    """Another chat-template keyword of the serving mode, KEY=VALUE (JSON scalar, else text), repeatable:
    e.g. --template-kwarg reasoning_effort=high. Conversations in --data only. Default: none."""
    out_dir: str = cli_field(flag="--out", path="dir")
    """Cache directory to create, or to resume when it exists."""
    tap_layer_ids: list[int] | None = cli_field(None, flag="--taps")
    """Target layers to store, e.g. 1,16,31,46,61 (tap j = output of layer j). Default: DFlash's spread
    for --num-taps."""
    taps_from: str | None = cli_field(None, path="existing_dir", identity=False)
    """Drafter directory whose taps to extract (its config.json's dflash_config.target_layer_ids), so the
    cache fits the drafter to fine-tune with dflash-train --init-from. Refused with --taps. Default: none."""
    num_taps: int = 5
    """Number of taps when --taps is not given: round(1 + i*(N-4)/(L-1))."""
    storage_dtype: StorageDtype = cli_field("bf16", flag="--storage")
    """Hidden-state storage: bf16 (2 bytes per value; bfloat16 is taken too), or fp8 e4m3 with a
    per-token-per-tap scale (half the disk; the acceptance table's fp8-storage row measured no loss beyond
    the seed spread: BENCHMARKS.md, Acceptance by numerics choice)."""
    pca_rank: int = 0
    """Store R codes per token instead of the taps: z = P D h of the concatenated taps h (P: the top-R
    principal directions, uncentred, estimated from a sample of the dataset; --storage is the codes' dtype,
    fp8 with one scale per --pca-group-size codes). A drafter trained on them exports exactly (fc = fc' P D).
    E.g. 3200 = 1/8 of 5 taps x 5120. 0 = store the taps."""
    pca_normalize: ProjectionNormalize | None = None
    """The fixed scaling D before the projection: per-tap (each tap divided by its rms over the sample, so
    the deep taps' massive activations do not take the leading components) or none. Default: per-tap;
    with --pca-from, the source cache's."""
    pca_group_size: int = 64
    """fp8 codes: one fp32 scale per this many consecutive codes (4 / G bytes per code on top of 1)."""
    pca_sample_tokens: int | None = None
    """Tokens whose taps estimate P: whole batches drawn at random (seeded) across the dataset. Default:
    262144; with --pca-from, the source cache's."""
    pca_seed: int | None = None
    """Seed of the batches drawn for the estimate. Default: 0; with --pca-from, the source cache's."""
    pca_from: str | None = cli_field(None, path="existing_dir")
    """Take the projection of this projected cache of the same target (same taps) instead of estimating one:
    a held-out cache whose codes a drafter trained on that cache reads. Its rank, scaling and sample settings
    come with it; one given here that differs is refused. Default: estimate."""
    target_topk: int = 0
    """Also store the target's top-K next tokens and log-probs per position (for KL training); 0 = off."""
    # The packing defaults are PackingConfig's: written once, there.
    token_budget: int = PackingConfig.token_budget
    """Tokens per packed batch and shard, real plus padding."""
    max_seqs: int = PackingConfig.max_seqs
    """Most sequences per packed batch."""
    long_seqs: LongSeqPolicy = PackingConfig.long_seqs
    """Samples longer than the token budget: cut (truncate), drop and count (skip) or refuse (error)."""
    pad_token_id: int = PackingConfig.pad_token_id
    """Token id written on padding positions."""
    max_seq_len: int | None = PackingConfig.max_seq_len
    """Run samples up to this many tokens through the target whole (one sequence, a forward of its own)
    and store those longer than --token-budget as overlapping pieces; --long-seqs applies past it.
    Default: --token-budget (no pieces)."""
    piece_context: int = PackingConfig.piece_context
    """With --max-seq-len: tokens each piece keeps before its own anchors, the longest sliding window a
    drafter trained on the cache may have (drafters with a full-attention layer need whole samples)."""
    piece_label_reach: int = PackingConfig.piece_label_reach
    """With --max-seq-len: tokens each piece keeps after its own anchors, the labels of a block of up to
    this + 1 tokens (dflash-train --block-size)."""
    mask_token_id: int | None = None
    """The drafter's MASK token id, recorded in the cache (248070 for Qwen3.5; dflash-train can
    override it). Default: none recorded, and dflash-train then needs its own --mask-token-id."""
    dtype: TargetDtype = "bfloat16"
    """Dtype the target runs in."""
    compute: ComputeMode = "dense"
    """The target's linear layers: dense (matmuls in --dtype) or fp8 (e4m3 matmuls: per-token and
    per-channel scales on a bf16 checkpoint, sm_89+; an FP8 checkpoint's own 128x128 block scales,
    Hopper only; needs --dtype bfloat16; hidden states differ by a few percent; the acceptance table's
    fp8-compute row measured no acceptance loss beyond the seed spread: BENCHMARKS.md)."""
    device: str = "auto"
    """auto = cuda:LOCAL_RANK when CUDA exists, else cpu; or cpu, cuda, cuda:N."""
    allow_slow_kernels: bool = False
    """Permit torch fallbacks on CUDA when fla-core / causal-conv1d are missing (10-50x slower for the
    GDN layers)."""
    overwrite: bool = False
    """Delete an existing cache at --out and start over."""
    fast_resume: bool = False
    """On resume, check existing shards' headers only instead of their checksums."""
    topk_chunk_tokens: int = 4096
    """Tokens per LM-head chunk when --target-topk > 0 (memory: N x vocab x 4 bytes)."""
    progress_interval_s: float = cli_field(10.0, flag="--progress-interval")
    """Seconds between progress lines (0 = after every batch)."""
    writer_buffers: int = 2
    """Pinned host buffers cycling between the forward and the writer thread."""
    compile: CompileCacheConfig = field(default_factory=CompileCacheConfig)
    """Where the compiled pointwise functions and tuned Triton kernels persist (--compile-cache DIR)."""

    def __post_init__(self) -> None:
        # Either spelling of bf16 is taken; the canonical one is stored (shards/format.py says why two).
        self.storage_dtype = canonical_precision(self.storage_dtype, STORAGE_DTYPES)
        self.dtype = canonical_precision(self.dtype, DTYPES)
        if self.storage_dtype not in STORAGE_DTYPES:
            raise config_error(self, "storage_dtype", f"must be one of {', '.join(STORAGE_DTYPES)}")
        if self.long_seqs not in LONG_SEQ_POLICIES:
            raise config_error(self, "long_seqs", f"must be one of {', '.join(LONG_SEQ_POLICIES)}")
        if self.dtype not in DTYPES:
            raise config_error(self, "dtype", f"must be one of {', '.join(DTYPES)}")
        if self.compute not in COMPUTE_MODES:
            raise config_error(self, "compute", f"must be one of {', '.join(COMPUTE_MODES)}")
        if self.thinking not in (None, *get_args(Thinking)):
            raise config_error(self, "thinking", f"must be one of {', '.join(get_args(Thinking))}")
        if self.compute == "fp8" and self.dtype != "bfloat16":
            raise config_error(self, "dtype", "must be bfloat16 with --compute fp8 (the FP8 matmuls write bf16)")
        if self.pca_normalize not in (None, *PROJECTION_NORMALIZE):
            raise config_error(self, "pca_normalize", f"must be one of {', '.join(PROJECTION_NORMALIZE)}")
        if self.pca_rank < 0:
            raise config_error(self, "pca_rank", "must be >= 0 (0 = store the taps)")
        if self.pca_rank == 0 and self.pca_from is None:  # a projection setting alone would be silently ignored
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for name in ("pca_normalize", "pca_group_size", "pca_sample_tokens", "pca_seed"):
                if getattr(self, name) != defaults[name]:
                    raise config_error(
                        self,
                        name,
                        "applies to projected caches only: add --pca-rank R (or --pca-from CACHE), or drop it",
                    )
        elif self.pca_from is None:  # an estimate of our own; --pca-from's source fills in what is not given
            for name, default in ESTIMATE_DEFAULTS.items():
                if getattr(self, name) is None:
                    setattr(self, name, default)
        for name in (
            "num_taps",
            "token_budget",
            "max_seqs",
            "topk_chunk_tokens",
            "writer_buffers",
            "pca_group_size",
            "pca_sample_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:  # None: --pca-from's source says
                raise config_error(self, name, "must be >= 1")
        if min(self.max_seqs, self.token_budget) > MAX_SHARD_SAMPLES:  # a shard holds at most token_budget samples
            raise config_error(
                self,
                "max_seqs",
                f"must be <= {MAX_SHARD_SAMPLES}: a shard's header holds every sample's id and must stay within what "
                "its reader accepts",
            )
        if self.target_topk < 0:
            raise config_error(self, "target_topk", "must be >= 0 (0 = off)")
        if self.max_seq_len is not None and self.max_seq_len < self.token_budget:
            raise config_error(self, "max_seq_len", f"must be >= --token-budget {self.token_budget}")
        if min(self.piece_context, self.piece_label_reach) < 0:
            raise config_error(self, "piece_context", "and --piece-label-reach must be >= 0")
        if (
            self.max_seq_len or 0
        ) > self.token_budget and self.piece_context + self.piece_label_reach >= self.token_budget:
            raise config_error(
                self,
                "piece_context",
                f"+ --piece-label-reach {self.piece_label_reach} must be below --token-budget {self.token_budget}: "
                "a piece needs tokens of its own for anchors",
            )
        if not self.progress_interval_s >= 0:  # NaN too; 0 = a line after every batch
            raise config_error(self, "progress_interval_s", "must be >= 0 seconds (0 = after every batch)")
        self.template_kwargs = list(self.template_kwargs or ())  # click passes a tuple
        parse_template_kwargs(self.template_kwargs)
        if self.taps_from is not None:
            if self.tap_layer_ids is not None:
                raise ValueError(
                    f"--taps {','.join(map(str, self.tap_layer_ids))} and --taps-from {self.taps_from} both name "
                    "the taps: give one of them"
                )
            self.tap_layer_ids = read_drafter_taps(self.taps_from)
        if self.tap_layer_ids is not None:
            if not self.tap_layer_ids:
                raise config_error(self, "tap_layer_ids", "must name at least one layer, e.g. --taps 1,16,31")
            if sorted(set(self.tap_layer_ids)) != list(self.tap_layer_ids):
                raise config_error(self, "tap_layer_ids", "must be strictly increasing layer numbers")
        if not (Path(self.target) / "config.json").is_file():
            raise config_error(self, "target", "has no config.json: pass an HF checkpoint directory")

    @property
    def chat_template_kwargs(self) -> dict[str, Any]:
        """--template-kwarg as the template's keywords."""
        return parse_template_kwargs(self.template_kwargs)

    @property
    def packing(self) -> PackingConfig:
        return PackingConfig(
            token_budget=self.token_budget,
            max_seqs=self.max_seqs,
            long_seqs=self.long_seqs,
            pad_token_id=self.pad_token_id,
            max_seq_len=self.max_seq_len,
            piece_context=self.piece_context,
            piece_label_reach=self.piece_label_reach,
        )
