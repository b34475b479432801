"""Chunked block losses and metrics (train/loss/chunked.py, train/metrics/block_metrics.py) against float64 loops."""

import math

import pytest
import torch

from tests.helpers.drafter import MASK_ID, VOCAB, batch_blocks, make_batch
from train.loss.chunked import block_loss, block_loss_unchunked
from train.loss.config import LossConfig
from train.metrics.block_metrics import block_metrics

B, H, KT, BUDGET = 5, 8, 6, 40


def setup(num_blocks=9, dtype=torch.float64, seed=0):
    batch = make_batch([12, 4, 9, 10], BUDGET, 6, 1, H, seed=seed, unsupervised=(8,))
    blocks = batch_blocks(
        batch,
        num_blocks=num_blocks,
        block_size=B,
        mask_token_id=MASK_ID,
        gamma=2.0,
        generator=torch.Generator().manual_seed(seed),
    )
    g = torch.Generator().manual_seed(seed + 10)
    hidden = torch.randn(num_blocks, B, H, generator=g, dtype=dtype)
    lm_head = torch.randn(VOCAB, H, generator=g, dtype=dtype) * 0.7
    topk_ids = torch.stack([torch.randperm(VOCAB, generator=g)[:KT] for _ in range(BUDGET)]).int()
    topk_lp = torch.log_softmax(torch.randn(BUDGET, KT, generator=g, dtype=dtype) * 2, -1) - 0.3  # not normalised
    return blocks, hidden, lm_head, topk_ids, topk_lp


def naive_terms(blocks, hidden, lm_head, topk_ids, topk_lp):
    """(ce, kl, cap) as defined in SPEC, with Python loops over blocks and slots, float64."""
    NB = hidden.shape[0]
    ce_num = kl_num = w_sum = cap_num = 0.0
    valid_blocks = 0
    for n in range(NB):
        logits = (hidden[n].double() @ lm_head.double().T).tolist()
        valid_blocks += bool(blocks.block_valid_N[n])
        prod, chain_alive = 1.0, bool(blocks.block_valid_N[n])
        for k in range(1, B):
            row = logits[k]
            lse = math.log(sum(math.exp(z) for z in row))
            logq = [z - lse for z in row]
            w = float(blocks.weights_NB[n, k])
            y = int(blocks.labels_NB[n, k])
            valid = bool(blocks.label_valid_NB[n, k])
            if valid:
                ce_num += -w * logq[y]
                w_sum += w
                t = int(blocks.anchor_N[n]) + k - 1  # target's prediction of token anchor+k
                lp = [float(x) for x in topk_lp[t]]
                z = sum(math.exp(x) for x in lp)
                p = [math.exp(x) / z for x in lp]
                kl_num += w * sum(pi * (math.log(pi) - logq[int(i)]) for pi, i in zip(p, topk_ids[t]))
            chain_alive = chain_alive and valid
            if chain_alive:
                prod *= math.exp(logq[y])
                cap_num += prod
    return ce_num / w_sum, kl_num / w_sum, -cap_num / (valid_blocks * (B - 1))


# fused: the training path of train/loss/fused.py (taken only when the hidden states need a gradient).
@pytest.mark.parametrize("fused", [False, True])
def test_each_loss_term_matches_naive_loop(fused):
    blocks, hidden, lm_head, ids, lp = setup(num_blocks=24)
    assert not blocks.block_valid_N.all() and blocks.block_valid_N.any()  # padding blocks are covered
    assert not blocks.label_valid_NB[blocks.block_valid_N][:, 1:].all()  # ignored labels in valid blocks too
    ce, kl, cap = naive_terms(blocks, hidden, lm_head, ids, lp)
    cfg = LossConfig(kl_lambda=0.7, cap_lambda=1.3, chunk_blocks=4, fused=fused)
    parts = block_loss(hidden.clone().requires_grad_(), lm_head, blocks, cfg, ids, lp)
    assert abs(cap) > 1e-6  # the chain term is exercised, not vanishing
    for name, got, ref in (
        ("ce", parts.ce, ce),
        ("kl", parts.kl, kl),
        ("cap", parts.cap, cap),
        ("total", parts.total, ce + 0.7 * kl + 1.3 * cap),
    ):
        assert abs(float(got.detach()) - ref) < 1e-9, f"{name}: got {float(got)}, naive {ref}"


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 9, 50])
@pytest.mark.parametrize("lambdas", [(0.0, 0.0), (0.5, 0.0), (0.0, 2.0), (0.3, 0.8)])
def test_chunked_equals_unchunked_values_and_grads(chunk, lambdas, fused):
    blocks, hidden, lm_head, ids, lp = setup(dtype=torch.float32)
    cfg = LossConfig(kl_lambda=lambdas[0], cap_lambda=lambdas[1], chunk_blocks=chunk, fused=fused)
    results = []
    for fn in (block_loss, block_loss_unchunked):
        h = hidden.clone().requires_grad_()
        parts = fn(h, lm_head, blocks, cfg, ids, lp)
        (2.5 * parts.total).backward()
        results.append((parts, h.grad))
    (chunked, g_chunked), (plain, g_plain) = results
    for name in ("total", "ce", "kl", "cap"):
        diff = abs(float(getattr(chunked, name).detach()) - float(getattr(plain, name).detach()))
        assert diff < 1e-5, f"{name}: max abs diff {diff}"
    diff = (g_chunked - g_plain).abs().max().item()
    assert diff < 1e-6, f"grad: max abs diff {diff}"


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("lambdas", [(1.0, 0.0), (0.0, 1.0), (0.4, 0.9)])
def test_gradcheck_kl_and_cap(lambdas, fused):
    blocks, hidden, lm_head, ids, lp = setup(num_blocks=3)
    cfg = LossConfig(kl_lambda=lambdas[0], cap_lambda=lambdas[1], chunk_blocks=2, fused=fused)

    def total(h):
        return block_loss(h, lm_head, blocks, cfg, ids, lp).total

    assert torch.autograd.gradcheck(total, (hidden.clone().requires_grad_(),), eps=1e-6, atol=1e-7, fast_mode=True)


