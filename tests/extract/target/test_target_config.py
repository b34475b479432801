"""TargetConfig: both config.json layouts, derived layer types, DFlash taps, fingerprint, refusals."""

import json

import pytest

from extract.target.config import TargetConfig, default_tap_layer_ids
from tools.fixtures.tiny_target import tiny_config_dict

# The Qwen3.6-27B text_config as published (reference/qwen35-target.md section 1.1).
QWEN36_27B_TEXT = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "bos_token_id": 248044,
    "dtype": "bfloat16",
    "eos_token_id": 248044,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 17408,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "model_type": "qwen3_5_text",
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 24,
    "num_hidden_layers": 64,
    "num_key_value_heads": 4,
    "output_gate_type": "swish",
    "pad_token_id": None,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 248320,
}
QWEN36_27B_TEXT["layer_types"] = QWEN36_27B_TEXT["layer_types"] * 16
QWEN36_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": QWEN36_27B_TEXT,
    "tie_word_embeddings": False,
    "vision_config": {"depth": 27},
}


def test_27b_multimodal_layout_reads_every_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN36_27B))
    cfg = TargetConfig.from_dir(tmp_path)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size) == (5120, 64, 17408, 248320)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (16, 48, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim) == (24, 4, 256, 64)
    assert cfg.rope_theta == 1e7 and cfg.linear_conv_dim == 10240 and not cfg.tie_word_embeddings
    assert [i for i in range(64) if cfg.is_full_attention(i)] == list(range(3, 64, 4))
    assert cfg.default_tap_layer_ids(5) == [1, 16, 31, 46, 61]


def test_plain_text_layout_derives_layer_types_from_interval():
    text = dict(tiny_config_dict(num_hidden_layers=8))
    del text["layer_types"]
    text["full_attention_interval"] = 4
    cfg = TargetConfig.from_hf_dict(text)
    assert cfg.layer_types == tuple(["linear_attention"] * 3 + ["full_attention"]) * 2
    assert cfg == TargetConfig.from_hf_dict(tiny_config_dict(num_hidden_layers=8))


def test_fingerprint_is_stable_and_sensitive():
    a = TargetConfig.from_hf_dict(tiny_config_dict())
    reordered = dict(reversed(list(tiny_config_dict().items())))
    reordered["transformers_version"] = "9.9.9"  # not part of the decoder's math
    assert TargetConfig.from_hf_dict(reordered).fingerprint() == a.fingerprint()
    assert TargetConfig.from_hf_dict(tiny_config_dict(hidden_size=96)).fingerprint() != a.fingerprint()
    assert len(a.fingerprint()) == 64


@pytest.mark.parametrize(
    "layers,taps,expected", [(64, 5, [1, 16, 31, 46, 61]), (8, 1, [4]), (8, 3, [1, 3, 5]), (32, 5, [1, 8, 15, 22, 29])]
)
def test_default_tap_layer_ids(layers, taps, expected):
    assert default_tap_layer_ids(layers, taps) == expected


@pytest.mark.parametrize(
    "field,value",
    [("linear_num_value_heads", 5), ("num_key_value_heads", 3), ("hidden_size", 0), ("rms_norm_eps", 0.0)],
)
def test_bad_field_is_named(field, value):
    text = tiny_config_dict()
    text[field] = value
    with pytest.raises(ValueError, match=field):
        TargetConfig.from_hf_dict(text)


def test_missing_field_and_missing_file_are_named(tmp_path):
    text = tiny_config_dict()
    del text["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        TargetConfig.from_hf_dict(text)
    with pytest.raises(FileNotFoundError, match="config.json"):
        TargetConfig.from_dir(tmp_path)


def test_stop_ids_are_every_eos_the_checkpoint_declares(tmp_path):
    """Qwen3.5 declares <|endoftext|> in text_config, <|im_end|> at the top level; generation_config adds its own."""
    from extract.target.config import stop_token_ids
    from shards.common.json_input import InputFileError

    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {**QWEN36_27B_TEXT, "eos_token_id": 248044}, "eos_token_id": 248046})
    )
    assert stop_token_ids(tmp_path) == {248044, 248046}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [248046, 7], "top_p": 0.95}))
    assert stop_token_ids(tmp_path) == {248044, 248046, 7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "<|im_end|>"}))
    with pytest.raises(InputFileError, match=r"generation_config\.json: eos_token_id must be a token id"):
        stop_token_ids(tmp_path)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(InputFileError, match="expected a JSON object"):
        stop_token_ids(tmp_path)
