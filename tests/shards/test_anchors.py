"""The anchor rule (shards/anchors.py) against plain Python loops, on packed batches as shards hold them:
padded tails, cu_seqlens padded by repeating the total, empty sequences. (Extraction's count of the
same rule over a dataset: tests/extract/dataset/test_index_anchors.py.)"""

import numpy as np
import pytest
import torch

from shards.anchors import sequence_bounds, valid_anchors


def random_packed(seed: int):
    """(loss_mask_T, cu_seqlens_S1): 0-6 sequences (some empty), a padded tail, repeated totals."""
    g = np.random.default_rng(seed)
    lengths = g.integers(0, 9, size=g.integers(0, 7))
    total = int(lengths.sum())
    num_tokens = total + int(g.integers(0, 5))  # the padded tail belongs to no sequence
    cu = [0, *np.cumsum(lengths).tolist()] + [total] * int(g.integers(0, 3))
    mask = (g.random(num_tokens) < g.random()).astype(np.int64)
    return torch.from_numpy(mask), torch.tensor(cu, dtype=torch.int32)


def loop_bounds(cu: list[int], num_tokens: int) -> list[tuple[int, int]]:
    bounds = [(cu[-1], cu[-1])] * num_tokens  # padding: an empty range at the total
    for s in range(len(cu) - 1):
        for t in range(cu[s], cu[s + 1]):
            bounds[t] = (cu[s], cu[s + 1])
    return bounds


def loop_anchors(mask: list[int], cu: list[int]) -> list[bool]:
    valid = [False] * len(mask)
    for s in range(len(cu) - 1):
        for t in range(cu[s], cu[s + 1]):
            valid[t] = bool(mask[t]) and t + 1 < cu[s + 1] and bool(mask[t + 1])
    return valid


@pytest.mark.parametrize("seed", range(40))
def test_valid_anchors_match_a_loop_on_packed_batches(seed):
    mask_T, cu_S1 = random_packed(seed)
    start_T, end_T = sequence_bounds(cu_S1, mask_T.shape[0])
    assert list(zip(start_T.tolist(), end_T.tolist())) == loop_bounds(cu_S1.tolist(), mask_T.shape[0])
    assert valid_anchors(mask_T, cu_S1).tolist() == loop_anchors(mask_T.tolist(), cu_S1.tolist())
