"""Typed configuration of the DFlash drafter (its shape and the constants it shares with the target).

`DrafterConfig.for_target(...)` derives a drafter from the target's dimensions: the published
Qwen3.5-27B drafter shape for a 5120-wide target, a scaled shape otherwise. `DrafterOptions` is what a
training run pins of that shape (dflash-train's drafter options, nested in TrainConfig); what it leaves
unset train/resolve.py derives from the cache or the --init-from drafter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from shards.common.cli_options import at_least, cli_field, config_error, flag_name, shown

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
# The published Qwen3.8-27B-DFlash2 layout (field notes 2.1): five sliding layers of window 2048 and the
# dflash_config sizes below; its block size is 8 (--arch dflash2's default --block-size) and its taps [5, 19, 33, 47, 61]
# come from the cache (extract with --taps 5,19,33,47,61).
DFLASH2_27B_LAYOUT = dict(layer_types=["sliding_attention"] * 5, sliding_window=2048, block_size=8)
# Drafter kinds: z-lab's DFlashDraftModel and DFlash2DraftModel (train/drafter/dflash2.py).
DFLASH1, DFLASH2 = "dflash", "dflash2"
ARCHS = (DFLASH1, DFLASH2)
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
    """Longest position the drafter is meant for: the target's (cache.json records it; this default, Qwen3.5's,
    only for caches that do not). Recorded in config.json, where vLLM sizes the drafter's RoPE table by it;
    training computes RoPE per position."""
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
    is_causal: bool | None = None
    """config.json's top-level is_causal, kept as published: None (absent) = each layer by its kind (sliding
    causal, full bidirectional); False = sliding layers attend their block both ways, still through the
    window (the published DFlash 2 configs; train/drafter/attention.py); True = every layer causal, which
    only sliding layers can be here."""
    bos_token_id: int | None = None
    """The target's bos id (config.json bos_token_id, copied from the target); None = unknown."""
    eos_token_id: int | list[int] | None = None
    """The target's eos id or ids (config.json eos_token_id); None = unknown."""
    pad_token_id: int | None = None
    """The target's pad id (config.json pad_token_id); None = the target declares none."""
    context_width: int | None = None
    """fc's input width when the drafter reads a projected cache's codes (its --pca-rank R); None = the full
    taps, num_taps * hidden_size. Never in an export: there fc = fc' P D reads the full taps."""
    context_projection: str | None = None
    """The checksum of the projection those codes were made with (cache.json projection.checksum); given
    exactly when context_width is."""
    arch: str = DFLASH1
    """"dflash" (DFlashDraftModel) or "dflash2" (DFlash2DraftModel: block convolutions and the candidate
    selector); the fields below are DFlash 2's and unused by "dflash"."""
    conv_kernel_size: int = 2
    """Taps of each grouped dynamic causal convolution (dflash_config.conv_kernel_size)."""
    conv_group_size: int = 16
    """Channels sharing one dynamic kernel value (dflash_config.conv_group_size); divides hidden_size."""
    selector_rank: int = 256
    """Rank R of the selector's bilinear term (dflash_config.selector_rank)."""
    selector_top_k: int = 16
    """Candidates per slot: the top-K of the drafter's logits (dflash_config.selector_top_k)."""
    output_multiplier: float = 1.0
    """DFlash 2 logits = lm_head(h) * output_multiplier (then soft-capped)."""
    final_logit_softcapping: float | None = None
    """DFlash 2 logits soft cap c: tanh(logits / c) * c; None = none (the Qwen3.8 drafter's)."""
    input_embedding_scale: float = 1.0
    """DFlash 2 block embeddings are the target's, times this (dflash_config.input_embedding_scale)."""

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
        self._check_dflash2()
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, list) else [value]
            if value is not None and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError(
                    f"DrafterConfig.{name} must be a token id (or, for eos, a list of them) or None, got {value!r}"
                )
        if (self.context_width is None) != (self.context_projection is None):
            raise ValueError(
                f"DrafterConfig.context_width {self.context_width!r} and context_projection "
                f"{self.context_projection!r}: give both (a projected drafter) or neither"
            )
        full = self.num_taps * self.hidden_size
        if self.context_width is not None and not 1 <= self.context_width < full:
            raise ValueError(f"DrafterConfig.context_width must be in [1, {full}), got {self.context_width}")
        if self.layer_types is None:
            self.layer_types = [FULL_ATTENTION] * self.num_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(
                f"DrafterConfig.layer_types must give one of {LAYER_TYPES} for each of the "
                f"{self.num_layers} layers, got {self.layer_types}"
            )
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            raise ValueError(f"DrafterConfig.is_causal must be true, false or None, got {self.is_causal!r}")
        if self.is_causal and not all(self.sliding_layers):
            raise ValueError(
                f"DrafterConfig.is_causal true makes the {FULL_ATTENTION} layers of {self.layer_types} causal, "
                "which is not implemented: drop is_causal or make every layer sliding"
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

    def _check_dflash2(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"DrafterConfig.arch must be one of {ARCHS}, got {self.arch!r}")
        if self.arch != DFLASH2:  # DFlash 2's fields are unused (and unchecked) in a DFlash 1 drafter
            return
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DrafterConfig.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"DrafterConfig.conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}"
            )
        if self.selector_top_k > self.vocab_size:
            raise ValueError(
                f"DrafterConfig.selector_top_k {self.selector_top_k} exceeds the vocabulary ({self.vocab_size})"
            )
        if not self.output_multiplier > 0:  # > 0 keeps the top-K of the raw logits the top-K of the scaled ones
            raise ValueError(f"DrafterConfig.output_multiplier must be > 0, got {self.output_multiplier}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError(
                f"DrafterConfig.final_logit_softcapping must be > 0 or None, got {self.final_logit_softcapping}"
            )
        if not self.input_embedding_scale > 0:
            raise ValueError(f"DrafterConfig.input_embedding_scale must be > 0, got {self.input_embedding_scale}")

    @property
    def is_dflash2(self) -> bool:
        return self.arch == DFLASH2

    @property
    def num_taps(self) -> int:
        """Tapped target layers, K: the context input is [T, K, hidden_size]."""
        return len(self.tap_layer_ids)

    @property
    def fc_in_features(self) -> int:
        """fc's input: the concatenated taps, or a projected cache's R codes."""
        return self.context_width or self.num_taps * self.hidden_size

    @property
    def sliding_layers(self) -> list[bool]:
        """Per layer: True for a sliding-window layer, False for a full (bidirectional) one."""
        return [t == SLIDING_ATTENTION for t in self.layer_types]

    @property
    def sliding_causal(self) -> bool:
        """Whether the sliding layers attend their block causally (else both ways: is_causal false)."""
        return self.is_causal is not False

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
        **options,
    ) -> DrafterConfig:
        """Drafter at the target's width; `options` are other DrafterConfig fields (num_layers, block_size,
        rope_theta, layer_types, arch, ...), its defaults for the rest; arch "dflash2" without layer_types
        gets the published DFlash 2 layout (every layer sliding, window 2048 unless given).

        A 5120-wide target gets the published 27B drafter heads (32 q, 8 kv, dim 128: ~1.73B parameters
        with 5 layers and MLP 17408). Other widths use head_dim 128 from hidden 1024 up (hidden/8 below,
        so tiny test targets work), q heads = hidden/head_dim and kv heads = q heads/4 (at least 1).
        """
        if options.get("arch") == DFLASH2 and "layer_types" not in options:
            # The published DFlash 2 layout: every layer sliding (window 2048), as many layers as asked.
            num_layers = options.get("num_layers", DrafterConfig.num_layers)
            options = {**options, "layer_types": [SLIDING_ATTENTION] * num_layers}
            options.setdefault("sliding_window", DFLASH2_27B_LAYOUT["sliding_window"])
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
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            mask_token_id=mask_token_id,
            tap_layer_ids=list(tap_layer_ids),
            num_target_layers=num_target_layers,
            vocab_size=vocab_size,
            **options,
        )


