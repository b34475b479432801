"""DFlash 2 through dflash-train: a run with --arch dflash2 trains, logs the selector's loss and metrics and
records its choices; its export loads back (ours and z-lab's names) with the same logits and selector
path; a DFlash 1 drafter is a warm start that changes nothing."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from shards import ShardReader, decode_hidden, load_target_head
from tests.helpers.train import read_records, tiny_cache, tiny_cli_args, tiny_config
from train.blocks import sample_shard_blocks
from train.checkpoint.export import drafter_from_checkpoint, load_drafter_weights_, load_exported_drafter
from train.checkpoint.store import resolve_checkpoint
from train.checkpoint.train_state import train_state
from train.cli import main as train_cli
from train.drafter.attention import BlockAttentionLayout
from train.drafter.model import DFlashDrafter, TargetHead
from train.resolve import resolve_run

DFLASH2_FLAGS = ("--arch", "dflash2", "--max-steps", "3", "--metrics-every", "1", "--checkpoint-every", "0")


def _train(tmp_path, name, *extra):
    cache = tmp_path / "cache"
    if not cache.exists():
        tiny_cache(cache, num_batches=4)
    res = CliRunner().invoke(train_cli, tiny_cli_args(cache, tmp_path / name, *extra))
    assert res.exit_code == 0, res.output
    return cache, tmp_path / name, res.output


def _forward(model, cache, block_size=4):
    """The drafter's hidden states on the cache's first shard (8 seeded blocks), its head and blocks."""
    reader = ShardReader(cache)
    t, _ = reader.read(0)
    raw = load_target_head(cache)
    head = TargetHead(raw["embed_tokens"].float(), raw["lm_head"].float())
    blocks = sample_shard_blocks(
        t,
        num_blocks=8,
        block_size=block_size,
        mask_token_id=model.config.mask_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    layout = BlockAttentionLayout.for_drafter(model.config, num_ctx=reader.config.token_budget, num_blocks=8)
    layout.update(blocks.seq_start_N, blocks.anchor_N)
    hidden = decode_hidden(t["hidden"], t.get("hidden_scale")).float()
    with torch.no_grad():
        out = model(hidden, t["position_ids"], head.embed(blocks.block_ids_NB), blocks.block_pos_NB, layout)
    return out, head, blocks


def test_a_dflash2_run_trains_logs_the_selector_and_exports_what_loads_back(tmp_path):
    cache, run, output = _train(tmp_path, "run", *DFLASH2_FLAGS, "--selector-gold", "swap", "--lr", "3e-3")
    records = read_records(run)
    assert all("loss/selector" in r for r in records)
    last = records[-1]
    for key in ("selector/recall_at_k", "selector/tf_accuracy", "selector/path_accept"):
        assert key in last, sorted(last)
    ckpt = resolve_checkpoint(run)
    state = train_state(ckpt)
    assert state.drafter.arch == "dflash2" and state.config_identity["selector_gold"] == "swap"
    model, cfg = drafter_from_checkpoint(ckpt)
    assert model.layers[0].attention_conv.base_kernel[0, 1:].abs().sum() > 0  # trained: no longer the identity

    res = CliRunner().invoke(train_cli, ["export", str(run), str(tmp_path / "exported")])
    assert res.exit_code == 0, res.output
    assert "LM head unquantised" in res.output
    hf = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert hf["architectures"] == ["DFlash2DraftModel"]
    assert {
        k: hf["dflash_config"][k]
        for k in ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    } == {
        "block_size": 4,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 256,
        "selector_top_k": 16,
    }
    with safe_open(tmp_path / "exported" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"} <= names
    assert "layers.0.mlp_conv.kernel_projection.weight" in names

    loaded, loaded_cfg = load_exported_drafter(tmp_path / "exported", dtype=torch.float32)
    assert loaded_cfg == cfg.replace(max_position_embeddings=loaded_cfg.max_position_embeddings)
    model = model.to(torch.bfloat16).float()  # the export is bf16: compare against the same rounding
    ours, head, blocks = _forward(model, cache)
    theirs, _, _ = _forward(loaded, cache)
    assert torch.equal(ours, theirs)
    assert torch.equal(model.draft_logits(ours[:, 1:], head), loaded.draft_logits(theirs[:, 1:], head))
    anchors = blocks.block_ids_NB[:, 0]
    assert torch.equal(
        model.selector_path(ours[:, 1:], head, anchors), loaded.selector_path(theirs[:, 1:], head, anchors)
    )


def test_a_dflash1_drafter_is_a_warm_start_that_changes_nothing(tmp_path):
    cache, first, _ = _train(tmp_path, "first", "--max-steps", "2", "--checkpoint-every", "0", "--lr", "3e-3")
    assert CliRunner().invoke(train_cli, ["export", str(first), str(tmp_path / "v1")]).exit_code == 0
    v1, _ = load_exported_drafter(tmp_path / "v1", dtype=torch.float32)

    cfg = tiny_config(cache, tmp_path / "second", arch="dflash2", init_from=str(tmp_path / "v1"), num_layers=None)
    dcfg = resolve_run(cfg).drafter
    assert dcfg.arch == "dflash2" and dcfg.layer_types == v1.config.layer_types
    torch.manual_seed(1)
    v2 = DFlashDrafter(dcfg)
    load_drafter_weights_(v2, tmp_path / "v1")
    h1, head, blocks = _forward(v1, cache)
    h2, _, _ = _forward(v2, cache)
    assert torch.equal(h1, h2)  # the convolutions are the identity
    path = v2.selector_path(h2[:, 1:], head, blocks.block_ids_NB[:, 0])
    assert torch.equal(path, v1.draft_logits(h1[:, 1:], head).argmax(-1))  # the selector adds nothing yet
    # ... but it trains: the warm-started run's selector moves.
    _, second, _ = _train(tmp_path, "second", *DFLASH2_FLAGS, "--init-from", str(tmp_path / "v1"), "--num-layers", "1")
    trained, _ = drafter_from_checkpoint(resolve_checkpoint(second))
    assert trained.candidate_selector.hidden_projection.weight.abs().sum() > 0


def test_a_dflash2_drafter_is_not_fine_tuned_as_dflash1(tmp_path):
    cache, run, _ = _train(tmp_path, "run", *DFLASH2_FLAGS)
    assert CliRunner().invoke(train_cli, ["export", str(run), str(tmp_path / "v2")]).exit_code == 0
    with pytest.raises(ValueError, match="--arch dflash: the drafter is dflash2"):
        resolve_run(tiny_config(cache, tmp_path / "x", arch="dflash", init_from=str(tmp_path / "v2"), num_layers=None))


def test_the_export_holds_exactly_the_released_dflash2_tensor_names(tmp_path):
    """The names z-lab's DFlash2DraftModel loads (0 missing, 0 unexpected), written out here for one layer."""
    from tests.helpers.drafter import tiny_config as drafter_config
    from train.checkpoint.export import export_drafter

    cfg = drafter_config(num_layers=1, arch="dflash2", conv_group_size=8, selector_rank=4, selector_top_k=8)
    export_drafter(DFlashDrafter(cfg), cfg, tmp_path / "d2")
    with safe_open(tmp_path / "d2" / "model.safetensors", "pt") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    layer = "layers.0."
    want = {
        "fc.weight": [32, 3 * 32],
        "hidden_norm.weight": [32],
        "norm.weight": [32],
        layer + "input_layernorm.weight": [32],
        layer + "post_attention_layernorm.weight": [32],
        layer + "self_attn.q_proj.weight": [32, 32],
        layer + "self_attn.k_proj.weight": [16, 32],
        layer + "self_attn.v_proj.weight": [16, 32],
        layer + "self_attn.o_proj.weight": [32, 32],
        layer + "self_attn.q_norm.weight": [8],
        layer + "self_attn.k_norm.weight": [8],
        layer + "mlp.gate_proj.weight": [48, 32],
        layer + "mlp.up_proj.weight": [48, 32],
        layer + "mlp.down_proj.weight": [32, 48],
        # base kernel [before/after, taps, hidden]; projection to 2 x taps x (hidden / group) values
        layer + "attention_conv.base_kernel": [2, 2, 32],
        layer + "attention_conv.kernel_projection.weight": [2 * 2 * 4, 32],
        layer + "mlp_conv.base_kernel": [2, 2, 32],
        layer + "mlp_conv.kernel_projection.weight": [2 * 2 * 4, 32],
        "candidate_selector.predecessor_codebook": [97, 4],
        "candidate_selector.successor_codebook": [97, 4],
        "candidate_selector.hidden_projection.weight": [4, 32],
    }
    assert shapes == want


