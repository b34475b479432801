"""DFlash 2's additions against float64 loops written from the published description (field notes 2.2):
the block convolution, the selector's scores and its greedy walk, and the inert start."""

from __future__ import annotations

import itertools

import torch

from tests.helpers.drafter import (
    QWEN36_27B_TARGET,
    blocks_and_layout,
    forward_blocks,
    make_batch,
    tiny_config,
    tiny_model_and_head,
)
from train.drafter.config import DrafterConfig
from train.drafter.dflash2 import BlockConv, CandidateSelector
from train.drafter.model import DFlashDrafter, count_parameters


def _random_conv(hidden=12, taps=3, group=4, block=5, seed=0) -> BlockConv:
    torch.manual_seed(seed)
    conv = BlockConv(hidden, taps, group, block).double()
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    return conv


def _conv_loop(x, base, delta, group, block):
    """out[i, c] = sum_t (base[t, c] + delta[i, t, c // group]) * x[i - t, c], i - t inside i's block."""
    out = torch.zeros_like(x)
    for i, c, t in itertools.product(range(x.shape[0]), range(x.shape[1]), range(base.shape[0])):
        if i % block - t >= 0:
            out[i, c] += (base[t, c] + delta[i, t, c // group]) * x[i - t, c]
    return out


def test_block_conv_matches_the_published_equation():
    hidden, taps, group, block = 12, 3, 4, 5
    conv = _random_conv(hidden, taps, group, block)
    x = torch.randn(3 * block, hidden, dtype=torch.float64)
    y = torch.randn(3 * block, hidden, dtype=torch.float64)
    delta = (x @ conv.kernel_projection.weight.T).view(-1, 2, taps, hidden // group)  # [before/after, T, G]
    before, delta_after = conv.prepare(x)
    after = conv.finish(y, delta_after)
    want_before = _conv_loop(x, conv.base_kernel[0].detach(), delta[:, 0], group, block)
    want_after = _conv_loop(y, conv.base_kernel[1].detach(), delta[:, 1], group, block)
    assert torch.allclose(before, want_before, atol=1e-12), (before - want_before).abs().max()
    assert torch.allclose(after, want_after, atol=1e-12), (after - want_after).abs().max()


def test_block_conv_never_reads_across_a_block_boundary():
    block = 4
    conv = _random_conv(block=block, taps=6)  # taps longer than the block
    x = torch.randn(3 * block, 12, dtype=torch.float64)
    moved = x.clone()
    moved[block - 1] += 5.0  # the last slot of block 0
    out, _ = conv.prepare(x)
    out_moved, _ = conv.prepare(moved)
    assert torch.equal(out[block:], out_moved[block:])
    assert not torch.equal(out[:block], out_moved[:block])


def _random_selector(vocab=11, hidden=6, rank=3, top_k=4, seed=0) -> CandidateSelector:
    torch.manual_seed(seed)
    selector = CandidateSelector(vocab, hidden, rank, top_k).double()
    with torch.no_grad():
        for p in selector.parameters():
            p.normal_()
    return selector


def test_selector_scores_and_greedy_walk_match_a_brute_force_loop():
    vocab, hidden, rank, k, slots, n = 11, 6, 3, 4, 5, 3
    sel = _random_selector(vocab, hidden, rank, k)
    g = torch.Generator().manual_seed(1)
    hidden_NSH = torch.randn(n, slots, hidden, generator=g, dtype=torch.float64)
    logits_NSV = torch.randn(n, slots, vocab, generator=g, dtype=torch.float64)
    anchor_N = torch.randint(0, vocab, (n,), generator=g)
    unary_NSK, cand_NSK = torch.topk(logits_NSV, k, dim=-1)
    path = sel.greedy_path(unary_NSK, cand_NSK, hidden_NSH, anchor_N)

    P, S, W = sel.predecessor_codebook.detach(), sel.successor_codebook.detach(), sel.hidden_projection.weight.detach()

    def score(b, s, prev, c):  # unary[c] + sum_r P[prev, r] * (W h)[r] * S[c, r]
        h = hidden_NSH[b, s]
        return logits_NSV[b, s, c] + sum(
            P[prev, r] * sum(W[r, j] * h[j] for j in range(hidden)) * S[c, r] for r in range(rank)
        )

    for b in range(n):
        prev = int(anchor_N[b])
        for s in range(slots):
            top = sorted(range(vocab), key=lambda v: -logits_NSV[b, s, v])[:k]
            scores = {c: score(b, s, prev, c) for c in top}
            got = sel.edge_scores(
                unary_NSK[b, s : s + 1], cand_NSK[b, s : s + 1], torch.tensor([prev]), hidden_NSH[b, s : s + 1]
            )
            want = torch.tensor([scores[int(c)] for c in cand_NSK[b, s]], dtype=torch.float64)
            assert torch.allclose(got[0], want, atol=1e-10)
            prev = max(top, key=lambda c: scores[c])
            assert int(path[b, s]) == prev, (b, s)


def test_a_fresh_dflash2_drafter_is_dflash1_with_inert_additions():
    """With DFlash 1's weights copied in, the convolutions are the identity and the selector's walk is the
    unary argmax chain (its hidden projection is zero): the warm start's identity, in the model itself."""
    cfg1 = tiny_config(block_size=4)
    cfg2 = cfg1.replace(arch="dflash2", conv_group_size=8, selector_rank=5, selector_top_k=6)
    model1, head = tiny_model_and_head(cfg1, dtype=torch.float64)
    torch.manual_seed(3)
    model2 = DFlashDrafter(cfg2).double()
    missing, unexpected = model2.load_state_dict(model1.state_dict(), strict=False)
    assert unexpected == [] and all("conv" in m or "candidate_selector" in m for m in missing)
    batch = make_batch([20, 28], token_budget=48, max_seqs=3, num_taps=3, hidden=32)
    batch["hidden_TKH"] = batch["hidden_TKH"].double()
    blocks, layout = blocks_and_layout(cfg1, batch, num_blocks=6)
    h1 = forward_blocks(model1, head, batch, blocks, layout)
    h2 = forward_blocks(model2, head, batch, blocks, layout)
    assert torch.equal(h1, h2)
    path = model2.selector_path(h2[:, 1:], head, blocks.block_ids_NB[:, 0])
    assert torch.equal(path, model1.draft_logits(h1[:, 1:], head).argmax(-1))


def test_the_27b_dflash2_layout_has_the_published_size():
    """Qwen3.8-27B-DFlash2: 1.93B parameters, 3.85 GB in bf16 (field notes 2.1), five sliding layers of 2048."""
    cfg = DrafterConfig.for_target(**{**QWEN36_27B_TARGET, "tap_layer_ids": [5, 19, 33, 47, 61]}, arch="dflash2")
    assert cfg.layer_types == ["sliding_attention"] * 5 and cfg.sliding_window == 2048
    params = count_parameters(cfg)
    assert round(params / 1e9, 2) == 1.92 and round(2 * params / 1e9, 2) == 3.85
