"""Anchor sampling and block construction (train/blocks.py) against plain Python loops."""

import math

import pytest
import torch

from shards.anchors import valid_anchors
from tests.helpers.drafter import MASK_ID, batch_blocks, make_batch

SEQ_LENS = [9, 14, 3, 11]
BUDGET, MAX_SEQS = 48, 6


def loop_valid_anchors(batch) -> set[int]:
    cu = batch["cu_seqlens_S1"].tolist()
    lm = batch["loss_mask_T"].tolist()
    valid = set()
    for s in range(len(cu) - 1):
        for t in range(cu[s], cu[s + 1]):
            if lm[t] and t + 1 < cu[s + 1] and lm[t + 1]:
                valid.add(t)
    return valid


def sample(batch, num_blocks, block_size=4, seed=0, gamma=7.0):
    g = torch.Generator().manual_seed(seed)
    return batch_blocks(
        batch, num_blocks=num_blocks, block_size=block_size, mask_token_id=MASK_ID, gamma=gamma, generator=g
    )


def test_valid_anchor_rule_matches_loop():
    batch = make_batch(SEQ_LENS, BUDGET, MAX_SEQS, 1, 4, unsupervised=(6, 20))
    got = set(torch.arange(BUDGET)[valid_anchors(batch["loss_mask_T"], batch["cu_seqlens_S1"])].tolist())
    assert got == loop_valid_anchors(batch)


@pytest.mark.parametrize("num_blocks", [5, 30])
def test_blocks_match_loop_reference(num_blocks):
    batch = make_batch(SEQ_LENS, BUDGET, MAX_SEQS, 1, 4, unsupervised=(6, 20))
    B, gamma = 4, 3.0
    blocks = sample(batch, num_blocks, block_size=B, gamma=gamma)
    valid = loop_valid_anchors(batch)
    assert blocks.block_ids_NB.shape == (num_blocks, B) and blocks.weights_NB.shape == (num_blocks, B)
    anchors = blocks.anchor_N.tolist()
    assert anchors == sorted(anchors) and len(set(anchors)) == num_blocks
    # 30 blocks > the valid anchors: all valid ones are taken and the rest carry zero weight.
    assert sum(blocks.block_valid_N.tolist()) == min(num_blocks, len(valid))
    cu = batch["cu_seqlens_S1"].tolist()
    ids, pos, lm = batch["input_ids_T"].tolist(), batch["position_ids_T"].tolist(), batch["loss_mask_T"].tolist()
    for n, a in enumerate(anchors):
        is_valid = a in valid
        assert bool(blocks.block_valid_N[n]) == is_valid
        s = max(i for i in range(len(cu) - 1) if cu[i] <= a) if a < cu[-1] else None
        end = cu[s + 1] if s is not None else None
        if is_valid:
            assert blocks.seq_start_N[n] == cu[s]
        else:
            assert blocks.seq_start_N[n] == a  # padding blocks see no context
        assert blocks.block_ids_NB[n].tolist() == [ids[a]] + [MASK_ID] * (B - 1)
        assert blocks.block_pos_NB[n].tolist() == [pos[a] + k for k in range(B)]
        for k in range(B):
            t = a + k
            ok = is_valid and k >= 1 and t < end and lm[t] == 1
            w = math.exp(-(k - 1) / gamma) if ok else 0.0
            assert bool(blocks.label_valid_NB[n, k]) == ok, (n, k)
            assert abs(float(blocks.weights_NB[n, k]) - w) < 1e-6, (n, k)
            if ok:
                assert blocks.labels_NB[n, k] == ids[t]
                assert blocks.prev_index_NB[n, k] == t - 1


def test_sampler_reproducible_and_seed_dependent():
    batch = make_batch(SEQ_LENS, BUDGET, MAX_SEQS, 1, 4)
    a = sample(batch, 6, seed=3).anchor_N
    assert torch.equal(a, sample(batch, 6, seed=3).anchor_N)
    assert any(not torch.equal(a, sample(batch, 6, seed=s).anchor_N) for s in range(4, 8))


def test_sampler_roughly_uniform():
    batch = make_batch(SEQ_LENS, BUDGET, MAX_SEQS, 1, 4)
    valid = sorted(loop_valid_anchors(batch))
    num_blocks, draws = 4, 3000
    counts = torch.zeros(BUDGET)
    g = torch.Generator().manual_seed(0)
    for _ in range(draws):
        blocks = batch_blocks(batch, num_blocks=num_blocks, block_size=4, mask_token_id=MASK_ID, generator=g)
        counts[blocks.anchor_N.long()] += 1
    p = num_blocks / len(valid)
    expected, sd = draws * p, math.sqrt(draws * p * (1 - p))
    dev = (counts[valid] - expected).abs().max().item()
    assert dev < 5 * sd, f"max deviation {dev:.1f} from {expected:.1f} exceeds 5 sd ({sd:.1f})"
    invalid = [t for t in range(BUDGET) if t not in set(valid)]
    assert counts[invalid].sum() == 0


def test_rejects_more_blocks_than_tokens():
    batch = make_batch(SEQ_LENS, BUDGET, MAX_SEQS, 1, 4)
    with pytest.raises(ValueError, match="num_blocks"):
        sample(batch, BUDGET + 1)
