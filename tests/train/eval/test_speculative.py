"""Real speculative decoding with the tiny target in the loop: lossless (output == plain greedy token
for token), and on the target's own greedy data the decoding walk over the cache gives exactly the
same figures (fp32). Also the whose-tokens check (data == target top-1 on such a cache) and the CLI."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
from collections import Counter

import pytest
import torch
from click.testing import CliRunner

from extract.dataset.index import write_jsonl
from extract.runner import run_extract
from shards import ShardReader
from tests.helpers.extract import extract_cfg
from tests.helpers.train import tiny_config
from tools.cli.dflash_train import entry_point
from tools.cli.dflash_train import main as dflash_train
from tools.cli.verifier import TargetVerifier
from tools.fixtures.demo_data import greedy_continuations
from tools.fixtures.tiny_target import write_random_checkpoint
from train.cli import main as train_cli
from train.drafter.model import DFlashDrafter, TargetHead
from train.eval.config import SamplingConfig
from train.eval.evaluate import evaluate_drafter
from train.eval.run import load_drafter
from train.eval.speculative import (
    ChainProposer,
    PromptModes,
    decode_prompts,
    plain_generate,
    plain_generate_many,
    read_prompts,
    speculative_generate,
    speculative_generate_many,
)
from train.loop import run_training
from train.optim import OptimConfig

NEW_TOKENS = 20


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def setup(tmp_path_factory, request):
    """Tiny target, its greedy continuations as data, a cache with target top-1, a briefly trained drafter
    of each kind (DFlash 2 drafts along its selector's greedy path)."""
    root = tmp_path_factory.mktemp(f"spec-{request.param}")
    target = write_random_checkpoint(root / "target", seed=0, dtype=torch.float32, mixer_scale=0.1)
    samples = greedy_continuations(target, num_samples=24, prompt_len=(4, 12), new_tokens=NEW_TOKENS)
    write_jsonl(root / "data.jsonl", samples)
    run_extract(extract_cfg(target, root / "data.jsonl", root / "cache", target_topk=1))
    # The default warmup share, and no logging or metrics to speak of: only the trained drafter matters.
    quiet = dict(warmup_ratio=OptimConfig.warmup_ratio, log_every=1000, metrics_every=1000)
    run_training(
        tiny_config(root / "cache", root / "run", epochs=30, num_blocks=32, lr=3e-3, arch=request.param, **quiet)
    )
    return root, target, samples


def _drafter(root):
    loaded = load_drafter(root / "run")
    return loaded.model.eval(), loaded.config


def test_speculative_output_equals_plain_greedy(setup):
    root, target, samples = setup
    model, cfg = _drafter(root)
    verifier = TargetVerifier(target, cfg.tap_layer_ids, "cpu", torch.float32)
    head = TargetHead(verifier.embed_tokens_VH, verifier.lm_head_VH)
    accepted = 0
    for s in samples[:6]:
        prompt = s.input_ids[: int(s.loss_mask.argmax())].tolist()
        spec = speculative_generate(ChainProposer(model, head), verifier, prompt, NEW_TOKENS)
        plain = plain_generate(verifier, prompt, NEW_TOKENS)
        assert spec.tokens == plain.tokens
        assert spec.tokens == s.input_ids[len(prompt) :].tolist(), "the data are the target's greedy continuation"
        assert sum(spec.step_tokens) == NEW_TOKENS - 1, "after the prefill token, the steps emit the rest exactly"
        accepted += sum(spec.step_accepted)
    assert accepted > 0, "the trained drafter should get some drafts accepted"


def test_walk_equals_real_speculative_decoding_on_target_greedy_data(setup):
    root, target, samples = setup
    model, cfg = _drafter(root)
    reader = ShardReader(root / "cache")
    from shards import load_target_head

    head_t = load_target_head(root / "cache")
    # Two context buckets split at a position some responses' steps reach and others' do not.
    edges = (0, min(int(s.loss_mask.argmax()) for s in samples) + NEW_TOKENS // 2)
    walk = evaluate_drafter(
        model,
        TargetHead(head_t["embed_tokens"].float(), head_t["lm_head"].float()),
        str(root / "cache"),
        reader.batch_ids(),
        budgets=(),
        context_edges=edges,
    )
    assert walk.data_is_target_greedy == 1.0 and "exact" in walk.whose_tokens()

    verifier = TargetVerifier(target, cfg.tap_layer_ids, "cpu", torch.float32)
    head = TargetHead(verifier.embed_tokens_VH, verifier.lm_head_VH)
    prompts = [s.input_ids[: int(s.loss_mask.argmax())].tolist() for s in samples]
    report = decode_prompts(ChainProposer(model, head), verifier, prompts, NEW_TOKENS, context_edges=edges)
    assert report.identical == len(prompts)
    got, want = report.walk, walk.walk
    assert want.responses == len(samples)
    assert got.accepted_histogram == want.accepted_histogram
    assert got.slot_reached == want.slot_reached and got.slot_accepted == want.slot_accepted
    assert (got.steps, got.tokens) == (want.steps, want.tokens)
    assert got.context_steps == want.context_steps and got.context_tokens == want.context_tokens
    assert all(want.context_steps), f"both buckets need steps to mean anything ({want.context_steps})"
    assert got.acceptance_length == pytest.approx(want.acceptance_length, abs=1e-12)
    assert sum(want.accepted_histogram[1:]) >= 10, f"the test needs accepted drafts to mean anything ({want})"


def test_decoding_ends_each_reply_at_its_first_stop_token(setup):
    """With stop ids, a reply ends at its first stop token as in serving: the tokens, steps and accepted drafts
    are those of decoding without stops up to the step that emitted it, that step cut after it."""
    root, target, samples = setup
    model, cfg = _drafter(root)
    verifier = TargetVerifier(target, cfg.tap_layer_ids, "cpu", torch.float32)
    proposer = ChainProposer(model, TargetHead(verifier.embed_tokens_VH, verifier.lm_head_VH))
    prompts = [s.input_ids[: int(s.loss_mask.argmax())].tolist() for s in samples[:8]]
    full = speculative_generate_many(proposer, verifier, prompts, NEW_TOKENS)
    stop = Counter(t for d in full for t in d.tokens[1:]).most_common(1)[0][0]  # ends several replies early
    stops = frozenset({stop})
    cut = speculative_generate_many(proposer, verifier, prompts, NEW_TOKENS, stop_ids=stops)
    plain = plain_generate_many(verifier, prompts, NEW_TOKENS, stop_ids=stops)
    ended = 0
    for f, c, p in zip(full, cut, plain, strict=True):
        end = next((k + 1 for k, t in enumerate(f.tokens) if t == stop), len(f.tokens))
        assert c.tokens == p.tokens == f.tokens[:end]
        ended += end < len(f.tokens)
        want_tokens, want_accepted, made = [], [], 1  # the prefill token is made before the first step
        for tokens, a in zip(f.step_tokens, f.step_accepted, strict=True):
            if made >= end:
                break
            n = min(tokens, end - made)
            want_tokens.append(n)
            want_accepted.append(min(a, n))  # drafts past the reply's end are not accepted
            made += n
        assert (c.step_tokens, c.step_accepted) == (want_tokens, want_accepted)
        if c.step_tokens and c.tokens[-1] == stop:  # no slot has a label past the reply's last token
            assert c.step_labels[-1] == min(f.step_labels[len(c.step_labels) - 1], c.step_tokens[-1])
    assert ended >= 2, "the stop token should end some replies early"
    report = decode_prompts(proposer, verifier, prompts, NEW_TOKENS, stop_ids=stops)
    assert report.identical == len(prompts)
    assert report.walk.tokens == sum(len(c.tokens) - 1 for c in cut)
    assert report.longest_reply == max(len(c.tokens) for c in cut)
    assert report.stopped == sum(c.tokens[-1] == stop for c in cut) >= ended
    # Sampled, the same rule: each reply ends at its first stop token or after NEW_TOKENS, its steps emit the rest.
    sampling = SamplingConfig(temperature=1.0)

    def draw(stop_ids=frozenset()):
        generator = torch.Generator().manual_seed(0)
        return speculative_generate_many(
            proposer, verifier, prompts, NEW_TOKENS, sampling=sampling, generator=generator, stop_ids=stop_ids
        )

    common = frozenset(t for t, _ in Counter(t for d in draw() for t in d.tokens[1:]).most_common(5))
    drawn = draw(common)
    for d in drawn:
        assert not common & set(d.tokens[:-1]) and (d.tokens[-1] in common or len(d.tokens) == NEW_TOKENS)
        assert sum(d.step_tokens) == len(d.tokens) - 1
        assert all(a <= labels for a, labels in zip(d.step_accepted, d.step_labels, strict=True))
        if d.step_tokens and d.tokens[-1] in common:  # the last step: no label past the stop
            assert d.step_labels[-1] <= d.step_tokens[-1]
    assert any(d.tokens[-1] in common for d in drawn), "the seeded draws should end a reply at a stop"


def test_eval_cli_with_target_and_prompts(setup, tmp_path, monkeypatch, capsys, caplog):
    root, target, samples = setup
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"input_ids": s.input_ids.tolist(), "loss_mask": s.loss_mask.tolist()}) + "\n"
            for s in samples[:3]
        )
    )
    assert [len(p) for p in read_prompts(prompts, 512)] == [int(s.loss_mask.argmax()) for s in samples[:3]]
    args = [
        "eval",
        "--drafter",
        str(root / "run"),
        "--target",
        str(target),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--dtype",
        "float32",
        "--out",
        str(tmp_path / "e.json"),
    ]
    res = CliRunner().invoke(train_cli, args)  # train.cli alone (`python -m train.cli`): no target model
    assert res.exit_code == 1 and "dflash-train eval" in res.output, res.output  # no factory: named refusal
    monkeypatch.setattr(sys, "argv", ["dflash-train", *args])  # the console script, as installed
    caplog.set_level(logging.INFO)
    with pytest.raises(SystemExit) as done:
        dflash_train()
    shown = capsys.readouterr()
    assert done.value.code == 0, shown.err
    # Progress while it decodes (a log file gets lines): prompts done, both rates, an ETA; the last one final.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eval --target: ")]
    assert lines[0].startswith("eval --target: 1/3 prompts | ") and " plain greedy | ETA " in lines[0], lines
    assert re.fullmatch(
        r"eval --target: 3/3 prompts \| [\d.]+ tokens/s speculative, [\d.]+ plain greedy \| ETA 0m00s", lines[-1]
    )
    assert "identical to plain greedy decoding" in shown.out and "tokens/s" in shown.out
    out = json.loads((tmp_path / "e.json").read_text())["speculative_decoding"]
    assert out["identical_to_greedy"] == 3 and out["acceptance_length"] >= 1.0 and out["greedy_tokens_per_s"] > 0
    # The replies it was trained on are NEW_TOKENS long: decoding that many is what it learned, no warning.
    assert (out["max_new_tokens"], out["longest_trained_response"]) == (NEW_TOKENS, NEW_TOKENS)
    assert "WARNING" not in shown.out
    # Past them: said once, above the figures it qualifies (the demo's 64 vs 32 read as 1.926 vs 7.217).
    longer = [*args[:8], str(NEW_TOKENS + 4), *args[9:11]]
    res = CliRunner().invoke(train_cli, longer, obj=entry_point())
    assert res.exit_code == 0, res.output
    warning = (
        f"WARNING: decoded replies of up to {NEW_TOKENS + 4} tokens, past the longest reply the drafter was trained on "
        f"({NEW_TOKENS} tokens)"
    )
    assert res.output.startswith(warning) and res.output.count("past the longest reply") == 1, res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2, 99999]\n")
    res = CliRunner().invoke(train_cli, args[:6] + [str(bad)])
    assert res.exit_code == 1 and "line 1" in res.output and "outside the vocabulary" in res.output


