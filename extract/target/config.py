"""The target's architecture, read from its HF config.json.

Qwen3.5-style hybrid decoders ship config.json in two layouts: the multimodal one
(`Qwen3_5ForConditionalGeneration`, the text decoder under "text_config") and a plain text
one (`Qwen3_5ForCausalLM` / `model_type: qwen3_5_text`). Both resolve to one `TargetConfig`,
every size taken from the file; nothing here is specific to one model size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from shards.common.json_input import InputFileError, read_json_object
from shards.common.schema import REQUIRED, read_field, typed

CONFIG_FILE = "config.json"
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
_LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)
# The integer sizes config.json must give, as TargetConfig names them (each positive).
_SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


@dataclasses.dataclass(kw_only=True, frozen=True)
class TargetConfig:
    """Sizes of the target's text decoder (the vision tower and MTP head are never used)."""

    hidden_size: int  # residual stream width H
    num_hidden_layers: int  # decoder layers in the checkpoint
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (GatedDeltaNet) or "full_attention"
    intermediate_size: int  # SwiGLU MLP width
    vocab_size: int  # rows of embed_tokens / lm_head
    rms_norm_eps: float  # eps of every RMSNorm (zero-centred and gated)
    linear_num_key_heads: int  # GatedDeltaNet q/k heads
    linear_num_value_heads: int  # GatedDeltaNet v heads (a multiple of the q/k heads: GVA)
    linear_key_head_dim: int  # GatedDeltaNet q/k head dim
    linear_value_head_dim: int  # GatedDeltaNet v head dim
    linear_conv_kernel_dim: int  # depthwise causal conv width over the qkv channels
    num_attention_heads: int  # full attention query heads
    num_key_value_heads: int  # full attention kv heads (GQA)
    head_dim: int  # full attention head dim
    partial_rotary_factor: float  # fraction of head_dim that RoPE rotates (the leading dims)
    rope_theta: float  # RoPE base
    tie_word_embeddings: bool  # lm_head shares embed_tokens' weight

    def __post_init__(self) -> None:
        for name in ("num_hidden_layers", *_SIZE_FIELDS):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TargetConfig.{name} must be a positive int, found {value!r}")
        if not (0.0 < self.rms_norm_eps < 1.0):
            raise ValueError(f"TargetConfig.rms_norm_eps must be in (0, 1), found {self.rms_norm_eps!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"TargetConfig.layer_types has {len(self.layer_types)} entries, "
                f"expected num_hidden_layers={self.num_hidden_layers}"
            )
        bad = sorted({t for t in self.layer_types if t not in _LAYER_TYPES})
        if bad:
            raise ValueError(f"TargetConfig.layer_types holds unknown types {bad}, expected {_LAYER_TYPES}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"TargetConfig.linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"TargetConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not (0.0 < self.partial_rotary_factor <= 1.0):
            raise ValueError(
                f"TargetConfig.partial_rotary_factor must be in (0, 1], found {self.partial_rotary_factor!r}"
            )
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(
                f"TargetConfig: rotary dim int(head_dim * partial_rotary_factor) = {self.rotary_dim} "
                f"must be even and nonzero (head_dim={self.head_dim}, "
                f"partial_rotary_factor={self.partial_rotary_factor})"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"TargetConfig.rope_theta must be positive, found {self.rope_theta!r}")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        """Leading head dims that RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the depthwise conv: [q | k | v] concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def is_full_attention(self, layer_id: int) -> bool:
        return self.layer_types[layer_id] == FULL_ATTENTION

    # ---- identity and taps ---------------------------------------------------------------
    def fingerprint(self) -> str:
        """sha256 of the resolved text-decoder fields, canonical JSON; stable across key order and
        across fields that do not change the decoder's math (dtype, transformers_version, ...)."""
        payload = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode("ascii")).hexdigest()

    def default_tap_layer_ids(self, num_taps: int) -> list[int]:
        """DFlash's default taps: round(1 + i*(N-4)/(L-1)) for L taps over N layers (L == 1: N//2)."""
        return default_tap_layer_ids(self.num_hidden_layers, num_taps)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["layer_types"] = list(self.layer_types)
        return out

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, config: dict[str, Any], source: str = "config.json") -> TargetConfig:
        """Resolve a config.json dict (multimodal with "text_config", or plain text)."""
        text = config.get("text_config", config)
        if not isinstance(text, dict):
            raise ValueError(f"{source}: text_config must be an object, found {type(text).__name__}")
        return cls(**_resolve_text_fields(text, top=config, source=source))

    @classmethod
    def from_dir(cls, path: str | Path) -> TargetConfig:
        return cls.from_hf_dict(read_config_json(path), source=str(Path(path) / CONFIG_FILE))


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A checkpoint directory's config.json, bounded and parsed (shards/common/json_input.py)."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: no config.json in the target checkpoint directory")
    try:
        return read_json_object(config_path)
    except InputFileError as e:
        raise InputFileError(f"{e}; fix or re-download the checkpoint's config") from e


