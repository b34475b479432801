"""Export to z-lab's DFlashDraftModel layout and reload (train/checkpoint/export.py)."""

import json

import pytest
import torch
from safetensors import safe_open

from tests.helpers.drafter import tiny_config, tiny_model_and_head
from train.checkpoint.export import (
    drafter_config_from_hf,
    drafter_config_to_hf,
    export_drafter,
    load_exported_drafter,
    zlab_parameter_names,
)


def zlab_names_written_out(num_layers: int) -> list[str]:
    """The published DFlashDraftModel names, spelled out independently of train/checkpoint/export.py."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(num_layers):
        names += [
            f"layers.{i}.input_layernorm.weight",
            f"layers.{i}.post_attention_layernorm.weight",
            f"layers.{i}.self_attn.q_proj.weight",
            f"layers.{i}.self_attn.k_proj.weight",
            f"layers.{i}.self_attn.v_proj.weight",
            f"layers.{i}.self_attn.o_proj.weight",
            f"layers.{i}.self_attn.q_norm.weight",
            f"layers.{i}.self_attn.k_norm.weight",
            f"layers.{i}.mlp.gate_proj.weight",
            f"layers.{i}.mlp.up_proj.weight",
            f"layers.{i}.mlp.down_proj.weight",
        ]
    return names


def test_export_layout_and_reload_gives_identical_logits(tmp_path):
    cfg = tiny_config(num_layers=2, block_size=6)
    model, head = tiny_model_and_head(cfg, dtype=torch.bfloat16)
    export_drafter(model, cfg, tmp_path / "drafter")

    hf = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["model_type"] == "qwen3"
    assert hf["dflash_config"] == {"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.tap_layer_ids}
    assert (hf["block_size"], hf["num_target_layers"], hf["num_hidden_layers"]) == (6, cfg.num_target_layers, 2)
    assert hf["layer_types"] == ["full_attention"] * 2 and hf["tie_word_embeddings"] is False
    assert hf["dtype"] == "bfloat16"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "vocab_size",
    ):
        assert key in hf, key
    with safe_open(str(tmp_path / "drafter" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in keys)
    assert sorted(keys) == sorted(zlab_names_written_out(2)) == sorted(zlab_parameter_names(cfg))

    loaded, cfg2 = load_exported_drafter(tmp_path / "drafter")
    assert cfg2 == cfg
    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(7, cfg.num_taps, cfg.hidden_size, generator=g).bfloat16()
    ids = torch.tensor([4] + [cfg.mask_token_id] * 5)
    with torch.no_grad():
        a = head.logits(model.forward_block(ctx, torch.arange(7), head.embed(ids), torch.arange(7, 13)))
        b = head.logits(loaded.forward_block(ctx, torch.arange(7), head.embed(ids), torch.arange(7, 13)))
    assert torch.equal(a, b), f"max abs diff {(a.float() - b.float()).abs().max().item()}"


def test_reload_refuses_wrong_names(tmp_path):
    cfg = tiny_config(num_layers=1)
    model, _ = tiny_model_and_head(cfg)
    export_drafter(model, cfg, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="layer_types"):  # one entry for two layers
        load_exported_drafter(tmp_path)
    hf.update(num_hidden_layers=2, layer_types=["full_attention"] * 2)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="the weights hold layers 0-0, .*config.json describes 2"):
        load_exported_drafter(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(ValueError, match="DFlashDraftModel"):
        load_exported_drafter(tmp_path)


def test_config_json_parses_as_hf_qwen3_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config()
    model, _ = tiny_model_and_head(cfg)
    export_drafter(model, cfg, tmp_path)
    hf = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert type(hf).__name__ == "Qwen3Config"
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (
        cfg.hidden_size,
        cfg.num_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta
    assert hf.dflash_config["target_layer_ids"] == cfg.tap_layer_ids and hf.block_size == cfg.block_size


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_export_refuses_a_wrapped_model_instead_of_guessing_names(tmp_path):
    """Nothing here wraps the drafter (no DDP, no torch.compile of the module), so export takes the bare
    DFlashDrafter: a wrapper's prefixed names are refused by name, and nothing is written."""
    cfg = tiny_config(num_layers=1)
    model, _ = tiny_model_and_head(cfg)
    wrapped = torch.compile(model)  # not run: only its ._orig_mod naming matters here
    with pytest.raises(ValueError, match=r"extra \['_orig_mod\."):
        export_drafter(wrapped, cfg, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_sliding_drafter_export_and_reload_gives_identical_logits(tmp_path):
    from tests.helpers.drafter import batch_blocks, make_batch
    from train.drafter.attention import BlockAttentionLayout

    cfg = tiny_config(
        num_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=5,
        block_size=4,
    )
    model, head = tiny_model_and_head(cfg, dtype=torch.bfloat16)
    export_drafter(model, cfg, tmp_path / "drafter")
    hf = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert hf["layer_types"] == cfg.layer_types and hf["sliding_window"] == 5 and hf["use_sliding_window"] is True
    loaded, cfg2 = load_exported_drafter(tmp_path / "drafter")
    assert cfg2 == cfg
    batch = make_batch([20, 28], 48, 4, cfg.num_taps, cfg.hidden_size)
    blocks = batch_blocks(
        batch, num_blocks=8, block_size=4, mask_token_id=cfg.mask_token_id, generator=torch.Generator().manual_seed(1)
    )
    layout = BlockAttentionLayout(num_ctx=48, num_blocks=8, block_size=4, sliding_window=cfg2.attention_window)
    layout.update(blocks.seq_start_N, blocks.anchor_N)
    hidden = batch["hidden_TKH"].bfloat16()
    with torch.no_grad():
        outs = [
            head.logits(
                m(hidden, batch["position_ids_T"], head.embed(blocks.block_ids_NB), blocks.block_pos_NB, layout)
            )
            for m in (model, loaded)
        ]
        ctx, ids = hidden[:9], torch.tensor([4] + [cfg.mask_token_id] * 3)
        outs += [
            head.logits(m.forward_block(ctx, torch.arange(9), head.embed(ids), torch.arange(9, 13)))
            for m in (model, loaded)
        ]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])


