"""What vLLM and SGLang would resolve from our exported config.json, field by field.

The resolution rules below are written from the engines' DFlash loaders (read December 2026), each as a
small function of the config.json dict, independent of train/checkpoint/export.py:
  vLLM   vllm/model_executor/models/qwen3_dflash.py (_dflash_layer_causal, _resolve_layer_attention,
         _get_dflash_fc_input_size, set_default_rope_theta(config, 1e6)) and
         vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (get_eagle3_aux_layers_from_config)
  SGLang python/sglang/srt/models/dflash.py (_get_dflash_layer_attention_params, DFlashMLP) and
         python/sglang/srt/speculative/dflash_utils.py (parse_dflash_draft_config,
         get_dflash_attention_sliding_window_size), hf_transformers_utils.get_rope_config
Both engines load config.json through HF's Qwen3Config first, which drops sliding_window unless
use_sliding_window is true (hf_qwen3_view). RoPE is read as transformers 4 exposes it (rope_parameters
only when the file has it), the stricter case: transformers 5 also converts a bare rope_theta.
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from tests.helpers.drafter import QWEN36_27B_TARGET, tiny_config, tiny_model_and_head
from train.checkpoint.export import drafter_config_to_hf, export_drafter
from train.drafter.attention import block_mask_dense
from train.drafter.config import DrafterConfig

SLIDING, FULL = "sliding_attention", "full_attention"


# ---- HF Qwen3Config, the part both engines see ------------------------------------------------------
def hf_qwen3_view(raw: dict) -> dict:
    cfg = dict(raw)
    if not cfg.get("use_sliding_window", False):
        cfg["sliding_window"] = None
    if cfg.get("layer_types") is None:
        n, first = cfg["num_hidden_layers"], cfg.get("max_window_layers", 28)
        cfg["layer_types"] = [SLIDING if cfg["sliding_window"] is not None and i >= first else FULL for i in range(n)]
    return cfg


# ---- vLLM -------------------------------------------------------------------------------------------
def vllm_rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or {"rope_type": "default"}
    return float(rope.get("rope_theta", 1e6))


def vllm_layer_causal(cfg: dict, i: int) -> bool:
    if cfg.get("is_causal") is not None:
        return bool(cfg["is_causal"])
    if (cfg.get("dflash_config") or {}).get("causal") is not None:
        return bool(cfg["dflash_config"]["causal"])
    return bool(cfg.get("layer_types")) and cfg["layer_types"][i] == SLIDING


def vllm_layer_window(cfg: dict, i: int) -> int | None:
    """vLLM's per-layer sliding window: the query plus window - 1 keys before it."""
    dflash, layer_types = cfg.get("dflash_config") or {}, cfg.get("layer_types")
    use_swa = dflash.get("use_swa", False)
    any_sliding = bool(layer_types) and SLIDING in layer_types
    sliding = use_swa if layer_types is None or (use_swa and not any_sliding) else layer_types[i] == SLIDING
    if not sliding:
        return None
    window = dflash.get("swa_window_size", cfg.get("sliding_window"))
    if window is None:
        raise ValueError("vLLM: DFlash sliding attention requires a window size")
    return window


