"""tools/bench/train_workload's analytic counts (keys per query per layer, kv tiles visited) against the masks."""

from types import SimpleNamespace

import pytest
import torch

from tests.helpers.drafter import ranges_at_sequence_starts
from tools.bench.train_workload import SIZES, drafter_config, mean_keys_per_layer, parse_layer_types, visited_kv_tiles
from train.drafter.attention import BlockAttentionLayout, block_mask_dense


@pytest.mark.parametrize("is_causal,window", [(None, 40), (False, 40), (False, 5)])
def test_mean_keys_per_layer_counts_the_dense_masks(is_causal, window):
    num_ctx, nb, bs = 300, 16, 16
    seq_start, anchor = ranges_at_sequence_starts(num_ctx, nb, 2)
    valid = anchor > seq_start  # blocks at a sequence start count as padding here, as the trainer makes them
    # The count reads only the blocks' ranges and validity (the rest of a TrainingBlocks is not needed).
    blocks = SimpleNamespace(anchor_N=anchor, seq_start_N=seq_start, block_valid_N=valid)
    cfg = drafter_config(SIZES["launch"], parse_layer_types("sliding,full,sliding,full,full"), window)
    cfg = cfg.replace(is_causal=is_causal)
    got = mean_keys_per_layer(blocks, cfg)
    for i, sliding in enumerate(cfg.sliding_layers):
        mask = block_mask_dense(
            seq_start,
            anchor,
            num_ctx=num_ctx,
            block_size=bs,
            sliding_window=window if sliding else None,
            causal=cfg.sliding_causal,
        )
        want = mask.view(nb, bs, -1)[valid].sum(-1).float().mean().item()
        assert abs(got[i] - want) < 1e-4, (i, got[i], want)


def test_visited_kv_tiles_reads_both_masks():
    num_ctx, nb, bs = 2048, 16, 16
    anchor = torch.linspace(1000, 2040, nb).int()
    layout = BlockAttentionLayout(num_ctx=num_ctx, num_blocks=nb, block_size=bs, backend="flex", sliding_window=128)
    layout.update(torch.zeros(nb, dtype=torch.int32), anchor)
    tiles = visited_kv_tiles(layout)
    assert tiles["sliding"] < tiles["full"] <= tiles["of"]