@pytest.mark.parametrize("block_size", [8, 16])
def test_dflash2_steps_at_the_published_block_sizes(tmp_path, block_size):
    """Block 8 (Qwen3.8-27B-DFlash2) and 16 both train: every selector figure counted and finite."""
    import math

    from tests.helpers.train import run_steps
    from train.metrics.sums import COUNT

    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    out = run_steps(cache, tmp_path / "run", 2, arch="dflash2", block_size=block_size, num_blocks=4)
    sums = out["state"].totals.sums
    for name in ("selector_loss", "selector_recall", "selector_accuracy", "selector_accept"):
        count = float(sums.view(name + COUNT))
        assert count > 0 and math.isfinite(float(sums.view(name))), name
    assert all(torch.isfinite(g).all() for g in out["grads"])
    moved = out["params"]["candidate_selector.hidden_projection.weight"]
    assert moved.abs().sum() > 0  # the step updates the selector from its zero start


def test_a_published_is_causal_false_drafter_fine_tunes_and_exports_as_published(tmp_path):
    """The published DFlash 2 configs (Muse-Glimmer, SpecForge's Qwen3.6-27B layout) set is_causal false over
    all-sliding layers: --init-from such a directory trains, and the export says is_causal false again."""
    cache, run, _ = _train(tmp_path, "run", *DFLASH2_FLAGS)
    assert CliRunner().invoke(train_cli, ["export", str(run), str(tmp_path / "published")]).exit_code == 0
    config_path = tmp_path / "published" / "config.json"
    published = json.loads(config_path.read_text()) | {"is_causal": False}
    config_path.write_text(json.dumps(published))

    _, tuned, _ = _train(
        tmp_path, "tuned", "--max-steps", "1", "--init-from", str(tmp_path / "published"), "--num-layers", "1"
    )
    state = train_state(resolve_checkpoint(tuned))
    assert state.drafter.is_causal is False and state.drafter.arch == "dflash2" and state.step == 1
    assert CliRunner().invoke(train_cli, ["export", str(tuned), str(tmp_path / "again")]).exit_code == 0
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    for key in ("is_causal", "layer_types", "sliding_window", "use_sliding_window", "dflash_config", "block_size"):
        assert again[key] == published[key], key
    loaded, loaded_cfg = load_exported_drafter(tmp_path / "again", dtype=torch.float32)
    assert loaded_cfg.is_causal is False and not loaded_cfg.sliding_causal
