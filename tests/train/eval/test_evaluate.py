"""Evaluation: DDTree tree acceptance against brute force, the random-anchor diagnostics against
per-block inference forwards, and a learning test (training raises held-out acceptance clearly).
The decoding walk itself is tested in test_train_walk.py."""

from __future__ import annotations

import itertools
import json
import random
from types import SimpleNamespace

import pytest
import torch

from shards import ShardReader, decode_hidden, load_target_head
from tests.helpers.drafter import drafter_for_target
from tests.helpers.train import make_learnable, tiny_cache, tiny_config
from train.blocks import sample_shard_blocks
from train.drafter.model import DFlashDrafter, TargetHead
from train.eval.evaluate import evaluate_drafter, tree_acceptance
from train.loop import run_training


def brute_force_tree_acceptance(logp, ids, labels, valid, budget):
    """The tree = the `budget` highest-scoring rank-prefixes (score = summed log-prob), by enumeration."""
    depths, ranks = len(logp), len(logp[0])
    prefixes = [p for d in range(1, depths + 1) for p in itertools.product(range(ranks), repeat=d)]
    prefixes.sort(key=lambda p: -sum(logp[d][r] for d, r in enumerate(p)))
    tree = {tuple(ids[d][r] for d, r in enumerate(p)) for p in prefixes[:budget]}
    depth = 0
    while depth < depths and valid[depth] and tuple(labels[: depth + 1]) in tree:
        depth += 1
    return depth + 1


def test_tree_acceptance_equals_brute_force():
    rng = random.Random(0)
    for trial in range(300):
        depths, ranks = rng.randint(1, 4), rng.randint(1, 4)
        budget = rng.randint(1, 12)
        logp = [sorted((rng.uniform(-6, 0) for _ in range(ranks)), reverse=True) for _ in range(depths)]
        ids = [rng.sample(range(10), ranks) for _ in range(depths)]
        labels = [rng.choice(ids[d][: rng.randint(1, ranks)]) if rng.random() < 0.8 else 99 for d in range(depths)]
        valid = [rng.random() < 0.9 for _ in range(depths)]
        got = tree_acceptance(logp, ids, labels, valid, budget)
        want = brute_force_tree_acceptance(logp, ids, labels, valid, budget)
        assert got == want, f"trial {trial}: tree {got} vs brute force {want} ({logp}, {ids}, {labels}, {budget})"


def test_chain_acceptance_and_slot_accuracy_match_per_block_inference(tmp_path):
    """Packed evaluation (block-attention mask over the whole batch) against one inference forward per
    block over its own sequence's prefix, counted by a plain loop."""
    cache = tiny_cache(tmp_path / "cache", num_batches=2, vocab_size=16)
    cfg = drafter_for_target(32, 64, 16, num_layers=1, block_size=4)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).double()
    head_t = load_target_head(cache)
    head = TargetHead(head_t["embed_tokens"].double(), head_t["lm_head"].double())
    # Make the random drafter confident on a few tokens so that acceptances > 1 occur.
    with torch.no_grad():
        model.norm.weight.mul_(20)
    res = evaluate_drafter(model, head, str(cache), [0, 1], num_blocks=16, seed=3, budgets=(4,))

    reader = ShardReader(cache)
    accepted_total, blocks_total, correct, count = 0, 0, [0] * 3, [0] * 3
    for batch_id in (0, 1):
        t, _ = reader.read(batch_id)
        blocks = sample_shard_blocks(
            t,
            num_blocks=16,
            block_size=4,
            mask_token_id=15,
            generator=torch.Generator().manual_seed(3 * 1_000_003 + batch_id),
        )
        hidden = decode_hidden(t["hidden"]).double()
        for n in range(16):
            if not blocks.block_valid_N[n]:
                continue
            a, s0 = int(blocks.anchor_N[n]), int(blocks.seq_start_N[n])
            with torch.no_grad():
                out = model.forward_block(
                    hidden[s0:a],
                    t["position_ids"][s0:a].long(),
                    head.embed(blocks.block_ids_NB[n]),
                    blocks.block_pos_NB[n],
                )
            pred = (out @ head.lm_head_VH.T).argmax(-1)
            run = 0
            for k in range(1, 4):
                ok = bool(blocks.label_valid_NB[n, k]) and int(pred[k]) == int(blocks.labels_NB[n, k])
                if blocks.label_valid_NB[n, k]:
                    count[k - 1] += 1
                    correct[k - 1] += ok
                if run == k - 1 and ok:
                    run += 1
            accepted_total += run + 1
            blocks_total += 1
    assert res.num_blocks == blocks_total
    assert res.random_anchor_chain_length == pytest.approx(accepted_total / blocks_total, abs=1e-12)
    for k in range(3):
        assert res.random_anchor_slot_accuracy[k] == pytest.approx(correct[k] / count[k], abs=1e-12), f"slot {k + 1}"
    assert res.random_anchor_chain_length > 1.0, "the test needs some accepted drafts to mean anything"


