"""The FLOPs per step behind MFU, against torch's own FLOP counter on a real forward and backward."""

import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers.drafter import drafter_for_target
from train.drafter.model import DFlashDrafter
from train.metrics.flops import drafter_step_flops, peak_flops


def test_step_flops_match_torchs_count_of_the_matmuls():
    cfg = drafter_for_target(32, 48, 96, num_layers=2, block_size=4)
    T, N = 40, 3
    model = DFlashDrafter(cfg)
    head_VH = torch.randn(cfg.vocab_size, cfg.hidden_size)  # frozen, as the target's lm_head
    hidden_TKH = torch.randn(T, cfg.num_taps, cfg.hidden_size)  # cached target states: no gradient
    x_QH = torch.randn(N * cfg.block_size, cfg.hidden_size)  # block embeddings: frozen too
    pos_T, pos_Q = torch.arange(T), torch.arange(N * cfg.block_size)

    # Attention scores are not in the formula: count with a matmul-free stand-in (mean of v over keys)
    # that still uses q and k, so their projections get gradients as in training.
    def attend(q, k, v):
        rep = q.shape[1] // v.shape[1]
        out = v.mean(0, keepdim=True).repeat_interleave(rep, dim=1).expand(q.shape[0], -1, -1)
        return out + 0.0 * (q.sum() + k.sum())

    counter = FlopCounterMode(display=False)
    with counter:
        ctx_TH = model.fuse_context(hidden_TKH)
        out_QH = model._run_layers(ctx_TH, pos_T, x_QH, pos_Q, [attend] * cfg.num_layers)
        logits = out_QH @ head_VH.T
        logits.logsumexp(-1).sum().backward()
    want = counter.get_total_flops()
    got = drafter_step_flops(cfg, num_ctx_tokens=T, num_blocks=N)
    assert got == want, (got, want)


def test_no_peak_and_the_reason_off_the_gpu():
    peak, why = peak_flops(torch.device("cpu"), torch.bfloat16)
    assert peak is None and "cpu" in why
