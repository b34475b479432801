"""Torch kernels of the target against float64 references, batch preparation, kernel selection.

Legend: T packed tokens, M q/k (or kv) heads, H value (or query) heads, K/V/D head dims, C channels.
"""

import logging

import pytest
import torch
import torch.nn.functional as F

from extract.target.gated_delta import chunk_gated_delta_rule_torch, recurrent_gated_delta_rule_float64
from extract.target.kernels import (
    KernelChoice,
    SlowKernelError,
    causal_conv1d_silu_torch,
    sdpa_per_sequence,
    select_kernels,
)

BOUNDS = [0, 37, 37, 110, 111, 150]  # an empty sequence, a 1-token one, lengths across chunk edges


def _gdn_inputs(T, M, H, K, V, seed):
    gen = torch.Generator().manual_seed(seed)
    q_TMK = torch.randn(T, M, K, generator=gen)
    k_TMK = torch.randn(T, M, K, generator=gen)
    v_THV = torch.randn(T, H, V, generator=gen)
    g_TH = -F.softplus(torch.randn(T, H, generator=gen)) * 0.3
    beta_TH = torch.rand(T, H, generator=gen)
    return q_TMK, k_TMK, v_THV, g_TH, beta_TH


@pytest.mark.parametrize("M,H,chunk", [(2, 6, 16), (3, 3, 64), (2, 4, 32)])
def test_chunked_gated_delta_rule_equals_float64_recurrence(M, H, chunk):
    inputs = _gdn_inputs(BOUNDS[-1], M, H, 16, 8, seed=M * H + chunk)
    ours_THV = chunk_gated_delta_rule_torch(*inputs, BOUNDS, chunk_size=chunk)
    ref_THV = recurrent_gated_delta_rule_float64(*inputs, BOUNDS)
    err = (ours_THV.double() - ref_THV).abs().max().item()
    assert err < 1e-5 * ref_THV.abs().max().item(), f"max abs diff {err:.2e}"


def test_gated_delta_rule_resets_state_at_sequence_start():
    q, k, v, g, beta = _gdn_inputs(BOUNDS[-1], 2, 6, 16, 8, seed=1)
    packed = chunk_gated_delta_rule_torch(q, k, v, g, beta, BOUNDS)
    bos, eos = 37, 110
    alone = chunk_gated_delta_rule_torch(q[bos:eos], k[bos:eos], v[bos:eos], g[bos:eos], beta[bos:eos], [0, eos - bos])
    assert (packed[bos:eos] - alone).abs().max() < 1e-6


def test_gated_delta_rule_value_head_h_reads_qk_head_h_div_ratio():
    """Changing q/k head 1 must change value heads 3..5 only (ratio 3, repeat_interleave order)."""
    q, k, v, g, beta = _gdn_inputs(40, 2, 6, 16, 8, seed=2)
    base = chunk_gated_delta_rule_torch(q, k, v, g, beta, [0, 40])
    q2 = q.clone()
    q2[:, 1] += 1.0
    moved = (chunk_gated_delta_rule_torch(q2, k, v, g, beta, [0, 40]) - base).abs().amax(dim=(0, 2))
    assert (moved[:3] == 0).all() and (moved[3:] > 0).all(), f"per-head change {moved.tolist()}"


def test_torch_conv_equals_per_sequence_conv1d():
    gen = torch.Generator().manual_seed(0)
    T, C, W = BOUNDS[-1], 24, 4
    x_TE = torch.randn(T, C, generator=gen, dtype=torch.float64)
    w_EW = torch.randn(C, W, generator=gen, dtype=torch.float64)
    ours = causal_conv1d_silu_torch(x_TE.float(), w_EW.float(), torch.tensor(BOUNDS)).double()
    for bos, eos in zip(BOUNDS[:-1], BOUNDS[1:]):
        if eos == bos:
            continue
        x_1EL = x_TE[bos:eos].T.unsqueeze(0)
        ref = F.silu(F.conv1d(x_1EL, w_EW.unsqueeze(1), padding=W - 1, groups=C)[..., : eos - bos])[0].T
        assert (ours[bos:eos] - ref).abs().max() < 1e-5, f"sequence {bos}:{eos}"