def test_read_prompts_from_a_parquet_dataset(tmp_path):
    import numpy as np

    from extract.dataset.index import Sample, write_parquet

    samples = [
        Sample(f"s{i}", np.arange(10, dtype=np.int32) + i, (np.arange(10) >= 3 + i).astype(np.uint8)) for i in range(4)
    ]
    write_parquet(tmp_path / "d.parquet", samples)
    assert read_prompts(tmp_path / "d.parquet", 64) == [list(range(i, 3 + 2 * i)) for i in range(4)]
    assert len(read_prompts(tmp_path / "d.parquet", 64, max_prompts=2)) == 2
    with pytest.raises(ValueError, match="row 2: token ids \\[5, 6\\] outside the vocabulary"):
        read_prompts(tmp_path / "d.parquet", 5)


def test_eval_cli_samples_at_a_temperature_reproducibly(setup, tmp_path):
    root, target, samples = setup
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps(s.input_ids[: int(s.loss_mask.argmax())].tolist()) + "\n" for s in samples[:2])
    )
    base = ["eval", "--drafter", str(root / "run"), "--target", str(target), "--prompts", str(prompts)]
    args = [*base, "--max-new-tokens", "12", "--dtype", "float32", "--temperature", "0.8", "--top-k", "20"]
    runs = []
    for n in range(2):  # the same --seed: the same draws, the same figures
        res = CliRunner().invoke(train_cli, [*args, "--out", str(tmp_path / f"{n}.json")], obj=entry_point())
        assert res.exit_code == 0, res.output
        runs.append(json.loads((tmp_path / f"{n}.json").read_text())["speculative_decoding"])
    assert "at T=0.8, top-k 20" in res.output and "the target's distribution by the rejection rule" in res.output
    keys = ("acceptance_length", "accepted_histogram", "temperature", "top_k", "identical_to_greedy")
    assert [runs[0][k] for k in keys] == [runs[1][k] for k in keys]
    assert runs[0]["temperature"] == 0.8 and runs[0]["identical_to_greedy"] is None
    mode = json.loads((tmp_path / "0.json").read_text())["chat_mode"]
    assert mode == {"thinking": "on", "template_kwargs": {}}  # the defaults: the mode evaluated is recorded
    assert 1.0 <= runs[0]["acceptance_length"] <= 4.0  # tokens per verify step, block size 4
    res = CliRunner().invoke(train_cli, [*base, "--top-p", "0.9"], obj=entry_point())
    assert res.exit_code == 2 and "--temperature 0 is greedy" in res.output, res.output


