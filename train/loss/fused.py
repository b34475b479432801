"""The loss terms of one chunk of blocks and their gradient with respect to the logits, written out
by hand so that the [X, V] work is two passes over the compute-dtype logits (on CUDA: two compiled
kernels), with no float32 [X, V] tensor, no log-softmax tensor and no scatter.

The terms (losses.py's module docstring) depend on the logits only through
    logq_y = logit_y - lse,    lse = log sum_v exp(logit_v)    (in float32; float64 stays float64)
for the label y of each row and, with KL, for the target's top-Kt ids v_i. With g_y and g_i the
derivatives of the chunk's share of the total loss with respect to those logq values,
    d total / d logit_v = g_y [v == y] + sum_i g_i [v == v_i] - softmax_v * (g_y + sum_i g_i)
so one reduction (lse, online over the vocabulary) and one pointwise pass (the line above, cast to
the logits' dtype once, as autograd's cast of the reference does) give everything:
    CE    g_y  = -w / ce_norm
    KL    g_i  = -kl_lambda * w * p_i / ce_norm          (p: the renormalised target top-Kt)
    CAP   g_y += -cap_lambda / cap_norm * sum_{k >= j} prod_{l <= k} q_l   for slot j >= 1 (valid)
The reference is losses._chunk_sums under autograd; tests compare the two in float64.

Legend: C blocks in the chunk, B block size, X = C*B rows, V vocab, Kt stored target top-k.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)


class ChunkTargets(NamedTuple):
    """What a chunk of C blocks is scored against (losses.py and the fused path share it)."""

    labels_CB: torch.Tensor  # int64 token at anchor+k
    label_valid_CB: torch.Tensor  # bool
    weights_CB: torch.Tensor  # float32 slot weights (0 where the label is ignored)
    kl_ids_CBK: torch.Tensor | None  # the target's stored top-Kt ids at anchor+k-1; None without KL
    kl_logp_CBK: torch.Tensor | None  # their log-probabilities (not renormalised)


def loss_and_logit_grad(
    logits_XV: torch.Tensor,
    targets: ChunkTargets,
    ce_norm: torch.Tensor,
    cap_norm: torch.Tensor,
    *,
    kl_lambda: float,
    cap_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ce_sum, kl_sum, cap_sum, d total / d logits [X, V] in the logits' dtype) of one chunk.

    ce_sum, kl_sum, cap_sum are the unnormalised sums of losses._chunk_sums (kl_sum and cap_sum are 0
    when their lambda is 0); total = (ce_sum + kl_lambda kl_sum) / ce_norm - cap_lambda cap_sum / cap_norm.
    """
    labels_X, label_valid_X, weights_X, kl_ids_XK, kl_logp_XK = targets
    X, V = logits_XV.shape
    block_size = labels_X.shape[-1]
    fdt = torch.promote_types(logits_XV.dtype, torch.float32)
    logits_f_XV = logits_XV.to(fdt)
    lse_X1 = torch.logsumexp(logits_f_XV, dim=-1, keepdim=True)
    labels_X1 = labels_X.reshape(X, 1).long()
    logq_label_X = (logits_f_XV.gather(1, labels_X1) - lse_X1).squeeze(1)
    w_X = weights_X.reshape(X).to(fdt)
    ce_sum = -(w_X * logq_label_X).sum()
    g_label_X = -w_X / ce_norm

    zero = logq_label_X.new_zeros(())
    kl_sum, cap_sum = zero, zero
    g_ids_XK = None
    if kl_lambda > 0:
        ids_XK = kl_ids_XK.reshape(X, -1).long()
        logp_target_XK = torch.log_softmax(kl_logp_XK.reshape(X, -1).to(fdt), dim=-1)  # renormalise the top-Kt
        p_target_XK = logp_target_XK.exp()
        logq_ids_XK = logits_f_XV.gather(1, ids_XK) - lse_X1
        kl_sum = (w_X * (p_target_XK * (logp_target_XK - logq_ids_XK)).sum(-1)).sum()
        g_ids_XK = -(kl_lambda / ce_norm) * w_X.unsqueeze(1) * p_target_XK

    if cap_lambda > 0:
        C, B = X // block_size, block_size
        valid_CB = label_valid_X.reshape(C, B)
        logq_CB = torch.where(valid_CB, logq_label_X.view(C, B), torch.full_like(logq_label_X.view(C, B), -torch.inf))
        chains_CK = torch.exp(torch.cumsum(logq_CB[:, 1:], dim=1))  # prod_{l <= k} q_l, slots 1..B-1
        cap_sum = chains_CK.sum()
        tail_CK = chains_CK.flip(1).cumsum(1).flip(1)  # sum_{k >= j} of the chains
        tail_CB = torch.cat([tail_CK.new_zeros(C, 1), tail_CK], dim=1)
        g_label_X = g_label_X - (cap_lambda / cap_norm) * torch.where(valid_CB, tail_CB, 0.0).view(X)

    g_total_X1 = g_label_X.unsqueeze(1)
    v_1V = torch.arange(V, device=logits_XV.device).unsqueeze(0)
    sparse_XV = torch.where(v_1V == labels_X1, g_label_X.unsqueeze(1), 0.0)
    if g_ids_XK is not None:
        g_total_X1 = g_total_X1 + g_ids_XK.sum(-1, keepdim=True)
        for i in range(g_ids_XK.shape[1]):  # Kt is small: unrolled compares, fused into the one pass
            sparse_XV = sparse_XV + torch.where(v_1V == ids_XK[:, i : i + 1], g_ids_XK[:, i : i + 1], 0.0)
    grad_XV = sparse_XV - torch.exp(logits_f_XV - lse_X1) * g_total_X1
    return ce_sum, kl_sum, cap_sum, grad_XV.to(logits_XV.dtype)


_compiled = None


def compiled_loss_and_logit_grad():
    """loss_and_logit_grad compiled once for the fixed chunk shapes (CUDA); the same math, fused."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(loss_and_logit_grad, dynamic=False, fullgraph=True)
        log.info("loss: fused chunk loss compiled (one lse reduction and one gradient pass per chunk)")
    return _compiled