@dataclass(kw_only=True)
class DrafterOptions:
    """What a training run pins of the drafter; each field is a dflash-train option (the docstring is its
    --help) and unset (None) means derived: from the cache, the target's width or the --init-from drafter."""

    arch: str | None = None
    """Drafter kind: dflash (DFlash 1) or dflash2 (DFlash 2: block convolutions and the candidate selector,
    every layer sliding with window 2048 unless --layer-types/--sliding-window say otherwise, and block 8 unless
    --block-size says otherwise: the published Qwen3.8-27B-DFlash2). dflash2 with --init-from a DFlash 1 drafter is a warm start
    (new parts inert). Default: the --init-from drafter's, else dflash."""
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
    (or the --init-from drafter's); the acceptance table's sliding-layers row measured the published layout
    equal to it within the seed spread on short replies (BENCHMARKS.md, Acceptance by numerics choice)."""
    sliding_window: int | None = None
    """Tokens a sliding layer's query sees, itself included (published 27B: 2048); needed iff a layer
    slides. Default: none (or the --init-from drafter's)."""
    init_from: str | None = cli_field(None, path="existing_dir")
    """Start from this exported or published DFlashDraftModel directory (config.json + safetensors) instead
    of random weights; its shape is used (shape options may stay unset or must agree) and it must fit the
    cache (hidden size, taps, target layers, vocab, mask id) and --block-size. Default: random init."""

    def __post_init__(self) -> None:
        if self.tap_layer_ids is not None:
            self.tap_layer_ids = [int(t) for t in self.tap_layer_ids]
        if self.arch is not None and self.arch not in ARCHS:
            raise config_error(self, "arch", f"must be one of {', '.join(ARCHS)}")
        if self.num_layers is not None:
            at_least(self, 1, "num_layers")
        if self.rope_theta is not None and not self.rope_theta > 1:
            raise config_error(self, "rope_theta", "must be > 1; omit it for 1e7")
        for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "mask_token_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < (0 if name == "mask_token_id" else 1)):
                raise config_error(self, name, "must be a positive integer; omit it for the default")
        heads = ("num_attention_heads", "num_key_value_heads", "head_dim")
        given = [getattr(self, h) is not None for h in heads]
        if any(given) and not all(given):
            flags = ", ".join(f"{flag_name(DrafterOptions, h)} {shown(getattr(self, h))}" for h in heads)
            raise ValueError(
                f"{flags}: give the three together or none of them (then they are derived from the target's width)"
            )
        self._check_layers()
        if self.init_from is not None and not Path(self.init_from).is_dir():
            raise config_error(
                self,
                "init_from",
                "is not a directory (an exported or published DFlashDraftModel: config.json + safetensors)",
            )

    def _check_layers(self) -> None:
        """--layer-types names a known kind per layer (full / sliding taken too), one per --num-layers, and
        --sliding-window is given exactly when a layer slides (unless the --init-from drafter has one)."""
        # Messages quote --layer-types as the user typed it (sliding,full), not as normalised below (here and
        # in train/resolve.py's --init-from refusal): kept beside the fields, not one of them.
        self.layer_types_typed = shown(self.layer_types)
        layer_types_given = f"--layer-types {self.layer_types_typed}"
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