def test_kl_needs_target_topk_and_frozen_head():
    blocks, hidden, lm_head, ids, lp = setup()
    with pytest.raises(ValueError, match="kl_lambda"):
        block_loss(hidden, lm_head, blocks, LossConfig(kl_lambda=0.1))
    with pytest.raises(ValueError, match="frozen"):
        block_loss(hidden, lm_head.clone().requires_grad_(), blocks, LossConfig())


@pytest.mark.parametrize("fused", [False, True])
def test_no_valid_blocks_gives_zero_loss_and_grad(fused):
    blocks, hidden, lm_head, ids, lp = setup()
    blocks.block_valid_N.zero_()
    blocks.label_valid_NB.zero_()
    blocks.weights_NB.zero_()
    h = hidden.clone().requires_grad_()
    parts = block_loss(h, lm_head, blocks, LossConfig(kl_lambda=1.0, cap_lambda=1.0, fused=fused), ids, lp)
    parts.total.backward()
    assert float(parts.total.detach()) == 0.0 and h.grad.abs().max() == 0


def naive_metrics(blocks, hidden, lm_head, topk):
    S = B - 1
    out = {k: [0.0] * S for k in ("top1_slot", "topk_slot", "ce_slot", "count_slot")}
    streak = topk_streak = expected = 0.0
    for n in range(hidden.shape[0]):
        logits = (hidden[n].double() @ lm_head.double().T).tolist()
        run1 = runk = True
        prod = 1.0
        for k in range(1, B):
            valid = bool(blocks.label_valid_NB[n, k])
            y = int(blocks.labels_NB[n, k])
            row = logits[k]
            order = sorted(range(VOCAB), key=lambda i: -row[i])
            hit1, hitk = valid and order[0] == y, valid and y in order[:topk]
            if valid:
                lse = math.log(sum(math.exp(z) for z in row))
                out["count_slot"][k - 1] += 1
                out["top1_slot"][k - 1] += hit1
                out["topk_slot"][k - 1] += hitk
                out["ce_slot"][k - 1] += lse - row[y]
                prod *= math.exp(row[y] - lse)
            else:
                prod = 0.0
            expected += prod
            run1, runk = run1 and hit1, runk and hitk
            streak += run1
            topk_streak += runk
    out.update(
        accept_streak=streak,
        topk_streak=topk_streak,
        expected_accept=expected,
        count_block=float(blocks.block_valid_N.sum()),
    )
    return out


@pytest.mark.parametrize("topk", [1, 3])
def test_metrics_match_naive_loop(topk):
    blocks, hidden, lm_head, _, _ = setup(num_blocks=9, dtype=torch.float32)
    # Make the drafter good enough that streaks are long: pull block states toward their labels' rows.
    hidden = hidden * 0.3 + 0.9 * lm_head[blocks.labels_NB]
    got = block_metrics(hidden, lm_head, blocks, topk=topk, chunk_blocks=4)
    ref = naive_metrics(blocks, hidden, lm_head, topk)
    assert ref["accept_streak"] > 0
    for name in ("top1_slot", "topk_slot", "ce_slot"):
        s, c = got[name]
        assert torch.allclose(s.double(), torch.tensor(ref[name], dtype=torch.float64), atol=1e-4), name
        assert c.tolist() == ref["count_slot"], name
    for name in ("accept_streak", "topk_streak", "expected_accept"):
        s, c = got[name]
        assert abs(float(s) - ref[name]) < 1e-4, f"{name}: got {float(s)}, naive {ref[name]}"
        assert float(c) == ref["count_block"]


def test_no_grad_call_gives_same_values():
    blocks, hidden, lm_head, ids, lp = setup()
    cfg = LossConfig(kl_lambda=0.2, cap_lambda=0.4, chunk_blocks=4, fused=False)
    h = hidden.clone().requires_grad_()
    with_grad = block_loss(h, lm_head, blocks, cfg, ids, lp)
    with torch.no_grad():
        without = block_loss(h, lm_head, blocks, cfg, ids, lp)
    assert not without.total.requires_grad
    assert torch.equal(with_grad.total.detach(), without.total) and torch.equal(with_grad.cap, without.cap)