def vllm_captured_layers(cfg: dict) -> list[int]:
    """Layer ids vLLM captures the INPUT of (eagle_aux ids as-is, else target_layer_ids + 1)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = [i + 1 for i in ((cfg.get("dflash_config") or {}).get("target_layer_ids") or [])]
    return list(ids)


def vllm_fc_input(cfg: dict) -> int:
    return (cfg.get("target_hidden_size") or cfg["hidden_size"]) * len(vllm_captured_layers(cfg))


def vllm_mask_token_id(cfg: dict) -> int | None:
    dflash = dict(cfg.get("eagle_config") or {})
    dflash.update(cfg.get("dflash_config") or {})
    return dflash.get("mask_token_id", cfg.get("mask_token_id"))


# ---- SGLang -----------------------------------------------------------------------------------------
def sglang_rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters")
    return float(rope["rope_theta"] if rope is not None else cfg["rope_theta"])


def sglang_layer(cfg: dict, i: int) -> tuple[bool, int]:
    """(causal, window_left) of layer i; window_left -1 = unbounded. Sliding layers run as DECODER."""
    layer_types = (cfg.get("text_config") or cfg).get("layer_types", cfg.get("layer_types"))
    if layer_types is None or layer_types[i] == FULL:
        return False, -1
    if layer_types[i] != SLIDING:
        raise ValueError(f"SGLang: unsupported layer type {layer_types[i]!r}")
    window = (cfg.get("text_config") or cfg).get("sliding_window", cfg.get("sliding_window"))
    if window is None:
        raise ValueError("SGLang: sliding_attention layers require config.sliding_window")
    return True, int(window) - 1  # HF windows include the current token; SGLang stores window_left


def sglang_target_layers(cfg: dict) -> list[int]:
    """target_layer_ids in the output-of-layer convention, range-checked (SGLang captures +1)."""
    dflash = cfg.get("dflash_config") or {}
    num_target = dflash.get("num_target_layers", cfg.get("num_target_layers"))
    ids = [int(x) for x in dflash.get("target_layer_ids", cfg.get("target_layer_ids"))]
    if not all(0 <= x < num_target for x in ids):
        raise ValueError(f"SGLang: target_layer_ids {ids} outside {num_target} target layers")
    return ids


def sglang_block_size(cfg: dict) -> int:
    dflash = cfg.get("dflash_config") or {}
    return int(dflash.get("block_size", cfg.get("block_size", 16)))


def sglang_mask_token_id(cfg: dict) -> int | None:
    dflash = cfg.get("dflash_config") or {}
    return dflash.get("mask_token_id", cfg.get("mask_token_id"))


def sglang_fc_input(cfg: dict) -> int:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError("SGLang: only silu")
    return len(sglang_target_layers(cfg)) * cfg["hidden_size"]


# ---- the engines' visibility rule, for comparing with our training mask -----------------------------
def engine_mask(seq_start, anchor, num_ctx, block_size, causal: bool, window_left: int):
    """Key visibility the engine implies for each training query: its sequence's context before the
    anchor and its own block, then (causal layers) keys at positions p - window_left .. p only, or
    (non-causal windowed layers: flash-attn's window (W-1, W-1)) p - window_left .. p + window_left."""
    rows = []
    for q in range(len(anchor) * block_size):
        n, k = divmod(q, block_size)
        p = anchor[n] + k
        row = []
        for j in range(num_ctx + len(anchor) * block_size):
            own = num_ctx + n * block_size <= j < num_ctx + (n + 1) * block_size
            seen = seq_start[n] <= j < anchor[n] or own
            key_pos = j if j < num_ctx else anchor[n] + (j - num_ctx) % block_size
            if causal:
                seen = seen and 0 <= p - key_pos and (window_left < 0 or p - key_pos <= window_left)
            elif window_left >= 0:
                seen = seen and abs(p - key_pos) <= window_left
            row.append(seen)
        rows.append(row)
    return torch.tensor(rows)


def published_27b_layout(**changes) -> DrafterConfig:
    """The Qwen3.6-27B drafter layout SpecForge's configs/qwen3.6-27b-dflash.json describes."""
    base = dict(
        **QWEN36_27B_TARGET,
        num_layers=5,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1e7,
        block_size=16,
        layer_types=[SLIDING] * 4 + [FULL],
        sliding_window=2048,
        bos_token_id=248043,
        eos_token_id=248044,
        pad_token_id=248044,
    )
    base.update(changes)
    return DrafterConfig(**base)


CONFIGS = {
    "full_tiny": lambda: tiny_config(),
    "sliding_tiny": lambda: tiny_config(layer_types=[SLIDING, FULL], sliding_window=3),
    "published_27b": published_27b_layout,
    "all_sliding_27b": lambda: published_27b_layout(layer_types=[SLIDING] * 5, sliding_window=512),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engines_resolve_our_config_field_by_field(name, tmp_path):
    cfg = CONFIGS[name]()
    raw = json.loads(json.dumps(drafter_config_to_hf(cfg)))  # as a file would hold it
    hf = hf_qwen3_view(raw)
    sliding = [t == SLIDING for t in cfg.layer_types]

    assert vllm_rope_theta(hf) == sglang_rope_theta(hf) == cfg.rope_theta
    assert [vllm_layer_causal(hf, i) for i in range(cfg.num_layers)] == sliding
    assert [vllm_layer_window(hf, i) for i in range(cfg.num_layers)] == [
        cfg.sliding_window if s else None for s in sliding
    ]
    assert [sglang_layer(hf, i) for i in range(cfg.num_layers)] == [
        (True, cfg.sliding_window - 1) if s else (False, -1) for s in sliding
    ]
    # Taps: vLLM captures the input of layer j+1 = the output of layer j, our convention.
    assert [c - 1 for c in vllm_captured_layers(hf)] == sglang_target_layers(hf) == cfg.tap_layer_ids
    assert vllm_fc_input(hf) == sglang_fc_input(hf) == cfg.num_taps * cfg.hidden_size
    assert vllm_mask_token_id(hf) == sglang_mask_token_id(hf) == cfg.mask_token_id
    assert sglang_block_size(hf) == cfg.block_size  # vLLM takes it from --speculative-config
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (
        cfg.bos_token_id,
        cfg.eos_token_id,
        cfg.pad_token_id,
    )


@pytest.mark.parametrize("name", ["sliding_tiny", "full_tiny"])
def test_engine_attention_rule_equals_our_training_mask(name):
    cfg = CONFIGS[name]()
    hf = hf_qwen3_view(json.loads(json.dumps(drafter_config_to_hf(cfg))))
    num_ctx, bs = 30, cfg.block_size
    seq_start, anchor = [0, 0, 0, 12, 12, 20], [2, 5, 11, 12, 17, 27]  # one block at a sequence start
    for i in range(cfg.num_layers):
        causal, window_left = sglang_layer(hf, i)
        vllm_window = vllm_layer_window(hf, i)
        assert vllm_layer_causal(hf, i) == causal and (vllm_window or 0) - 1 == window_left
        ours = block_mask_dense(
            torch.tensor(seq_start),
            torch.tensor(anchor),
            num_ctx=num_ctx,
            block_size=bs,
            sliding_window=cfg.sliding_window if cfg.sliding_layers[i] else None,
        )
        assert torch.equal(ours, engine_mask(seq_start, anchor, num_ctx, bs, causal, window_left)), f"layer {i}"


@pytest.mark.parametrize("window", [3, 8])
def test_vllm_runs_an_is_causal_false_export_as_we_train_it(window):
    """is_causal false (published DFlash 2 configs) is written back, and vLLM (top-level is_causal first)
    resolves every sliding layer non-causal with its window: our training mask, the block both ways."""
    cfg = tiny_config(layer_types=[SLIDING, SLIDING], sliding_window=window, is_causal=False)
    raw = json.loads(json.dumps(drafter_config_to_hf(cfg)))
    assert raw["is_causal"] is False
    hf = hf_qwen3_view(raw)
    num_ctx, bs = 30, cfg.block_size
    seq_start, anchor = [0, 0, 0, 12, 12, 20], [2, 5, 11, 12, 17, 27]
    for i in range(cfg.num_layers):
        assert not vllm_layer_causal(hf, i) and vllm_layer_window(hf, i) == window
        ours = block_mask_dense(
            torch.tensor(seq_start),
            torch.tensor(anchor),
            num_ctx=num_ctx,
            block_size=bs,
            sliding_window=window,
            causal=cfg.sliding_causal,
        )
        assert torch.equal(ours, engine_mask(seq_start, anchor, num_ctx, bs, False, window - 1)), f"layer {i}"
    assert "is_causal" not in drafter_config_to_hf(cfg.replace(is_causal=None))  # absent stays absent


def test_without_rope_parameters_vllm_would_use_1e6():
    """The export before rope_parameters: vLLM resolved theta 1e6 for a 1e7 drafter."""
    raw = drafter_config_to_hf(published_27b_layout())
    raw.pop("rope_parameters")
    assert vllm_rope_theta(hf_qwen3_view(raw)) == 1e6 != published_27b_layout().rope_theta
    raw = drafter_config_to_hf(published_27b_layout())
    raw["use_sliding_window"] = False  # as the export wrote before sliding layers
    with pytest.raises(ValueError, match="window"):
        vllm_layer_window(hf_qwen3_view(raw), 0)


def test_transformers_reads_the_same_fields(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config(layer_types=[SLIDING, FULL], sliding_window=3, eos_token_id=[5, 6], bos_token_id=4)
    model, _ = tiny_model_and_head(cfg)
    export_drafter(model, cfg, tmp_path)
    hf = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert hf.layer_types == cfg.layer_types and hf.sliding_window == 3
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta
    assert (hf.bos_token_id, hf.eos_token_id) == (4, [5, 6])
    assert [vllm_layer_causal(hf.to_dict(), i) for i in range(2)] == [True, False]


# ---- vLLM's DFlash 2 loader -------------------------------------------------------------------------
# vllm/model_executor/models/qwen3_dflash2.py at 030da624231c394ea975df15248edd9adc9315da (PR #52816), which
# reads these from config.dflash_config only (a top-level copy is never read), each required unless noted:
#   L172 conv_kernel_size, L173 conv_group_size        DFlash2Qwen3DecoderLayer.__init__
#   L175 the convolution's block = 1 + num_speculative_tokens (--speculative-config, not block_size)
#   L296 input_embedding_scale (default 1.0)            DFlash2Qwen3Model.__init__
#   L301 selector_rank, L302 selector_top_k             DFlash2Qwen3Model.__init__
#   L317 output_multiplier (default 1.0), L318 final_logit_softcapping (null or <= 0: none)
# and builds, under its "model." prefix, the modules
#   L178 layers.N.attention_conv, L181 layers.N.mlp_conv, each L109 base_kernel + L113 kernel_projection
#   (.weight: a ReplicatedLinear), L298 candidate_selector: L244 predecessor_codebook, L247
#   successor_codebook (bare nn.Parameters: no ".weight"), L250 hidden_projection (.weight).
# Its compute_candidates (L324-330) refuses a quantised target lm_head.
VLLM_DFLASH2_TENSORS = (
    "attention_conv.base_kernel",
    "attention_conv.kernel_projection.weight",
    "mlp_conv.base_kernel",
    "mlp_conv.kernel_projection.weight",
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
    "candidate_selector.hidden_projection.weight",
)


def vllm_dflash2(cfg: dict, num_speculative_tokens: int) -> dict:
    draft = cfg["dflash_config"]
    softcap = float(draft.get("final_logit_softcapping") or 0.0)
    return {
        "conv_kernel_size": int(draft["conv_kernel_size"]),
        "conv_group_size": int(draft["conv_group_size"]),
        "conv_block": 1 + num_speculative_tokens,
        "input_embedding_scale": float(draft.get("input_embedding_scale", 1.0)),
        "selector_rank": int(draft["selector_rank"]),
        "selector_top_k": int(draft["selector_top_k"]),
        "output_multiplier": float(draft.get("output_multiplier", 1.0)),
        "final_logit_softcapping": softcap if softcap > 0 else None,
    }


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_vllm_dflash2_loader_finds_every_field_and_tensor_of_our_export(softcap, tmp_path):
    """Every DFlash 2 field vLLM reads resolves to the drafter's own value from the written config.json
    (its block from the serve command we print), every DFlash 2 module it builds has our tensor, and the
    export says vLLM needs the target's LM head unquantised."""
    from safetensors import safe_open

    from train.checkpoint.serving import serve_commands

    cfg = tiny_config(
        arch="dflash2",
        block_size=8,
        conv_kernel_size=3,
        conv_group_size=8,
        selector_rank=4,
        selector_top_k=8,
        input_embedding_scale=1.5,
        output_multiplier=0.25,
        final_logit_softcapping=softcap,
    )
    model, _ = tiny_model_and_head(cfg)
    export_drafter(model, cfg, tmp_path / "d2")
    raw = json.loads((tmp_path / "d2" / "config.json").read_text())
    commands = serve_commands(cfg, str(tmp_path / "d2"), "TARGET")
    words = shlex.split(next(line for line in commands if "vllm serve" in line))
    speculative = json.loads(words[words.index("--speculative-config") + 1])
    resolved = vllm_dflash2(raw, speculative["num_speculative_tokens"])
    assert resolved == {
        "conv_kernel_size": 3,
        "conv_group_size": 8,
        "conv_block": cfg.block_size,
        "input_embedding_scale": 1.5,
        "selector_rank": 4,
        "selector_top_k": 8,
        "output_multiplier": 0.25,
        "final_logit_softcapping": softcap,
    }
    with safe_open(str(tmp_path / "d2" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    wanted = {f"layers.{i}.{t}" for i in range(cfg.num_layers) for t in VLLM_DFLASH2_TENSORS[:4]}
    wanted |= set(VLLM_DFLASH2_TENSORS[4:])
    assert wanted <= names, sorted(wanted - names)
    assert any("LM head unquantised" in line for line in commands)
