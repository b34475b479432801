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
