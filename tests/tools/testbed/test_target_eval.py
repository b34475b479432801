"""The proxy target's batches and figures (tools/testbed/target_data.py, target_eval.py) against
independent references: padded batched losses against HF on each sample alone, batched greedy
decoding against one prompt at a time, the unigram baseline and the repetitiveness figures against
plain loops."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tools.fixtures.tiny_target import tiny_config_dict
from tools.testbed.target_data import (
    PAD_LABEL,
    PAD_MULTIPLE,
    Samples,
    epoch_batches,
    make_batch,
    padded_length,
    sequential_batches,
)
from tools.testbed.target_eval import greedy_replies, heldout_loss, repetitiveness, unigram_baseline

transformers = pytest.importorskip("transformers")
VOCAB = 96
PAD = 0
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(**tiny_config_dict(num_hidden_layers=4, vocab_size=VOCAB))
    return transformers.Qwen3_5ForCausalLM(cfg).eval()


def _samples(lengths, seed=0) -> Samples:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, VOCAB, size=n) for n in lengths]
    masks = [(np.arange(n) >= n // 2).astype(np.uint8) for n in lengths]
    return Samples(ids, masks, 0)


def test_batches_hold_every_sample_once_within_the_budget():
    samples = _samples(np.random.default_rng(1).integers(2, 60, size=300))
    for batches in (epoch_batches(samples, 256, np.random.default_rng(0)), sequential_batches(samples, 256)):
        assert sorted(i for b in batches for i in b) == list(range(300))
        assert all(padded_length(max(len(samples.ids[i]) for i in b)) * len(b) <= 256 for b in batches)
    assert epoch_batches(samples, 256, np.random.default_rng(0)) == epoch_batches(
        samples, 256, np.random.default_rng(0)
    )
    batch = make_batch(samples, [3, 7], PAD)
    assert batch.input_ids.shape[1] % PAD_MULTIPLE == 0
    for row, i in enumerate([3, 7]):
        x, m, n = samples.ids[i], samples.loss_mask[i], len(samples.ids[i])
        assert batch.input_ids[row, :n].tolist() == x.tolist() and (batch.input_ids[row, n:] == PAD).all()
        assert batch.labels[row, : n - 1].tolist() == x[1:].tolist() and (batch.labels[row, n - 1 :] == PAD_LABEL).all()
        want = [t if keep else PAD_LABEL for t, keep in zip(x[1:], m[1:])]
        assert batch.assistant_labels[row, : n - 1].tolist() == want
    assert batch.num_real_tokens == len(samples.ids[3]) + len(samples.ids[7])


def test_heldout_loss_equals_each_sample_alone(model):
    samples = _samples([5, 70, 33, 2, 64, 91])
    got = heldout_loss(model, samples, batch_tokens=200, pad_id=PAD, device=CPU)
    sums, counts = {"all": 0.0, "assistant": 0.0}, {"all": 0, "assistant": 0}
    with torch.no_grad():
        for x, m in zip(samples.ids, samples.loss_mask):
            logits = model(input_ids=torch.from_numpy(x)[None]).logits[0, :-1]
            nll = F.cross_entropy(logits.double(), torch.from_numpy(x[1:]), reduction="none")
            sums["all"] += nll.sum().item()
            counts["all"] += len(x) - 1
            sums["assistant"] += nll[torch.from_numpy(m[1:] == 1)].sum().item()
            counts["assistant"] += int(m[1:].sum())
    for key in sums:
        assert got[key] == pytest.approx(sums[key] / counts[key], rel=1e-5), key


def test_batched_greedy_equals_one_prompt_at_a_time(model):
    prompts = [np.array(p) for p in ([5, 9, 13], [7] * 20, [3, 1, 4, 1, 5, 9, 2, 6])]
    with torch.no_grad():
        first = [model(input_ids=torch.tensor(p)[None]).logits[0, -1].argmax().item() for p in prompts]
    stop = {first[1]}  # the second prompt stops at once; the others run to max_new_tokens (or stop later)
    got = greedy_replies(model, prompts, max_new_tokens=6, stop_ids=stop, pad_id=PAD, device=CPU)
    for p, (reply, finished) in zip(prompts, got):
        seq, want = list(p), []
        with torch.no_grad():
            for _ in range(6):
                token = model(input_ids=torch.tensor(seq)[None]).logits[0, -1].argmax().item()
                seq.append(token)
                if token in stop:
                    break
                want.append(token)
        assert reply == want and finished == (seq[-1] in stop)
    assert got[1] == ([], True)


def test_unigram_baseline_against_counting_by_hand():
    train, heldout = _samples([6, 9, 4], seed=1), _samples([5, 8], seed=2)
    got = unigram_baseline(train, heldout, VOCAB)
    for key in ("all", "assistant"):
        counts = Counter()
        for x, m in zip(train.ids, train.loss_mask):
            counts.update(int(t) for t, keep in zip(x[1:], m[1:]) if key == "all" or keep)
        total = sum(counts.values()) + VOCAB
        held = [
            int(t)
            for x, m in zip(heldout.ids, heldout.loss_mask)
            for t, keep in zip(x[1:], m[1:])
            if key == "all" or keep
        ]
        want = -sum(math.log((counts[t] + 1) / total) for t in held) / len(held)
        assert got[key] == pytest.approx(want, rel=1e-12), key


def test_repetitiveness_of_hand_made_replies():
    got = repetitiveness([[1, 2, 3, 4, 1, 2, 3, 4, 1], [5, 6, 7], [8, 8, 8, 8, 8]])
    # 4-grams: reply 1 has 6, of which (1,2,3,4) and (2,3,4,1) come back: 2; reply 3 has 2, 1 repeated.
    assert got["repeated_4gram_share"] == pytest.approx(3 / 8)
    assert got["distinct_1"] == pytest.approx(8 / 17)  # tokens 1-8 among 17
    # bigrams: 8 + 2 + 4 = 14; distinct: (1,2) (2,3) (3,4) (4,1) (5,6) (6,7) (8,8) = 7
    assert got["distinct_2"] == pytest.approx(7 / 14)
    assert got["mean_tokens"] == pytest.approx(17 / 3)