def special_token_ids(path: str | Path) -> dict[str, Any]:
    """bos / eos / pad token ids of a checkpoint's config.json (text_config first, then the top level;
    None where undeclared). Not part of TargetConfig: they do not change the decoder's math."""
    top = read_config_json(path)
    text = top.get("text_config") if isinstance(top.get("text_config"), dict) else {}
    out = {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = text.get(name, top.get(name))
        ok = (
            value is None
            or (isinstance(value, int) and not isinstance(value, bool))
            or (isinstance(value, list) and name == "eos_token_id" and all(isinstance(v, int) for v in value))
        )
        out[name] = value if ok else None
    return out


def stop_token_ids(path: str | Path) -> frozenset[int]:
    """The ids that end a reply as serving engines end it: every eos_token_id a checkpoint declares, in
    config.json's text_config and top level (Qwen3.5 puts <|endoftext|> in one, <|im_end|> in the other)
    and in generation_config.json when there is one. An eos_token_id there that is no id or list of ids is
    refused naming the file: decoding would otherwise run past every reply's end unnoticed."""
    top = read_config_json(path)
    text = top.get("text_config") if isinstance(top.get("text_config"), dict) else {}
    config = Path(path) / CONFIG_FILE
    declared = [(config, text.get("eos_token_id")), (config, top.get("eos_token_id"))]
    generation = Path(path) / "generation_config.json"
    if generation.exists():
        declared.append((generation, read_json_object(generation).get("eos_token_id")))
    ids: set[int] = set()
    for source, value in declared:
        values = value if isinstance(value, list) else [] if value is None else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise InputFileError(f"{source}: eos_token_id must be a token id or a list of them, got {value!r:.60}")
        ids.update(values)
    return frozenset(ids)


def max_position_embeddings(path: str | Path) -> int | None:
    """The context length a checkpoint's config.json declares (text_config first, then the top level;
    None where undeclared or not a positive int). Not part of TargetConfig: RoPE is computed per position."""
    with open(Path(path) / "config.json", encoding="utf-8") as f:
        top = json.load(f)
    text = top.get("text_config") if isinstance(top.get("text_config"), dict) else {}
    value = text.get("max_position_embeddings", top.get("max_position_embeddings"))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def default_tap_layer_ids(num_layers: int, num_taps: int) -> list[int]:
    """DFlash's `build_target_layer_ids`: [1, 16, 31, 46, 61] for 64 layers and 5 taps."""
    if num_taps <= 0:
        raise ValueError(f"num_taps must be positive, found {num_taps}")
    if num_layers < 4 and num_taps > 1:
        raise ValueError(f"num_layers={num_layers} is too small for {num_taps} DFlash taps (needs >= 4)")
    if num_taps == 1:
        return [num_layers // 2]
    span = num_layers - 4
    return [int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps)]


def _resolve_text_fields(text: dict[str, Any], top: dict[str, Any], source: str) -> dict[str, Any]:
    where = "text_config." if text is not top else ""

    def text_field(name: str, annotation: Any, default: Any = REQUIRED) -> Any:
        return read_field(text, name, annotation, source, default, where)

    num_layers = text_field("num_hidden_layers", int)
    layer_types = text_field("layer_types", list[str], None)
    if layer_types is None:
        # HF Qwen3_5TextConfig: layer i is full attention iff (i + 1) % interval == 0.
        interval = text_field("full_attention_interval", int, 4)
        if interval < 1:
            raise ValueError(f"{source}: full_attention_interval must be positive, found {interval}")
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]

    rope = text_field("rope_parameters", dict[str, Any], {})
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"{source}: rope_parameters.rope_type={rope_type!r}, only 'default' is implemented")
    rope_theta = typed(float | None, rope.get("rope_theta"), source, f"{where}rope_parameters.rope_theta")
    rope_theta = text_field("rope_theta", float, None) if rope_theta is None else rope_theta
    if rope_theta is None:
        raise ValueError(f"{source}: neither rope_parameters.rope_theta nor rope_theta is set")
    # HF defaults a missing partial_rotary_factor to 0.25 for backward compatibility; so do we.
    partial = typed(
        float | None, rope.get("partial_rotary_factor"), source, f"{where}rope_parameters.partial_rotary_factor"
    )
    partial = text_field("partial_rotary_factor", float, 0.25) if partial is None else partial

    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act={act!r}, only 'silu' is implemented")
    if text.get("attention_bias", False):
        raise ValueError(f"{source}: attention_bias=true is not implemented (Qwen3.5 has no biases)")
    if not text.get("attn_output_gate", True):
        raise ValueError(f"{source}: attn_output_gate=false is not implemented (Qwen3.5 gates attention)")

    tied_top = read_field(top, "tie_word_embeddings", bool, source, False)
    return dict(
        **{name: text_field(name, int) for name in _SIZE_FIELDS},
        num_hidden_layers=num_layers,
        layer_types=tuple(layer_types),
        rms_norm_eps=text_field("rms_norm_eps", float),
        partial_rotary_factor=partial,
        rope_theta=rope_theta,
        tie_word_embeddings=text_field("tie_word_embeddings", bool, tied_top),
    )