def test_acceptance_per_prompt_mode_equals_decoding_each_modes_prompts_alone(setup):
    root, target, samples = setup
    model, cfg = _drafter(root)
    verifier = TargetVerifier(target, cfg.tap_layer_ids, "cpu", torch.float32)
    proposer = ChainProposer(model, TargetHead(verifier.embed_tokens_VH, verifier.lm_head_VH))
    prompts = [s.input_ids[: int(s.loss_mask.argmax())].tolist() for s in samples[:8]]
    on, off = {"thinking": "on", "template_kwargs": {}}, {"thinking": "off", "template_kwargs": {}}
    modes = PromptModes()
    for i in range(len(prompts)):
        modes.add(off if i % 3 == 1 else on)
    report = decode_prompts(proposer, verifier, prompts, NEW_TOKENS, modes=modes)
    by_mode = report.walk.acceptance_by_mode
    assert set(by_mode) == {"thinking on", "thinking off"}
    for name, m in (("thinking on", 0), ("thinking off", 1)):
        alone = decode_prompts(proposer, verifier, [p for p, k in zip(prompts, modes.of) if k == m], NEW_TOKENS)
        value, pooled, responses = by_mode[name]
        assert responses == alone.walk.responses > 0
        assert value == pytest.approx(alone.walk.acceptance_length, abs=1e-12)
        assert pooled == pytest.approx(alone.walk.acceptance_length_pooled, abs=1e-12)
    assert report.to_dict()["acceptance_by_mode"] == {name: v for name, (v, _, _) in by_mode.items()}
    assert "thinking off: acceptance" in report.table()


