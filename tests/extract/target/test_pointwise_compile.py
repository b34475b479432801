"""The compiled pointwise functions (extract/target/pointwise.py) compile once, dynamic in the token
dimension from the first batch: batches of other lengths reuse those graphs (no static graph first and a
dynamic one on the second batch, which cost a second compile of every function per run). CPU inductor
compiles the same graphs dynamo hands the GPU's."""

import pytest
import torch
from torch._dynamo.utils import counters

from extract.target.config import TargetConfig
from extract.target.kernels import select_kernels
from extract.target.model import TargetModel
from tools.fixtures.tiny_target import random_weights, tiny_config_dict

LAYERS = 4  # 3 GatedDeltaNet layers and 1 attention layer: every pointwise function runs


def _batch(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (num_tokens,), generator=gen)
    cut = num_tokens // 3
    pos = torch.cat([torch.arange(cut), torch.arange(num_tokens - cut)])
    return ids, pos, torch.tensor([0, cut, num_tokens])


@pytest.mark.slow  # about 40 s of inductor C++ compiles on one CPU core
def test_batches_of_other_lengths_reuse_the_first_batchs_graphs():
    torch._dynamo.reset()
    cfg = TargetConfig.from_hf_dict(tiny_config_dict(num_hidden_layers=LAYERS))
    state = random_weights(cfg, seed=0, with_head=False, last_layer=LAYERS - 1)
    compiled, eager = (
        TargetModel.from_state_dict(
            cfg, state, select_kernels("cpu", compile_pointwise=on), dtype=torch.float32, last_layer=LAYERS - 1
        )
        for on in (True, False)
    )
    taps = [1, LAYERS - 1]
    graphs_after = []
    for seed, num_tokens in enumerate((37, 53, 96)):
        batch = _batch(num_tokens, seed)
        got, want = compiled.forward_packed(*batch, taps), eager.forward_packed(*batch, taps)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        graphs_after.append(counters["stats"]["unique_graphs"])
    assert graphs_after[0] > 0, "nothing was compiled"
    assert graphs_after[1:] == [graphs_after[0]] * 2, f"graphs compiled after each batch: {graphs_after}"