def test_sdpa_per_sequence_equals_naive_gqa_attention():
    gen = torch.Generator().manual_seed(0)
    T, H, M, D = BOUNDS[-1], 6, 2, 8
    q, k, v = (torch.randn(T, n, D, generator=gen, dtype=torch.float64) for n in (H, M, M))
    ours = sdpa_per_sequence(q, k, v, BOUNDS, scale=0.3)
    for bos, eos in zip(BOUNDS[:-1], BOUNDS[1:]):
        L = eos - bos
        if L == 0:
            continue
        for h in range(H):
            scores = q[bos:eos, h] @ k[bos:eos, h // (H // M)].T * 0.3
            scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
            ref = scores.softmax(-1) @ v[bos:eos, h // (H // M)]
            assert (ours[bos:eos, h] - ref).abs().max() < 1e-10


def test_prepare_normalises_shard_cu_seqlens():
    choice = KernelChoice(gated_delta_backend="torch", conv_backend="torch", attention_backend="sdpa")
    batch = choice.prepare(torch.tensor([0, 5, 5, 9, 9, 9], dtype=torch.int32), 12, torch.device("cpu"))
    assert batch.bounds == [0, 5, 9, 12] and batch.max_seqlen == 5
    with pytest.raises(ValueError, match="cu_seqlens"):
        choice.prepare(torch.tensor([0, 5, 3]), 12, torch.device("cpu"))
    with pytest.raises(ValueError, match="cu_seqlens"):
        choice.prepare(torch.tensor([0, 13]), 12, torch.device("cpu"))


def test_cpu_selection_logs_one_line_per_op(caplog):
    with caplog.at_level(logging.INFO, logger="extract.target.kernels"):
        choice = select_kernels("cpu")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernel ")]
    assert lines == choice.log_lines() and len(lines) == 4
    assert lines[0].startswith("kernel gated_delta_rule: torch (device is not CUDA")
    assert lines[1].startswith("kernel causal_conv1d: torch (")
    assert lines[2].startswith("kernel attention: sdpa (")
    assert lines[3].startswith("kernel pointwise: eager (")
    assert choice.fp8_feeds_line() == "kernel fp8 feeds: the pointwise functions (default off the GPU)"
    with pytest.raises(ValueError, match="CUDA"):
        select_kernels("cpu", gated_delta="fla")
    with pytest.raises(ValueError, match="attention backend"):
        select_kernels("cpu", attention="flash9")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where fast kernels cannot load")
def test_cuda_without_fast_kernels_is_refused_unless_allowed():
    with pytest.raises(SlowKernelError, match="gated_delta_rule.*allow-slow-kernels"):
        select_kernels("cuda")
    choice = select_kernels("cuda", allow_slow_kernels=True)
    assert (choice.gated_delta_backend, choice.conv_backend, choice.attention_backend) == ("torch", "torch", "sdpa")


def test_float32_attention_takes_sdpa_even_where_flash_was_chosen():
    # The H200 run: an fp32 model on the torch_varlen backend failed ("FlashAttention only support fp16
    # and bf16"). fp32 inputs must take per-sequence SDPA; half inputs still take the chosen kernel.
    calls = []

    def flash_like(q_THD, k_TMD, v_TMD, cu_seqlens, max_seqlen, scale):
        if q_THD.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
        calls.append(q_THD.dtype)
        return torch.zeros_like(q_THD)

    choice = KernelChoice(
        gated_delta_backend="torch", conv_backend="torch", attention_backend="torch_varlen", _fns={"varlen": flash_like}
    )
    assert "float32 inputs: per-sequence SDPA" in choice.log_lines()[2]
    batch = choice.prepare(torch.tensor([0, 5, 12]), 12, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    q_THD, k_TMD, v_TMD = (torch.randn(12, h, 8, generator=gen) for h in (4, 2, 2))
    got = choice.attention(q_THD, k_TMD, v_TMD, batch, scale=0.3)
    want = sdpa_per_sequence(q_THD.double(), k_TMD.double(), v_TMD.double(), [0, 5, 12], 0.3)
    assert calls == [] and torch.allclose(got.double(), want, atol=1e-5)
    choice.attention(q_THD.bfloat16(), k_TMD.bfloat16(), v_TMD.bfloat16(), batch, scale=0.3)
    assert calls == [torch.bfloat16]