def test_read_prompts_takes_each_token_rows_mode(tmp_path):
    path = tmp_path / "p.jsonl"
    low = {"thinking": "on", "template_kwargs": {"reasoning_effort": "low"}}
    rows = [
        {"input_ids": [1, 2]},
        {"input_ids": [3], "chat_mode": low},
        {"input_ids": [4], "chat_mode": json.dumps(low)},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    modes = PromptModes()
    evaluated = {"thinking": "off", "template_kwargs": {}}
    assert read_prompts(path, 8, modes=modes, evaluated=evaluated) == [[1, 2], [3], [4]]
    assert modes.names == ("thinking off", 'thinking on, reasoning_effort="low"') and modes.of == [0, 1, 1]
    path.write_text(json.dumps({"input_ids": [1], "chat_mode": {"thinking": "maybe"}}) + "\n")
    with pytest.raises(ValueError, match="line 1: chat_mode must be"):
        read_prompts(path, 8, modes=PromptModes(), evaluated=evaluated)


class _OneAtATime:
    """The verifier without its packed calls: decoding falls back to one target forward per sequence."""

    def __init__(self, verifier):
        self.target = verifier
        self.embed_tokens_VH, self.lm_head_VH = verifier.embed_tokens_VH, verifier.lm_head_VH

    def __call__(self, input_ids_L):
        return self.target(input_ids_L)

    def next_token_logits(self, input_ids_L, num_last):
        return self.target.next_token_logits(input_ids_L, num_last)


def test_lockstep_decoding_equals_one_prompt_at_a_time(setup):
    """Prompts of different lengths decoded together (one packed verify per step) give each prompt the
    tokens and steps of its own decoding with one forward per sequence; the packed logits equal them too."""
    root, target, samples = setup
    model, cfg = _drafter(root)
    packed = TargetVerifier(target, cfg.tap_layer_ids, "cpu", torch.float32)
    single = _OneAtATime(packed)
    proposer = ChainProposer(model, TargetHead(packed.embed_tokens_VH, packed.lm_head_VH))
    prompts = [s.input_ids[: int(s.loss_mask.argmax())].tolist() for s in samples[:7]]
    assert len({len(p) for p in prompts}) > 1, "the test needs prompts of different lengths"
    together = speculative_generate_many(proposer, packed, prompts, NEW_TOKENS)
    plain = plain_generate_many(packed, prompts, NEW_TOKENS)
    for prompt, spec, greedy in zip(prompts, together, plain, strict=True):
        alone = speculative_generate(proposer, single, prompt, NEW_TOKENS)
        assert spec.tokens == alone.tokens == greedy.tokens == plain_generate(single, prompt, NEW_TOKENS).tokens
        assert (spec.step_accepted, spec.step_positions) == (alone.step_accepted, alone.step_positions)
    assert len({len(s.step_tokens) for s in together}) > 1, "prompts should finish after different step counts"
    ids = [torch.tensor(p) for p in prompts]
    for (logits, hidden), ids_L in zip(packed.next_token_logits_many(ids, 3), ids, strict=True):
        want_logits, want_hidden = packed.next_token_logits(ids_L, 3)
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)


