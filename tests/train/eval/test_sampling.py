"""Speculative sampling at T > 0 follows the target's distribution: on a 4-token vocabulary, a hand-made
target (next-token logits a table of the last token and the length) and hand-made drafters that
disagree with it, the empirical distribution of 3-token outputs from many seeded runs is tested (chi-square)
against the target's exact distribution, enumerated by brute force with temperature, top-k and top-p
written here from their definitions. The same test catches wrong rules (always accepting; resampling a
rejection from p instead of the residual), so it can fail. Drafters: a full-vocabulary q (DFlash 1's
kind) and a candidate set conditioned on the previous draft (DFlash 2's selector kind)."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

import train.eval.sampling as sampling_module
from tests.helpers.drafter import tiny_config
from train.drafter.model import DFlashDrafter, TargetHead
from train.eval.config import EvalConfig, SamplingConfig
from train.eval.sampling import DraftDistribution, serving_probs
from train.eval.speculative import GREEDY, ChainProposer, Proposal, plain_generate, speculative_generate

V, BLOCK, NEW, PROMPT = 4, 3, 3, [0, 1]
# Target logits after a token: rows = last token; plus a length term so positions differ.
TARGET = torch.tensor([[2.0, 0.5, -1.0, 0.0], [0.0, 1.5, 1.0, -2.0], [-1.0, 0.0, 2.0, 1.0], [1.0, -1.0, 0.0, 1.5]])
LENGTH = torch.tensor([0.3, -0.2, 0.1, 0.0])
# Drafter logits per (anchor, slot): deliberately off the target's.
DRAFT = torch.tensor([[[0.0, 2.0, 0.0, 1.0], [1.0, 0.0, 2.0, 0.0]]] * 4) + torch.arange(4.0).view(4, 1, 1) * 0.25


def target_logits(ids: list[int]) -> torch.Tensor:
    return (TARGET[ids[-1]] + LENGTH * len(ids)).double()


class TableTarget:
    """The verifier protocol over the table: greedy tokens, logits, and as taps (one) the embedding of
    each token, so a real DFlash drafter has a context to read."""

    def __init__(self, hidden_size: int = 1):
        g = torch.Generator().manual_seed(0)
        self.embed_tokens_VH = torch.randn(V, hidden_size, generator=g)
        self.lm_head_VH = 3 * torch.randn(V, hidden_size, generator=g)  # a peaked drafter q, unlike p

    def __call__(self, input_ids_L):
        ids = input_ids_L.tolist()
        greedy = [int(target_logits(ids[: i + 1]).argmax()) for i in range(len(ids))]
        return torch.tensor(greedy), self.embed_tokens_VH[input_ids_L].unsqueeze(1)

    def next_token_logits(self, input_ids_L, num_last):
        ids = input_ids_L.tolist()
        rows = [target_logits(ids[: i + 1]) for i in range(len(ids) - num_last, len(ids))]
        return torch.stack(rows), self.embed_tokens_VH[input_ids_L].unsqueeze(1)


class FullVocabDrafter:
    """Every slot's q from the table at the anchor, over the whole vocabulary (as DFlash 1 drafts)."""

    block_size = BLOCK

    def __call__(self, context_LKH, anchor, sampling, generator):
        logits_SV = DRAFT[anchor].double()
        if sampling.greedy:
            return Proposal(logits_SV.argmax(-1).tolist())
        q = [DraftDistribution(p) for p in serving_probs(logits_SV, sampling)]
        return Proposal([s.sample(generator) for s in q], q)


class CandidateDrafter:
    """q over 2 candidates per slot, chosen after the previous draft (as DFlash 2's selector walks):
    some target mass always lies outside the candidates, which only the residual can emit."""

    block_size = BLOCK

    def __call__(self, context_LKH, anchor, sampling, generator):
        tokens, q, previous = [], [], anchor
        for slot in range(BLOCK - 1):
            scores = DRAFT[previous, slot].double()
            ids = torch.topk(scores, 2).indices
            dist = DraftDistribution(torch.softmax(scores[ids] / sampling.temperature, -1), ids)
            previous = dist.sample(generator)
            tokens.append(previous)
            q.append(dist)
        return Proposal(tokens, q)


