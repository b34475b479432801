"""Typed configuration of the DFlash drafter (its shape and the constants it shares with the target).

`DrafterConfig.for_target(...)` derives a drafter from the target's dimensions: the published
Qwen3.5-27B drafter shape for a 5120-wide target, a scaled shape otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# The published Qwen3.5-27B drafter (z-lab): 5 layers at width 5120, MLP 17408, 32 q / 8 kv heads of dim 128.
_PUBLISHED_27B_WIDTH = 5120
_PUBLISHED_27B_HEADS = (32, 8, 128)  # (q heads, kv heads, head dim)
# The Qwen3.6-27B target's dimensions (Qwen3.5-27B's text decoder), as DrafterConfig.for_target takes them
# (benchmarks and tests at 27B width).
QWEN36_27B_TARGET = dict(
    hidden_size=5120,
    intermediate_size=17408,
    vocab_size=248320,
    num_target_layers=64,
    tap_layer_ids=(1, 16, 31, 46, 61),
    mask_token_id=248070,
)
# Layer kinds, spelled as config.json layer_types spells them (HF Qwen3, vLLM, SGLang).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(kw_only=True)
class DrafterConfig:
    """Shape of a DFlash drafter; mirrors the Qwen3 fields of z-lab's DFlashDraftModel config.json."""

    num_layers: int = 5
    """Drafter decoder layers (config.json num_hidden_layers); the published drafters use 5."""
    hidden_size: int
    """Residual width; equal to the target's hidden size (the target's embed/lm_head are reused)."""
    intermediate_size: int
    """SwiGLU MLP width."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (GQA); must divide num_attention_heads."""
    head_dim: int
    """Per-head width; even, since RoPE rotates the whole head in two halves."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm in the drafter."""
    rope_theta: float = 1e7
    """RoPE base; the Qwen3.5 targets use 1e7."""
    max_position_embeddings: int = 262144
    """Longest position the drafter is meant for (recorded in config.json; RoPE is computed on the fly)."""
    block_size: int = 16
    """Tokens per draft block: the anchor (last accepted token) plus block_size-1 MASK slots."""
    mask_token_id: int
    """Token id placed in the block's MASK slots; must be a row of the target's embedding."""
    tap_layer_ids: list[int] = field(default_factory=list)
    """Target layers whose outputs form the context (tap j = output of decoder layer j), in cache order."""
    num_target_layers: int
    """Decoder layers of the target (recorded in config.json as num_target_layers)."""
    vocab_size: int
    """Rows of the target's embed_tokens / lm_head."""
    layer_types: list[str] | None = None
    """Per layer "full_attention" or "sliding_attention" (config.json layer_types); None = all full."""
    sliding_window: int | None = None
    """Tokens a sliding layer's query sees, itself included (config.json sliding_window); needed iff a
    layer is sliding. The published Qwen3.6-27B layout: 4 sliding + 1 full, window 2048."""
    bos_token_id: int | None = None
    """The target's bos id (config.json bos_token_id, copied from the target); None = unknown."""
    eos_token_id: int | list[int] | None = None
    """The target's eos id or ids (config.json eos_token_id); None = unknown."""
    pad_token_id: int | None = None
    """The target's pad id (config.json pad_token_id); None = the target declares none."""

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "num_target_layers",
            "vocab_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DrafterConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DrafterConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"DrafterConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"DrafterConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 1:
            raise ValueError(f"DrafterConfig.rope_theta must be > 1, got {self.rope_theta}")
        if self.block_size < 2:
            raise ValueError(f"DrafterConfig.block_size must be >= 2 (anchor plus one draft), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DrafterConfig.mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        if not self.tap_layer_ids:
            raise ValueError("DrafterConfig.tap_layer_ids must name at least one target layer, got []")
        bad = [t for t in self.tap_layer_ids if not 0 <= t < self.num_target_layers]
        if bad:
            raise ValueError(
                f"DrafterConfig.tap_layer_ids {self.tap_layer_ids}: {bad} outside "
                f"[0, num_target_layers={self.num_target_layers})"
            )
        self.tap_layer_ids = [int(t) for t in self.tap_layer_ids]
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, list) else [value]
            if value is not None and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError(
                    f"DrafterConfig.{name} must be a token id (or, for eos, a list of them) or None, got {value!r}"
                )
        if self.layer_types is None:
            self.layer_types = [FULL_ATTENTION] * self.num_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(
                f"DrafterConfig.layer_types must give one of {LAYER_TYPES} for each of the "
                f"{self.num_layers} layers, got {self.layer_types}"
            )
        if any(self.sliding_layers):
            if (
                not isinstance(self.sliding_window, int)
                or isinstance(self.sliding_window, bool)
                or self.sliding_window < 1
            ):
                raise ValueError(
                    f"DrafterConfig.sliding_window must be a positive int when a layer is "
                    f"{SLIDING_ATTENTION}, got {self.sliding_window!r}"
                )
        elif self.sliding_window is not None:
            raise ValueError(
                f"DrafterConfig.sliding_window {self.sliding_window} given but no layer is "
                f"{SLIDING_ATTENTION} (layer_types {self.layer_types}); drop the window or make layers sliding"
            )

    @property
    def num_taps(self) -> int:
        """Tapped target layers, K: the context input is [T, K, hidden_size]."""
        return len(self.tap_layer_ids)

    @property
    def sliding_layers(self) -> list[bool]:
        """Per layer: True for a sliding-window (causal) layer, False for a full (bidirectional) one."""
        return [t == SLIDING_ATTENTION for t in self.layer_types]

    @property
    def attention_window(self) -> int | None:
        """The window a BlockAttentionLayout needs for this drafter: W with sliding layers, else None."""
        return self.sliding_window if any(self.sliding_layers) else None

    def replace(self, **changes) -> DrafterConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_target(
        cls,
        *,
        hidden_size: int,
        intermediate_size: int,
        vocab_size: int,
        num_target_layers: int,
        tap_layer_ids: list[int],
        mask_token_id: int,
        num_layers: int = 5,
        block_size: int = 16,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 1e7,
        max_position_embeddings: int = 262144,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
    ) -> DrafterConfig:
        """Drafter at the target's width.

        A 5120-wide target gets the published 27B drafter heads (32 q, 8 kv, dim 128: ~1.73B parameters
        with 5 layers and MLP 17408). Other widths use head_dim 128 from hidden 1024 up (hidden/8 below,
        so tiny test targets work), q heads = hidden/head_dim and kv heads = q heads/4 (at least 1).
        """
        if hidden_size == _PUBLISHED_27B_WIDTH:
            num_heads, num_kv_heads, head_dim = _PUBLISHED_27B_HEADS
        else:
            head_dim = 128 if hidden_size >= 1024 else max(2, (hidden_size // 8) // 2 * 2)
            if hidden_size % head_dim:
                raise ValueError(
                    f"hidden_size {hidden_size} is not a multiple of the derived head_dim {head_dim}; "
                    "build DrafterConfig directly with explicit heads"
                )
            num_heads = hidden_size // head_dim
            num_kv_heads = max(1, num_heads // 4)
            while num_heads % num_kv_heads:
                num_kv_heads -= 1
        return cls(
            num_layers=num_layers,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=rms_norm_eps,
            rope_theta=rope_theta,
            max_position_embeddings=max_position_embeddings,
            block_size=block_size,
            mask_token_id=mask_token_id,
            tap_layer_ids=list(tap_layer_ids),
            num_target_layers=num_target_layers,
            vocab_size=vocab_size,
            layer_types=layer_types,
            sliding_window=sliding_window,
        )
