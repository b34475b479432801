"""The anchor positions a dataset scan counts (extract.dataset.index.anchor_positions, by shards/anchors.py's
rule) against a plain loop, under each --long-seqs policy: what training can sample from what packing keeps."""

import numpy as np
import pytest

from extract.dataset.index import anchor_positions, longest_supervised_run


def kept_spans(lengths: list[int], token_budget: int | None, long_seqs: str) -> list[range]:
    """Per sample, the positions packing keeps: all; the first token_budget tokens under truncate;
    nothing under the other policies when longer."""
    spans, start = [], 0
    for length in lengths:
        kept = length
        if token_budget is not None and length > token_budget:
            kept = token_budget if long_seqs == "truncate" else 0
        spans.append(range(start, start + kept))
        start += length
    return spans


def loop_count(lengths: list[int], mask: list[int], token_budget: int | None, long_seqs: str) -> int:
    """In the part of each sample packing keeps, each t with mask[t] and mask[t + 1]."""
    spans = kept_spans(lengths, token_budget, long_seqs)
    return sum(1 for span in spans for t in span[:-1] if mask[t] and mask[t + 1])


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("token_budget, long_seqs", [(None, "truncate"), (4, "truncate"), (4, "skip"), (1, "truncate")])
def test_extraction_counts_the_anchors_training_can_sample(seed, token_budget, long_seqs):
    g = np.random.default_rng(seed)
    lengths = g.integers(0, 9, size=g.integers(0, 7)).astype(np.int64)
    mask = (g.random(int(lengths.sum())) < g.random()).astype(np.uint8)
    want = loop_count(lengths.tolist(), mask.tolist(), token_budget, long_seqs)
    assert anchor_positions(lengths, mask, token_budget, long_seqs) == want


def loop_longest_run(lengths: list[int], mask: list[int], token_budget: int | None, long_seqs: str) -> int:
    """Per sample, in the part packing keeps: the longest stretch of consecutive mask == 1 tokens."""
    longest = 0
    for span in kept_spans(lengths, token_budget, long_seqs):
        run = 0
        for t in span:
            run = run + 1 if mask[t] else 0
            longest = max(longest, run)
    return longest


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("token_budget, long_seqs", [(None, "truncate"), (4, "truncate"), (4, "skip"), (1, "truncate")])
def test_extraction_finds_the_longest_reply_training_sees(seed, token_budget, long_seqs):
    """A run never spans two samples (the mask is often all ones: back-to-back samples would join)."""
    g = np.random.default_rng(seed)
    lengths = g.integers(0, 9, size=g.integers(0, 7)).astype(np.int64)
    mask = (g.random(int(lengths.sum())) < g.random() * 1.5).astype(np.uint8)
    want = loop_longest_run(lengths.tolist(), mask.tolist(), token_budget, long_seqs)
    assert longest_supervised_run(lengths, mask, token_budget, long_seqs) == want