def reference_probs(logits: list[float], cfg: SamplingConfig) -> list[float]:
    """Temperature, then top-k, then top-p, from their definitions, in plain Python."""
    scaled = [x / cfg.temperature for x in logits]
    if cfg.top_k:
        kth = sorted(scaled, reverse=True)[cfg.top_k - 1]
        scaled = [x if x >= kth else -math.inf for x in scaled]
    weights = [math.exp(x) for x in scaled]
    probs = [w / sum(weights) for w in weights]
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass >= cfg.top_p:
            break
        kept.add(i)
        mass += probs[i]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


def exact_distribution(cfg: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(x_1..x_NEW | PROMPT) under the target sampled at cfg, by enumeration of all V^NEW outputs."""
    out = {}
    for seq in itertools.product(range(V), repeat=NEW):
        prob, ids = 1.0, list(PROMPT)
        for token in seq:
            prob *= reference_probs(target_logits(ids).tolist(), cfg)[token]
            ids.append(token)
        out[seq] = prob
    return out


def chi_square(counts: Counter, exact: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over the outputs expected >= 5 times (the rest pooled into one cell), and its
    degrees of freedom; an output the target can never produce makes it infinite."""
    if any(exact[seq] == 0 for seq in counts):
        return math.inf, 0
    big = [seq for seq in exact if exact[seq] * n >= 5]
    stat = sum((counts[seq] - n * exact[seq]) ** 2 / (n * exact[seq]) for seq in big)
    rest = n * (1 - sum(exact[seq] for seq in big))
    if rest > 0:
        stat += (n - sum(counts[seq] for seq in big) - rest) ** 2 / rest
    return stat, len(big) - (rest <= 0)


def sampled_outputs(drafter, cfg: SamplingConfig, n: int, seed: int = 0, target=None) -> Counter:
    generator, target = torch.Generator().manual_seed(seed), target or TableTarget()
    return Counter(
        tuple(speculative_generate(drafter, target, PROMPT, NEW, sampling=cfg, generator=generator).tokens)
        for _ in range(n)
    )


def rejects(counts: Counter, cfg: SamplingConfig, n: int) -> tuple[bool, float, int]:
    """Whether the counts are NOT the target's distribution: statistic above df + 6 sd (chi-square sd =
    sqrt(2 df)); a correct sampler passes with probability ~1 - 1e-6, with the fixed seed deterministically."""
    stat, df = chi_square(counts, exact_distribution(cfg), n)
    return stat > df + 6 * math.sqrt(2 * df), stat, df


N = 4_000  # wrong rules score 770 (resample from p) and 40,000 (accept always) on ~40 df here
CONFIGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3, top_p=0.9)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["T1", "T0.7-topk3-topp0.9"])
@pytest.mark.parametrize("drafter", [FullVocabDrafter(), CandidateDrafter()], ids=["full-vocab", "candidates"])
def test_sampled_output_follows_the_targets_distribution(drafter, cfg):
    counts = sampled_outputs(drafter, cfg, N)
    wrong, stat, df = rejects(counts, cfg, N)
    assert not wrong, f"chi-square {stat:.1f} on {df} df: the output is not the target's distribution"
    plain = Counter(
        tuple(
            plain_generate(TableTarget(), PROMPT, NEW, sampling=cfg, generator=torch.Generator().manual_seed(s)).tokens
        )
        for s in range(1000)
    )
    assert not rejects(plain, cfg, 1000)[0], "plain sampling is the reference the speculative one must match"


def test_a_dflash_drafter_samples_the_targets_distribution():
    """DFlash 1 itself (ChainProposer: a random tiny drafter on the table target's embedding and a peaked
    LM head): q is its softmax at the same temperature, top-k and top-p."""
    target = TableTarget(hidden_size=32)
    cfg = tiny_config(vocab_size=V, mask_token_id=V - 1, block_size=BLOCK, tap_layer_ids=[0], num_target_layers=1)
    torch.manual_seed(0)
    drafter = ChainProposer(DFlashDrafter(cfg).eval(), TargetHead(target.embed_tokens_VH, target.lm_head_VH), None)
    for sampling in CONFIGS:
        wrong, stat, df = rejects(sampled_outputs(drafter, sampling, N, target=target), sampling, N)
        assert not wrong, f"{sampling}: chi-square {stat:.1f} on {df} df"


