"""dflash-extract's settings, checked before any model loads or GPU is touched."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shards.format import STORAGE_DTYPES

from .data import LONG_SEQ_POLICIES
from .packing import PackingConfig

DTYPES = ("bfloat16", "float16", "float32")
COMPUTE_MODES = ("dense",)


@dataclass(kw_only=True)
class ExtractConfig:
    """One extraction run: target x dataset -> cache."""

    target: str  # HF checkpoint directory: config.json + *.safetensors (Qwen3.5 naming)
    data: str  # Parquet / JSON Lines file, directory or glob with input_ids (and loss_mask, id)
    out: str  # cache directory to create or resume
    tap_layer_ids: list[int] | None = None  # target layers to store; None = DFlash's default for num_taps
    num_taps: int = 5  # taps when tap_layer_ids is None: round(1 + i*(N-4)/(L-1))
    storage_dtype: str = "bf16"  # "bf16" (2 bytes/value) or "fp8" (e4m3 + per-token-per-tap scale: half)
    target_topk: int = 0  # store the target's top-K next tokens and log-probs per position; 0 = off
    token_budget: int = 49152  # tokens per packed batch (= per shard), real plus padding
    max_seqs: int = 128  # most sequences per packed batch
    long_seqs: str = "truncate"  # samples longer than token_budget: truncate | skip | error
    pad_token_id: int = 0  # token id written on padding positions
    mask_token_id: int | None = None  # drafter MASK id to record in the cache (train can override)
    dtype: str = "bfloat16"  # dtype the target runs in
    compute: str = "dense"  # the target's linear layers: "dense" (matmuls in `dtype`)
    device: str = "auto"  # "auto" (cuda:LOCAL_RANK when CUDA exists, else cpu), "cpu", "cuda", "cuda:N"
    allow_slow_kernels: bool = False  # permit torch fallbacks on CUDA (10-50x slower for the GDN layers)
    overwrite: bool = False  # delete an existing cache at `out` and start over
    full_resume_check: bool = True  # on resume, checksum every existing shard (else header checks only)
    topk_chunk_tokens: int = 4096  # tokens per LM-head chunk when target_topk > 0
    progress_interval_s: float = 10.0  # seconds between progress lines
    writer_buffers: int = 2  # pinned host buffers cycling between the forward and the writer thread

    def __post_init__(self) -> None:
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {STORAGE_DTYPES}, got {self.storage_dtype!r}")
        if self.long_seqs not in LONG_SEQ_POLICIES:
            raise ValueError(f"long_seqs must be one of {LONG_SEQ_POLICIES}, got {self.long_seqs!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.compute not in COMPUTE_MODES:
            raise ValueError(f"compute must be one of {COMPUTE_MODES}, got {self.compute!r}")
        for name in ("num_taps", "token_budget", "max_seqs", "topk_chunk_tokens", "writer_buffers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.target_topk < 0:
            raise ValueError(f"target_topk must be >= 0, got {self.target_topk}")
        if self.tap_layer_ids is not None:
            if not self.tap_layer_ids:
                raise ValueError("tap_layer_ids must not be empty")
            if sorted(set(self.tap_layer_ids)) != list(self.tap_layer_ids):
                raise ValueError(f"tap_layer_ids must be strictly increasing, got {self.tap_layer_ids}")
        if not (Path(self.target) / "config.json").is_file():
            raise ValueError(f"target {self.target!r} has no config.json: pass an HF checkpoint directory")

    @property
    def packing(self) -> PackingConfig:
        return PackingConfig(token_budget=self.token_budget, max_seqs=self.max_seqs, long_seqs=self.long_seqs,
                             pad_token_id=self.pad_token_id)
