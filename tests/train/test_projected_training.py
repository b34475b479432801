"""Training on a projected cache (dflash-extract --pca-rank): the drafter's fc' reads the codes, the export
folds it into a standard drafter that computes the same on the full taps, --init-from starts from the
published fc projected, and drafters or projections that do not fit are refused."""

from __future__ import annotations

import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from extract.dataset.index import write_jsonl
from extract.runner import run_extract
from shards import CacheFormatError, ShardReader, load_target_head, read_cache_config
from shards.projection import applied_matrix, load_projection, write_projection
from tests.helpers.extract import extract_cfg
from tests.helpers.train import hand_step_loss, read_records, tiny_cache, tiny_config
from tools.cli.verifier import TargetVerifier
from tools.fixtures.demo_data import greedy_continuations
from tools.fixtures.tiny_target import write_random_checkpoint
from train.checkpoint.export import drafter_from_checkpoint, load_exported_drafter, served_state
from train.checkpoint.store import resolve_checkpoint
from train.cli import main as train_cli
from train.drafter.attention import full_attention
from train.drafter.model import DFlashDrafter, TargetHead
from train.eval.config import EvalConfig
from train.eval.evaluate import evaluate_drafter
from train.eval.run import load_drafter, run_eval
from train.eval.speculative import ChainProposer, decode_prompts
from train.loop import run_training
from train.optim import OptimConfig
from train.resolve import resolve_run
from train.step import build_step_state