def test_a_dflash2_drafter_samples_the_targets_distribution():
    """DFlash 2 (ChainProposer walking its selector): each slot's q is softmax(scores / T) over its K
    candidates given the token drawn before it; K < V leaves tokens a slot can never draft."""
    target = TableTarget(hidden_size=32)
    cfg = tiny_config(
        vocab_size=V,
        mask_token_id=V - 1,
        block_size=BLOCK,
        tap_layer_ids=[0],
        num_target_layers=1,
        arch="dflash2",
        conv_group_size=8,
        selector_rank=4,
        selector_top_k=V - 2,
    )
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).eval()
    with torch.no_grad():  # an inert selector would make q the unary softmax: give its bilinear term weight
        model.candidate_selector.hidden_projection.weight.normal_(0, 0.5)
    drafter = ChainProposer(model, TargetHead(target.embed_tokens_VH, target.lm_head_VH), None)
    for sampling in CONFIGS:
        wrong, stat, df = rejects(sampled_outputs(drafter, sampling, N, target=target), sampling, N)
        assert not wrong, f"{sampling}: chi-square {stat:.1f} on {df} df"


@pytest.mark.parametrize(
    "rule",
    ["accept_always", "resample_from_p"],
)
def test_a_wrong_rule_is_caught(monkeypatch, rule):
    cfg = CONFIGS[0]
    if rule == "accept_always":
        monkeypatch.setattr(sampling_module, "accept_draft", lambda p_V, q, token, generator: True)
    else:
        monkeypatch.setattr(
            sampling_module, "resample_rejected", lambda p_V, q, generator: sampling_module.sample_token(p_V, generator)
        )
    wrong, stat, df = rejects(sampled_outputs(FullVocabDrafter(), cfg, N), cfg, N)
    assert wrong, f"chi-square {stat:.1f} on {df} df: the test cannot tell {rule} from the rejection rule"


def test_seeded_runs_repeat_and_greedy_stays_exact():
    cfg = CONFIGS[1]
    assert sampled_outputs(CandidateDrafter(), cfg, 50, seed=3) == sampled_outputs(CandidateDrafter(), cfg, 50, seed=3)
    assert sampled_outputs(CandidateDrafter(), cfg, 50, seed=3) != sampled_outputs(CandidateDrafter(), cfg, 50, seed=4)
    spec = speculative_generate(FullVocabDrafter(), TableTarget(), PROMPT, 8, sampling=GREEDY)
    assert spec.tokens == plain_generate(TableTarget(), PROMPT, 8).tokens
    assert sum(spec.step_tokens) == 7 and all(1 <= t <= BLOCK for t in spec.step_tokens)


def test_serving_probs_matches_the_definitions():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, -1.0], [0.0, 0.0, 5.0, 1.0, 0.5]], dtype=torch.float64)
    for cfg in [*CONFIGS, SamplingConfig(temperature=0.5, top_p=0.5), SamplingConfig(temperature=2.0, top_k=1)]:
        got = serving_probs(logits, cfg)
        want = torch.tensor([reference_probs(row.tolist(), cfg) for row in logits], dtype=torch.float64)
        assert torch.allclose(got, want, atol=1e-12), (cfg, got, want)


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        (dict(temperature=-0.5), "--temperature -0.5"),
        (dict(top_p=0.0, temperature=1.0), "--top-p 0.0"),
        (dict(top_k=5), "--top-k 5"),
    ],
)
def test_sampling_settings_are_refused_by_flag(options, flag):
    with pytest.raises(ValueError, match=flag):
        SamplingConfig(**options)


def test_eval_refuses_temperature_where_decoding_is_greedy(tmp_path):
    with pytest.raises(ValueError, match="--temperature 0.7 samples --target decoding"):
        EvalConfig(drafter=str(tmp_path), cache=str(tmp_path), eval_shards=1, sampling=SamplingConfig(temperature=0.7))
    with pytest.raises(ValueError, match="--budgets 16,32,64: DDTree is walked greedily"):
        EvalConfig(
            drafter=str(tmp_path),
            cache=str(tmp_path),
            eval_shards=1,
            target=str(tmp_path),
            prompts=str(tmp_path / "p.jsonl"),
            sampling=SamplingConfig(temperature=0.7),
        )
