"""dflash-extract's settings, checked before any model loads or GPU is touched.

Each field is a dflash-extract option (shards.common.cli_options: dashes for underscores, the docstring is
its --help); a bad value is refused naming the flag and the value given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from extract.chats.prepare import Thinking
from extract.dataset.index import LONG_SEQ_POLICIES, LongSeqPolicy
from extract.dataset.packing import PackingConfig
from shards.common.cli_options import cli_field, config_error
from shards.common.compile_cache import CompileCacheConfig
from shards.format import STORAGE_DTYPES, StorageDtype, canonical_precision
from shards.sample_ids import MAX_SHARD_SAMPLES

# torch's names for what the target runs in; --storage names the cache encoding (shards/format.py says why two).
TargetDtype = Literal["bfloat16", "float16", "float32"]
DTYPES = get_args(TargetDtype)
# How the target's linear layers run: "dense" (matmuls in --dtype) or "fp8" (e4m3 matmuls).
ComputeMode = Literal["dense", "fp8"]
COMPUTE_MODES = get_args(ComputeMode)


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
    out_dir: str = cli_field(flag="--out", path="dir")
    """Cache directory to create, or to resume when it exists."""
    tap_layer_ids: list[int] | None = cli_field(None, flag="--taps")
    """Target layers to store, e.g. 1,16,31,46,61 (tap j = output of layer j). Default: DFlash's spread
    for --num-taps."""
    num_taps: int = 5
    """Number of taps when --taps is not given: round(1 + i*(N-4)/(L-1))."""
    storage_dtype: StorageDtype = cli_field("bf16", flag="--storage")
    """Hidden-state storage: bf16 (2 bytes per value; bfloat16 is taken too), or fp8 e4m3 with a
    per-token-per-tap scale (half the disk)."""
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
    mask_token_id: int | None = None
    """The drafter's MASK token id, recorded in the cache (248070 for Qwen3.5; dflash-train can
    override it). Default: none recorded, and dflash-train then needs its own --mask-token-id."""
    dtype: TargetDtype = "bfloat16"
    """Dtype the target runs in."""
    compute: ComputeMode = "dense"
    """The target's linear layers: dense (matmuls in --dtype) or fp8 (e4m3 matmuls: per-token and
    per-channel scales on a bf16 checkpoint, sm_89+; an FP8 checkpoint's own 128x128 block scales,
    Hopper only; needs --dtype bfloat16; hidden states differ by a few percent)."""
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
        for name in ("num_taps", "token_budget", "max_seqs", "topk_chunk_tokens", "writer_buffers"):
            if getattr(self, name) < 1:
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
        if not self.progress_interval_s >= 0:  # NaN too; 0 = a line after every batch
            raise config_error(self, "progress_interval_s", "must be >= 0 seconds (0 = after every batch)")
        if self.tap_layer_ids is not None:
            if not self.tap_layer_ids:
                raise config_error(self, "tap_layer_ids", "must name at least one layer, e.g. --taps 1,16,31")
            if sorted(set(self.tap_layer_ids)) != list(self.tap_layer_ids):
                raise config_error(self, "tap_layer_ids", "must be strictly increasing layer numbers")
        if not (Path(self.target) / "config.json").is_file():
            raise config_error(self, "target", "has no config.json: pass an HF checkpoint directory")

    @property
    def packing(self) -> PackingConfig:
        return PackingConfig(
            token_budget=self.token_budget,
            max_seqs=self.max_seqs,
            long_seqs=self.long_seqs,
            pad_token_id=self.pad_token_id,
        )