def test_blocks_of_several_sequences_in_one_forward_equal_one_forward_each(setup):
    """forward_blocks (lockstep drafting) against forward_block per sequence, in float32: prefixes of other
    lengths packed together, each block at its own positions, none seeing another sequence."""
    root, target, samples = setup
    trained, cfg = _drafter(root)
    # Its layers, then the same weights in sliding layers of a window shorter than the prefixes.
    layers = trained.config.num_layers
    sliding = dataclasses.replace(trained.config, layer_types=["sliding_attention"] * layers, sliding_window=4)
    for model in (trained, DFlashDrafter(sliding).eval()):
        model.load_state_dict(trained.state_dict())
        _blocks_together_and_alone(model, TargetVerifier(target, cfg.tap_layer_ids, "cpu", torch.float32), samples)


def _blocks_together_and_alone(model, verifier, samples):
    head = TargetHead(verifier.embed_tokens_VH, verifier.lm_head_VH)
    hidden = [verifier(torch.as_tensor(s.input_ids))[1][: 5 + 3 * n] for n, s in enumerate(samples[:4])]
    B = model.config.block_size
    block_NB = torch.full((4, B), model.config.mask_token_id)
    block_NB[:, 0] = torch.tensor([int(s.input_ids[5 + 3 * n]) for n, s in enumerate(samples[:4])])
    pos_NB = torch.tensor([h.shape[0] for h in hidden])[:, None] + torch.arange(B)
    with torch.no_grad():
        together = model.forward_blocks(hidden, head.embed(block_NB), pos_NB)
        for n, h in enumerate(hidden):
            alone = model.forward_block(h, torch.arange(h.shape[0]), head.embed(block_NB[n]), pos_NB[n])
            torch.testing.assert_close(together[n], alone, rtol=1e-4, atol=1e-5)