RANK = 12  # of 3 taps x 32 = 96 dims: 1/8


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A projected fp8 cache, a short run on it with a checkpoint, and that checkpoint exported."""
    tmp = tmp_path_factory.mktemp("projected")
    cache = tiny_cache(tmp / "cache", num_batches=4, storage_dtype="fp8", pca_rank=RANK)
    run_training(tiny_config(cache, tmp / "run", max_steps=3, lr=3e-3, checkpoint_every=3))
    result = CliRunner().invoke(train_cli, ["export", str(tmp / "run"), str(tmp / "exported")])
    assert result.exit_code == 0, result.output
    return tmp, cache


def full_taps_and_blocks(cfg, num_ctx: int = 9, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    taps = torch.randn(num_ctx, cfg.num_taps, cfg.hidden_size, generator=g, dtype=torch.float64) * 3
    block = torch.randn(cfg.block_size, cfg.hidden_size, generator=g, dtype=torch.float64)
    return taps, block, torch.arange(num_ctx), torch.arange(num_ctx, num_ctx + cfg.block_size)


def test_the_export_on_full_taps_computes_what_was_trained_on_codes(trained):
    tmp, cache = trained
    ckpt = resolve_checkpoint(tmp / "run")
    model, cfg = drafter_from_checkpoint(ckpt)
    assert (cfg.context_width, model.fc.weight.shape) == (RANK, (cfg.hidden_size, RANK))
    P, D = load_projection(cache, read_cache_config(cache))
    A = applied_matrix(P, D)
    assert torch.equal(model.context_projection, A), "the checkpoint holds the cache's A = P D"
    # float64: the trained drafter on codes z = A h against the folded one (served_state) on h.
    model = model.double()
    state, served_cfg = served_state(model, cfg)
    assert served_cfg.context_width is None and "context_projection" not in state
    served = DFlashDrafter(served_cfg).double()
    served.load_state_dict(state, strict=True)
    taps, block, ctx_pos, blk_pos = full_taps_and_blocks(cfg)
    codes = (taps.flatten(1) @ A.double().T).unsqueeze(1)
    with torch.no_grad():
        torch.testing.assert_close(served.fuse_context(taps), model.fuse_context(codes), rtol=1e-12, atol=1e-12)
        on_codes = model._run_layers(  # the training / walk path: the codes as the cache stores them
            model.fuse_context(codes), ctx_pos, block, blk_pos, [full_attention] * cfg.num_layers
        )
        exported = served.forward_block(taps, ctx_pos, block, blk_pos)
        live = model.forward_block(taps, ctx_pos, block, blk_pos)  # --target decoding: full taps, projected
    torch.testing.assert_close(exported, on_codes, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(live, exported, rtol=1e-10, atol=1e-10)
    # The file: fc = fc' A multiplied in float32, cast to bf16 once; every other tensor as trained.
    fp32_model, _ = drafter_from_checkpoint(ckpt)
    with safe_open(str(tmp / "exported" / "model.safetensors"), "pt") as f:
        fc = f.get_tensor("fc.weight")
        assert torch.equal(fc, (fp32_model.fc.weight @ A).bfloat16())
        assert torch.equal(
            f.get_tensor("layers.0.mlp.up_proj.weight"), fp32_model.layers[0].mlp.up_proj.weight.bfloat16()
        )
    loaded, loaded_cfg = load_exported_drafter(tmp / "exported")
    assert loaded_cfg.context_width is None and loaded.fc.weight.shape == (cfg.hidden_size, 3 * cfg.hidden_size)


def test_the_first_step_trains_on_the_codes(trained, tmp_path):
    _, cache = trained
    cfg = tiny_config(cache, tmp_path / "run", max_steps=1)
    run_training(cfg)
    run = resolve_run(cfg)
    torch.manual_seed(cfg.seed)
    model = DFlashDrafter(run.drafter)
    with torch.no_grad():
        want = hand_step_loss(model, run.drafter, cache, cfg).total.item()
    assert read_records(tmp_path / "run")[0]["loss/total"] == pytest.approx(want, rel=1e-5)


def test_init_from_starts_from_the_published_fc_projected(trained, tmp_path):
    _, cache = trained
    full_cache = tiny_cache(tmp_path / "full", num_batches=3)  # the same tiny target, taps stored
    run_training(tiny_config(full_cache, tmp_path / "first", max_steps=2, checkpoint_every=2))
    assert (
        CliRunner().invoke(train_cli, ["export", str(tmp_path / "first"), str(tmp_path / "published")]).exit_code == 0
    )
    cfg = tiny_config(cache, tmp_path / "second", max_steps=1, init_from=str(tmp_path / "published"))
    run = resolve_run(cfg)
    state = build_step_state(cfg, run, load_target_head(cache), torch.device("cpu"))
    published, _ = load_exported_drafter(tmp_path / "published", dtype=torch.float64)
    P, D = (t.double() for t in load_projection(cache, run.cache_config))
    want = published.fc.weight @ torch.diag(1 / D) @ P.T  # W0 D^-1 P^T
    torch.testing.assert_close(state.model.fc.weight.double(), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        state.model.layers[0].mlp.up_proj.weight.double(), published.layers[0].mlp.up_proj.weight, rtol=0, atol=0
    )


def test_a_drafter_of_another_width_or_taps_is_refused_on_a_projected_cache(trained, tmp_path):
    tmp, cache = trained
    other = tiny_cache(tmp_path / "wide", num_batches=3, hidden_size=64)
    run_training(tiny_config(other, tmp_path / "wide-run", max_steps=1, checkpoint_every=1))
    assert (
        CliRunner().invoke(train_cli, ["export", str(tmp_path / "wide-run"), str(tmp_path / "wide-export")]).exit_code
        == 0
    )
    with pytest.raises(ValueError, match="hidden_size: drafter 64, cache 32"):
        resolve_run(tiny_config(cache, tmp_path / "x", init_from=str(tmp_path / "wide-export")))
    with pytest.raises(ValueError, match="hidden/vocab: drafter 64/128, cache 32/128"):
        run_eval(EvalConfig(drafter=str(tmp_path / "wide-run"), cache=str(cache), eval_shards=1, device="cpu"))
    # The export reads full taps, which a projected cache does not hold: refused, naming both.
    with pytest.raises(ValueError, match=f"context: drafter reads the full taps, cache stores {RANK} projected codes"):
        run_eval(EvalConfig(drafter=str(tmp / "exported"), cache=str(cache), eval_shards=1, device="cpu"))
    # A checkpoint evaluated on its own cache walks the codes.
    out = run_eval(EvalConfig(drafter=str(tmp / "run"), cache=str(cache), eval_shards=1, device="cpu"))
    assert out.walk.acceptance_length >= 1.0


def test_a_replaced_projection_is_refused_before_training(trained, tmp_path):
    _, cache = trained
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    P, D = load_projection(copy, read_cache_config(copy))
    write_projection(copy, P, D * 2)
    with pytest.raises(CacheFormatError, match="holds another projection"):
        resolve_run(tiny_config(copy, tmp_path / "run", max_steps=1))


@pytest.mark.slow
def test_real_decoding_projects_the_live_taps_as_the_walk_reads_the_codes(tmp_path):
    """Trained on a projected cache of the target's own greedy continuations: real speculative decoding
    (the live target's taps through A) stays lossless and accepts what the walk over the codes does, up to
    the bf16 rounding of the stored codes."""
    target = write_random_checkpoint(tmp_path / "target", seed=0, dtype=torch.float32, mixer_scale=0.1)
    samples = greedy_continuations(target, num_samples=24, prompt_len=(4, 12), new_tokens=20)
    write_jsonl(tmp_path / "data.jsonl", samples)
    cache = tmp_path / "cache"
    run_extract(extract_cfg(target, tmp_path / "data.jsonl", cache, pca_rank=160, pca_normalize="none"))
    quiet = dict(warmup_ratio=OptimConfig.warmup_ratio, log_every=1000, metrics_every=1000)
    run_training(tiny_config(cache, tmp_path / "run", epochs=30, num_blocks=32, lr=3e-3, **quiet))
    loaded = load_drafter(tmp_path / "run")
    model = loaded.model.eval()
    head_t = load_target_head(cache)
    walk = evaluate_drafter(
        model,
        TargetHead(head_t["embed_tokens"].float(), head_t["lm_head"].float()),
        str(cache),
        ShardReader(cache).batch_ids(),
        budgets=(),
    ).walk
    verifier = TargetVerifier(target, loaded.config.tap_layer_ids, "cpu", torch.float32)
    prompts = [s.input_ids[: int(s.loss_mask.argmax())].tolist() for s in samples]
    proposer = ChainProposer(model, TargetHead(verifier.embed_tokens_VH, verifier.lm_head_VH))
    real = decode_prompts(proposer, verifier, prompts, 20)
    assert real.identical == len(prompts), "speculative decoding stays lossless"
    assert sum(walk.accepted_histogram[1:]) >= 10, f"the test needs accepted drafts to mean anything ({walk})"
    assert (real.walk.steps, real.walk.tokens) != (0, 0)
    assert real.walk.acceptance_length == pytest.approx(walk.acceptance_length, rel=0.05)