def test_sharded_published_directory_loads(tmp_path):
    """A published layout: weights split over two files named by model.safetensors.index.json."""
    from safetensors.torch import save_file

    cfg = tiny_config(num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    model, _ = tiny_model_and_head(cfg)
    state = {k: v.detach().bfloat16().contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}})
    )
    published = {  # written as the published configs spell it: rope_theta only, no rope_parameters
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.tap_layer_ids},
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "num_target_layers": 4,
        "vocab_size": 97,
        "hidden_act": "silu",
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "use_sliding_window": True,
        "max_window_layers": 2,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(published))
    loaded, cfg2 = load_exported_drafter(tmp_path, dtype=torch.float32)
    assert cfg2 == cfg.replace(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    for name, t in state.items():
        assert torch.equal(loaded.get_parameter(name).bfloat16(), t), name
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_exported_drafter(tmp_path)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"is_causal": True}, "is_causal"),
        ({"dflash_config": {"mask_token_id": 96, "target_layer_ids": [0, 2, 3], "causal": False}}, "causal"),
        ({"dflash_config": {"mask_token_id": 96, "target_layer_ids": [0, 2, 3], "is_causal": False}}, "is_causal"),
        ({"dflash_config": {"mask_token_id": 96, "target_layer_ids": [0, 2, 3], "use_swa": True}}, "use_swa"),
        ({"use_sliding_window": False}, "use_sliding_window"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_theta"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}}, "rope_type"),
        ({"target_hidden_size": 64}, "target_hidden_size"),
        ({"dflash_config": {"mask_token_id": None, "target_layer_ids": [0, 2, 3]}}, "mask-token-id"),
    ],
)
def test_reload_refuses_fields_we_do_not_train(tmp_path, change, field):
    cfg = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    model, _ = tiny_model_and_head(cfg)
    export_drafter(model, cfg, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, **change}))
    with pytest.raises(ValueError, match=field):
        load_exported_drafter(tmp_path)


# z-lab/dflash tests/fixtures/dflash2-config.json: the released Muse-Glimmer-30B-DFlash2 config.json.
MUSE_GLIMMER_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 200000,
    "is_causal": False,
    "dflash_config": {
        "block_size": 16,
        "conv_group_size": 16,
        "conv_kernel_size": 2,
        "final_logit_softcapping": 20.0,
        "mask_token_id": 201818,
        "output_multiplier": 0.19611613513818404,
        "selector_rank": 256,
        "selector_top_k": 16,
        "target_layer_ids": [1, 13, 25, 37, 49],
    },
    "dtype": "bfloat16",
    "eos_token_id": 200001,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 6656,
    "initializer_range": 0.02,
    "intermediate_size": 19968,
    "layer_types": ["sliding_attention"] * 5,
    "max_position_embeddings": 131072,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 52,
    "pad_token_id": 200018,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "sliding_window": 2048,
    "tie_word_embeddings": False,
    "transformers_version": "5.15.0",
    "use_cache": False,
    "use_sliding_window": True,
    "vocab_size": 202048,
}


def test_the_released_dflash2_config_reads_and_writes_back_as_published():
    """Every field of the released config.json that engines read comes back with its published value and
    where it was published: is_causal at the top level, the logit transform in dflash_config (where vLLM's
    qwen3_dflash2.py reads output_multiplier and final_logit_softcapping)."""
    cfg = drafter_config_from_hf(MUSE_GLIMMER_DFLASH2)
    assert cfg.is_causal is False and not cfg.sliding_causal and cfg.arch == "dflash2"
    assert (cfg.output_multiplier, cfg.final_logit_softcapping) == (0.19611613513818404, 20.0)
    written = drafter_config_to_hf(cfg)
    not_ours = {"transformers_version", "use_cache"}  # HF bookkeeping no engine reads for the drafter
    for key in MUSE_GLIMMER_DFLASH2.keys() - not_ours - {"dflash_config"}:
        assert written[key] == MUSE_GLIMMER_DFLASH2[key], key
    for key, value in MUSE_GLIMMER_DFLASH2["dflash_config"].items():
        assert written["dflash_config"][key] == value, f"dflash_config.{key}"
    assert drafter_config_from_hf(written) == cfg
