"""DFlash 2's selector loss and metrics against a float64 reference written from their definitions
(train/loss/selector.py), plain autograd over the full logits; both gold-token choices."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.drafter import batch_blocks, make_batch, tiny_config
from train.drafter.model import DFlashDrafter, TargetHead
from train.loss.chunked import block_loss
from train.loss.config import LossConfig
from train.loss.selector import CandidateSet, selector_loss
from train.metrics.selector_metrics import selector_metrics

TOP_K = 24  # of 97 tokens: some gold tokens inside the top-K, some outside


def _setup(seed=0):
    cfg = tiny_config(arch="dflash2", conv_group_size=8, selector_rank=5, selector_top_k=TOP_K)
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg).double()
    with torch.no_grad():
        for p in model.candidate_selector.parameters():
            p.normal_()
    g = torch.Generator().manual_seed(seed + 1)
    head = TargetHead(*(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=torch.float64) for _ in "ab"))
    batch = make_batch([30, 18], token_budget=48, max_seqs=3, num_taps=3, hidden=32)
    blocks = batch_blocks(
        batch, num_blocks=8, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, generator=g.manual_seed(5)
    )
    hidden = torch.randn(8, cfg.block_size, cfg.hidden_size, generator=g, dtype=torch.float64)
    return model, head, blocks, hidden


def _reference(model, head, blocks, hidden, gold: str):
    """sum_w (logsumexp(score) - score_gold) / sum_w over the qualifying slots, one slot at a time."""
    sel = model.candidate_selector
    P, S, Wp = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    num, den = 0.0, 0.0
    for n in range(blocks.num_blocks):
        for k in range(1, blocks.block_size):
            if not blocks.label_valid_NB[n, k]:
                continue
            logits = head.lm_head_VH @ hidden[n, k]
            ids = torch.topk(logits, TOP_K).indices
            y = blocks.labels_NB[n, k]
            if not (ids == y).any():
                if gold == "drop":
                    continue
                ids = torch.cat([ids[:-1], y.view(1)])
            prev = blocks.block_ids_NB[n, 0] if k == 1 else blocks.labels_NB[n, k - 1]
            scores = logits[ids] + (P[prev] * (Wp @ hidden[n, k]) * S[ids]).sum(-1)
            w = blocks.weights_NB[n, k].double()
            num = num + w * (torch.logsumexp(scores, 0) - scores[ids == y][0])
            den = den + w
    return num / den


@pytest.mark.parametrize("gold", ["drop", "swap"])
def test_selector_loss_and_gradients_match_autograd_in_float64(gold):
    model, head, blocks, hidden = _setup()
    candidates = CandidateSet.empty(8, blocks.block_size, TOP_K, gold, "cpu", torch.float64)
    h = hidden.clone().requires_grad_(True)
    block_loss(h, head, blocks, LossConfig(), candidates=candidates)
    in_topk = candidates.in_topk_NB[blocks.label_valid_NB]
    assert in_topk.any() and not in_topk.all()  # both cases present
    loss = selector_loss(model, h, head.lm_head_VH, blocks, candidates)
    params = [h, *model.candidate_selector.parameters()]
    grads = torch.autograd.grad(loss, params)

    h_ref = hidden.clone().requires_grad_(True)
    want = _reference(model, head, blocks, h_ref, gold)
    want_grads = torch.autograd.grad(want, [h_ref, *model.candidate_selector.parameters()])
    assert torch.allclose(loss, want, atol=1e-12), (loss, want)
    for name, got, ref in zip(["hidden", "predecessor", "successor", "projection"], grads, want_grads):
        assert torch.allclose(got, ref, atol=1e-10), (name, (got - ref).abs().max())


def _best(ids, logits, mix, S):
    """The candidate with the highest unary + <mix, S[c]>."""
    return ids[torch.argmax(logits[ids] + (mix * S[ids]).sum(-1))]


def test_selector_metrics_match_a_loop():
    model, head, blocks, hidden = _setup(seed=2)
    candidates = CandidateSet.empty(8, blocks.block_size, TOP_K, "swap", "cpu", torch.float64)
    block_loss(hidden, head, blocks, LossConfig(), candidates=candidates)
    got = {
        name: (float(s), float(c))
        for name, (s, c) in selector_metrics(model, hidden, head.lm_head_VH, blocks, candidates).items()
    }

    sel = model.candidate_selector
    P, S, Wp = (t.detach() for t in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight))
    recall = accuracy = slots = accept = valid_blocks = 0
    for n in range(blocks.num_blocks):
        prev_own, streak, alive = blocks.block_ids_NB[n, 0], 0, bool(blocks.block_valid_N[n])
        valid_blocks += alive
        for k in range(1, blocks.block_size):
            logits = head.lm_head_VH @ hidden[n, k]
            ids = torch.topk(logits, TOP_K).indices  # the true top-K: metrics see what serving sees
            y, valid = blocks.labels_NB[n, k], bool(blocks.label_valid_NB[n, k])
            teacher = blocks.block_ids_NB[n, 0] if k == 1 else blocks.labels_NB[n, k - 1]
            projected = Wp @ hidden[n, k]
            if valid:
                slots += 1
                recall += bool((ids == y).any())
                accuracy += bool(_best(ids, logits, P[teacher] * projected, S) == y)
            prev_own = _best(ids, logits, P[prev_own] * projected, S)
            alive = alive and valid and bool(prev_own == y)
            streak += alive
        accept += streak if blocks.block_valid_N[n] else 0
    assert got["selector_recall"] == pytest.approx((recall, slots))
    assert got["selector_accuracy"] == pytest.approx((accuracy, slots))
    assert got["selector_accept"] == pytest.approx((accept, valid_blocks))


def test_the_unary_loss_of_a_scaled_capped_drafter_scores_its_transformed_logits():
    """output_multiplier and final_logit_softcapping: CE of softmax(tanh(m z / c) c), z = lm_head(h), and
    its gradient, against autograd in float64 (fused requested: the autograd path runs)."""
    model, head, blocks, hidden = _setup()
    model.config = model.config.replace(output_multiplier=0.3, final_logit_softcapping=2.5)
    h = hidden.clone().requires_grad_(True)
    parts = block_loss(h, head, blocks, LossConfig(fused=True), transform=model.logit_transform())
    (grad,) = torch.autograd.grad(parts.total, h)

    h_ref = hidden.clone().requires_grad_(True)
    logits = torch.tanh(0.3 * (h_ref @ head.lm_head_VH.T) / 2.5) * 2.5
    logq = torch.log_softmax(logits, -1).gather(-1, blocks.labels_NB.unsqueeze(-1)).squeeze(-1)
    w = blocks.weights_NB.double()
    want = -(w * logq).sum() / w.sum()
    (want_grad,) = torch.autograd.grad(want, h_ref)
    assert torch.allclose(parts.total, want, atol=1e-12)
    assert torch.allclose(grad, want_grad, atol=1e-12), (grad - want_grad).abs().max()
    plain = block_loss(hidden, head, blocks, LossConfig())
    assert not torch.allclose(plain.total, want)  # the transform matters here
