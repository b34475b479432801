"""Gated delta rule over packed sequences in pure torch: a chunked form and a float64 reference.

The GatedDeltaNet recurrence, per value head h with state S in R^{K x V}, reset to 0 at every
sequence start:
    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t
with q, k l2-normalised per head (eps 1e-6 inside the rsqrt, as fla and HF), q scaled by K^-0.5,
and value head h reading q/k head h // (H / M) (grouped value attention, repeat_interleave order).

The chunked form (used on CPU and as the slow fallback on GPU) works on chunks of C tokens. With
G_t the in-chunk cumulative log-decay and S_0 the state entering the chunk:
    (I + A) U = beta*V - beta*exp(G)*K S_0,   A[t,s] = beta_t exp(G_t - G_s) k_t.k_s  (s < t)
    O = (exp(G)*Q) S_0 + (D * Q K^T) U,        D[t,s] = exp(G_t - G_s)                (s <= t)
    S_C = exp(G_C) S_0 + (exp(G_C - G)*K)^T U
so a chunk costs a few matmuls and one unit-triangular solve, and the scan runs over chunks.

Legend: T packed tokens, M q/k heads, H value heads, K q/k head dim, V value head dim,
N chunks of one sequence, C chunk length, B sequences of one chunk count, L = N * C.
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6  # fla's l2norm_fwd and HF's l2norm both use rsqrt(sum x^2 + 1e-6)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q_TMK, k_TMK, v_THV, dtype):
    """l2norm + scale q/k, expand q/k heads to value heads (head h uses q/k head h // ratio)."""
    ratio = v_THV.shape[1] // q_TMK.shape[1]
    q_TMK = l2norm(q_TMK.to(dtype)) * q_TMK.shape[-1] ** -0.5
    k_TMK = l2norm(k_TMK.to(dtype))
    q_THK = q_TMK.repeat_interleave(ratio, dim=1)
    k_THK = k_TMK.repeat_interleave(ratio, dim=1)
    return q_THK, k_THK


def _check(q_TMK, k_TMK, v_THV, g_TH, beta_TH, cu_seqlens: list[int]) -> None:
    T, M, _ = q_TMK.shape
    H = v_THV.shape[1]
    if k_TMK.shape != q_TMK.shape or v_THV.shape[0] != T or g_TH.shape != (T, H) or beta_TH.shape != (T, H):
        raise ValueError(
            f"gated delta rule shapes disagree: q {tuple(q_TMK.shape)}, k {tuple(k_TMK.shape)}, "
            f"v {tuple(v_THV.shape)}, g {tuple(g_TH.shape)}, beta {tuple(beta_TH.shape)}"
        )
    if H % M:
        raise ValueError(f"gated delta rule: {H} value heads is not a multiple of {M} q/k heads")
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != T:
        raise ValueError(
            f"gated delta rule: cu_seqlens must run from 0 to T={T}, found {cu_seqlens[0]}..{cu_seqlens[-1]}"
        )


def chunk_gated_delta_rule_torch(
    q_TMK: torch.Tensor,
    k_TMK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    cu_seqlens: list[int],
    chunk_size: int = 16,  # tokens per chunk; 16 beats 32 and 64 on CPU for the tiny target (C x C work per token)
) -> torch.Tensor:
    """Chunked gated delta rule in float32 over the packed sequences of `cu_seqlens` (host ints).

    q/k are raw (the l2norm and K^-0.5 scale happen here), g is the log-decay (<= 0), beta the
    post-sigmoid write strength. Returns o_THV in v's dtype.
    """
    _check(q_TMK, k_TMK, v_THV, g_TH, beta_TH, cu_seqlens)
    q_THK, k_THK = _prepare(q_TMK, k_TMK, v_THV, torch.float32)
    v_THV32 = v_THV.float()
    g_TH32 = g_TH.float()
    beta_TH32 = beta_TH.float()
    o_THV = torch.zeros(v_THV.shape, dtype=torch.float32, device=v_THV.device)
    # Sequences with the same number of chunks run as one batch: the per-chunk work is a few
    # batched matmuls instead of one Python pass per sequence (the tiny server's step packs 64+
    # short sequences; a loop per sequence was 70% of its time). Grouping by chunk count keeps the
    # padding below one chunk per sequence.
    lens = [eos - bos for bos, eos in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    groups: dict[int, list[int]] = {}
    for s, n in enumerate(lens):
        if n > 0:
            groups.setdefault(-(-n // chunk_size), []).append(s)
    for N, seqs in groups.items():
        bos_B = torch.tensor([cu_seqlens[s] for s in seqs], device=v_THV.device)
        len_B = torch.tensor([lens[s] for s in seqs], device=v_THV.device)
        offset_L = torch.arange(N * chunk_size, device=v_THV.device)
        valid_BL = offset_L < len_B[:, None]
        idx_BL = torch.where(valid_BL, bos_B[:, None] + offset_L, 0)
        # Padding with k = 0, beta = 0, g = 0 leaves the state untouched; padded outputs are dropped.
        q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH = (
            torch.where(valid_BL.view(*valid_BL.shape, *([1] * (x.ndim - 1))), x[idx_BL], 0.0)
            for x in (q_THK, k_THK, v_THV32, g_TH32, beta_TH32)
        )
        o_BLHV = _chunked(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH, chunk_size)
        o_THV[idx_BL[valid_BL]] = o_BLHV[valid_BL]
    return o_THV.to(v_THV.dtype)


def _chunked(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH, C: int) -> torch.Tensor:
    """o_BLHV for B sequences padded to L = N * C tokens (the padding with k = beta = g = 0)."""
    q_BHNCK, k_BHNCK, v_BHNCV = (x.permute(0, 2, 1, 3).unflatten(2, (-1, C)) for x in (q_BLHK, k_BLHK, v_BLHV))
    g_BHNC, beta_BHNC = (x.permute(0, 2, 1).unflatten(2, (-1, C)) for x in (g_BLH, beta_BLH))
    B, H, N, _, K = k_BHNCK.shape
    V = v_BHNCV.shape[-1]

    G_BHNC = g_BHNC.cumsum(-1)
    lower_incl = torch.ones(C, C, dtype=torch.bool, device=q_BHNCK.device).tril()
    # D[t, s] = exp(G_t - G_s) for s <= t, 0 above the diagonal (mask before exp: no overflow).
    D_BHNCC = (G_BHNC.unsqueeze(-1) - G_BHNC.unsqueeze(-2)).masked_fill(~lower_incl, float("-inf")).exp()
    kk_BHNCC = k_BHNCK @ k_BHNCK.transpose(-1, -2)
    A_BHNCC = (beta_BHNC.unsqueeze(-1) * D_BHNCC * kk_BHNCC).tril(-1)
    eye = torch.eye(C, dtype=A_BHNCC.dtype, device=A_BHNCC.device)
    IA_BHNCC = A_BHNCC + eye
    # U = Ub - W S_0 with Ub = (I+A)^-1 beta V and W = (I+A)^-1 beta exp(G) K.
    Ub_BHNCV = torch.linalg.solve_triangular(
        IA_BHNCC, beta_BHNC.unsqueeze(-1) * v_BHNCV, upper=False, unitriangular=True
    )
    W_BHNCK = torch.linalg.solve_triangular(
        IA_BHNCC, (beta_BHNC * G_BHNC.exp()).unsqueeze(-1) * k_BHNCK, upper=False, unitriangular=True
    )
    qk_BHNCC = (q_BHNCK @ k_BHNCK.transpose(-1, -2)) * D_BHNCC
    q_decay_BHNCK = q_BHNCK * G_BHNC.exp().unsqueeze(-1)
    k_tail_BHNCK = k_BHNCK * (G_BHNC[..., -1:] - G_BHNC).exp().unsqueeze(-1)
    chunk_decay_BHN = G_BHNC[..., -1].exp()

    S_BHKV = q_BHNCK.new_zeros(B, H, K, V)
    o_BHNCV = torch.empty_like(v_BHNCV)
    for n in range(N):
        U_BHCV = Ub_BHNCV[:, :, n] - W_BHNCK[:, :, n] @ S_BHKV
        o_BHNCV[:, :, n] = q_decay_BHNCK[:, :, n] @ S_BHKV + qk_BHNCC[:, :, n] @ U_BHCV
        S_BHKV = chunk_decay_BHN[:, :, n, None, None] * S_BHKV + k_tail_BHNCK[:, :, n].transpose(-1, -2) @ U_BHCV
    return o_BHNCV.flatten(2, 3).permute(0, 2, 1, 3)  # [B, L, H, V]


def recurrent_gated_delta_rule_float64(
    q_TMK: torch.Tensor,
    k_TMK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    cu_seqlens: list[int],
) -> torch.Tensor:
    """Token-by-token float64 recurrence: the test reference for every gated delta rule kernel."""
    _check(q_TMK, k_TMK, v_THV, g_TH, beta_TH, cu_seqlens)
    q_THK, k_THK = _prepare(q_TMK, k_TMK, v_THV, torch.float64)
    v_THV = v_THV.double()
    g_TH = g_TH.double()
    beta_TH = beta_TH.double()
    T, H, V = v_THV.shape
    K = q_THK.shape[-1]
    o_THV = torch.zeros(T, H, V, dtype=torch.float64, device=v_THV.device)
    for bos, eos in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        S_HKV = torch.zeros(H, K, V, dtype=torch.float64, device=v_THV.device)
        for t in range(bos, eos):
            S_HKV = S_HKV * g_TH[t].exp()[:, None, None]
            pred_HV = torch.einsum("hkv,hk->hv", S_HKV, k_THK[t])
            u_HV = beta_TH[t][:, None] * (v_THV[t] - pred_HV)
            S_HKV = S_HKV + k_THK[t][:, :, None] * u_HV[:, None, :]
            o_THV[t] = torch.einsum("hkv,hk->hv", S_HKV, q_THK[t])
    return o_THV