def test_training_raises_held_out_acceptance(tmp_path):
    """Counting sequences are learnable: 300 steps lift held-out acceptance far above the untrained drafter's."""
    cache = tiny_cache(tmp_path / "cache", num_batches=6, vocab_size=32)
    make_learnable(cache)
    untrained = run_training(tiny_config(cache, tmp_path / "r0", max_steps=1, lr=1e-9, eval_shards=1)).eval
    trained = run_training(
        tiny_config(
            cache,
            tmp_path / "r1",
            epochs=60,
            lr=1e-2,
            eval_shards=1,
            log_every=50,
            metrics_every=50,
            eval_tree_budgets=[16],
        )
    ).eval
    assert trained.batch_ids == untrained.batch_ids == [5]
    assert untrained.tree_walks == {} and list(trained.tree_walks) == [16]  # trees only when asked
    gain = trained.acceptance_length - untrained.acceptance_length
    assert gain >= 0.6, (
        f"acceptance length {untrained.acceptance_length:.3f} -> {trained.acceptance_length:.3f}; "
        "training did not learn the counting sequences"
    )
    # Decoding anchors right after rejections, where the drafter is weakest: random anchors read higher.
    assert trained.random_anchor_chain_length > trained.acceptance_length
    assert trained.tree_acceptance[16] >= trained.acceptance_length


def test_held_out_eval_runs_every_epoch_by_default(tmp_path):
    """--eval-shards alone evaluates before training, after every epoch and at the end, with the held-out
    loss next to the acceptance (overfitting shows as a rising loss)."""
    cache = tiny_cache(tmp_path / "cache", num_batches=3)
    run_training(tiny_config(cache, tmp_path / "run", epochs=3, eval_shards=1))  # 2 training shards: 2 steps/epoch
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(json.loads, lines) if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4, 6]
    assert all(r["eval/heldout_loss"] > 0 and r["eval/acceptance_length"] >= 1 for r in evals)


def test_the_mode_a_cache_was_rendered_in_names_thinking_and_template_keywords():
    from train.eval.evaluate import cache_mode

    def cfg(chat_mode, chat_modes=None):
        modes = chat_modes if chat_modes is not None else [chat_mode]
        return SimpleNamespace(chat_mode=chat_mode, chat_modes=chat_modes, modes=modes)

    off = {"thinking": "off", "template_kwargs": {}}
    assert cache_mode(cfg(None)) is None
    assert cache_mode(cfg(off)) == "thinking off"
    both = {"thinking": "on", "template_kwargs": {"reasoning_effort": "high"}}
    assert cache_mode(cfg(both)) == 'thinking on, reasoning_effort="high"'
    assert (
        cache_mode(cfg(None, [off, both, None])) == 'thinking off | thinking on, reasoning_effort="high" | unknown mode'
    )
