"""DFlash training loss over draft blocks, computed chunk by chunk over the target's lm_head.

Per block n and slot k >= 1 (label y = token at anchor+k, weight w from blocks.py):
    CE   = sum w * -log q(y)                                   / sum w
    KL   = sum w * sum_i p_i (log p_i - log q(v_i))            / sum w
           p = the target's stored top-Kt distribution at anchor+k-1, renormalised over its Kt ids v_i
    CAP  = -sum_n sum_{k>=1} prod_{j=1..k} q_j(y_j) [valid_j]  / (valid blocks * (B-1))
    total = CE + kl_lambda * KL + cap_lambda * CAP
q = softmax(lm_head(h)) over the full vocabulary, in float32 (float64 inputs stay float64).

[NB*B, V] logits are never built for the whole batch. `block_loss` runs a custom autograd
function that, for each chunk of blocks, builds the chunk's logits, the loss terms and their
gradient with respect to the chunk's hidden states, then frees the logits; backward only scales
the stored gradient. The LM head costs two matmuls per chunk (logits, grad), not three as with
recomputation. The normalisers depend only on the weights, so chunks add up exactly.
With `fused` (training only), the chunk's terms and logit gradient come from fused_loss.py's
hand-written derivative instead of autograd over log_softmax: the same two matmuls, but the [X, V]
work between them is one reduction and one pointwise pass over the compute-dtype logits (compiled
into two kernels on CUDA) instead of float32 logits, log-softmax, a scatter and its backward.

Legend: NB blocks, B block size, C blocks in a chunk, X = C*B rows, H hidden, V vocab,
T packed tokens, Kt stored target top-k.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from train.blocks import TrainingBlocks
from train.drafter.model import lm_head_weight
from train.loss.config import LossConfig
from train.loss.fused import ChunkTargets, compiled_loss_and_logit_grad, loss_and_logit_grad
from train.loss.head_gemms import HeadGemms
from train.loss.selector import CandidateSet


class LossParts(NamedTuple):
    """Device scalars. total carries the gradient; ce, kl, cap are detached values of the terms
    (before their lambdas; kl and cap are 0 when disabled; cap is negative)."""

    total: torch.Tensor
    ce: torch.Tensor
    kl: torch.Tensor
    cap: torch.Tensor


def _float_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_sums(
    hidden_CBH: torch.Tensor, gemms: HeadGemms, targets: ChunkTargets, with_cap: bool, transform=None
) -> tuple[torch.Tensor, ...]:
    """Unnormalised (ce_sum, kl_sum, cap_sum) of a chunk of blocks; differentiable in hidden.
    gemms: the lm_head's GEMMs (head_gemms.py); transform: applied to the float logits first (DFlash 2's
    scale and soft cap); None = none."""
    labels_CB, label_valid_CB, weights_CB, kl_ids_CBK, kl_logp_CBK = targets
    C, B, H = hidden_CBH.shape
    fdt = _float_dtype(hidden_CBH.dtype)
    logits_XV = gemms.logits(hidden_CBH.reshape(C * B, H)).to(fdt)
    if transform is not None:
        logits_XV = transform(logits_XV)
    logp_XV = torch.log_softmax(logits_XV, dim=-1)
    logp_label_CB = logp_XV.gather(1, labels_CB.reshape(-1, 1)).view(C, B)
    weights_CB = weights_CB.to(fdt)
    ce_sum = -(weights_CB * logp_label_CB).sum()

    kl_sum = logp_XV.new_zeros(())
    if kl_ids_CBK is not None:
        Kt = kl_ids_CBK.shape[-1]
        logp_target_CBK = torch.log_softmax(kl_logp_CBK.to(fdt), dim=-1)  # renormalise the top-Kt
        logq_at_ids_CBK = logp_XV.gather(1, kl_ids_CBK.reshape(C * B, Kt).long()).view(C, B, Kt)
        kl_CB = (logp_target_CBK.exp() * (logp_target_CBK - logq_at_ids_CBK)).sum(-1)
        kl_sum = (weights_CB * kl_CB).sum()

    cap_sum = logp_XV.new_zeros(())
    if with_cap:
        # prod_{j<=k} q_j = exp(cumsum log q_j); an invalid slot contributes -inf, ending the chain.
        logq_CB = torch.where(label_valid_CB, logp_label_CB, torch.full_like(logp_label_CB, float("-inf")))
        cap_sum = torch.exp(torch.cumsum(logq_CB[:, 1:], dim=1)).sum()
    return ce_sum, kl_sum, cap_sum


def _normalisers(blocks: TrainingBlocks, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # Any valid block has weight 1 at slot 1, so a nonzero sum is >= 1; the clamp only guards all-invalid.
    ce_norm = blocks.weights_NB.to(dtype).sum().clamp_min(1e-6)
    cap_norm = (blocks.block_valid_N.to(dtype).sum() * (blocks.block_size - 1)).clamp_min(1.0)
    return ce_norm, cap_norm


def _chunk_targets(blocks: TrainingBlocks, cfg: LossConfig, ids_TK, logp_TK, sl: slice) -> ChunkTargets:
    """The labels, weights and (with KL) stored target top-k of the blocks in `sl`."""
    kl_ids, kl_logp = None, None
    if cfg.kl_lambda > 0:
        if ids_TK is None or logp_TK is None:
            raise ValueError(
                "LossConfig.kl_lambda > 0 needs target_topk_ids and target_topk_logprobs; "
                "the cache has none: re-extract with target top-k or set kl_lambda 0"
            )
        index_CB = blocks.prev_index_NB[sl]
        kl_ids, kl_logp = ids_TK[index_CB], logp_TK[index_CB]
    return ChunkTargets(blocks.labels_NB[sl], blocks.label_valid_NB[sl], blocks.weights_NB[sl], kl_ids, kl_logp)


def _combine(sums, ce_norm, cap_norm, cfg: LossConfig):
    ce_sum, kl_sum, cap_sum = sums
    ce, kl, cap = ce_sum / ce_norm, kl_sum / ce_norm, -cap_sum / cap_norm
    return ce + cfg.kl_lambda * kl + cfg.cap_lambda * cap, ce, kl, cap


class _ChunkedBlockLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NBH, gemms, blocks, cfg, ids_TK, logp_TK, candidates, transform):
        needs_grad = ctx.needs_input_grad[0]
        fdt = _float_dtype(hidden_NBH.dtype)
        ce_norm, cap_norm = norms = _normalisers(blocks, fdt)
        parts = torch.zeros(4, dtype=fdt, device=hidden_NBH.device)
        grad_NBH = torch.zeros_like(hidden_NBH) if needs_grad else None
        for start in range(0, blocks.num_blocks, cfg.chunk_blocks):
            sl = slice(start, start + cfg.chunk_blocks)
            targets = _chunk_targets(blocks, cfg, ids_TK, logp_TK, sl)
            if needs_grad and cfg.fused and transform is None:  # fused_loss's derivative knows no transform
                terms, grad_NBH[sl] = _fused_chunk(hidden_NBH[sl], gemms, targets, cfg, norms, candidates, sl)
                parts += torch.stack(terms)
                continue
            if candidates is not None:
                C, B, H = hidden_NBH[sl].shape
                candidates.take(sl, gemms.logits(hidden_NBH[sl].detach().reshape(C * B, H)), targets.labels_CB)
            h_CBH = hidden_NBH[sl].detach().requires_grad_(needs_grad)
            with torch.enable_grad():
                sums = _chunk_sums(h_CBH, gemms, targets, cfg.cap_lambda > 0, transform)
                terms = _combine(sums, ce_norm, cap_norm, cfg)
            if needs_grad:
                grad_NBH[sl] = torch.autograd.grad(terms[0], h_CBH)[0]
            parts += torch.stack([t.detach() for t in terms])
        ctx.save_for_backward(grad_NBH)
        ctx.mark_non_differentiable(parts)
        return parts[0].clone(), parts

    @staticmethod
    def backward(ctx, grad_total, grad_parts):
        (grad_NBH,) = ctx.saved_tensors
        return (grad_NBH * grad_total.to(grad_NBH.dtype), None, None, None, None, None, None, None)


def _fused_chunk(h_CBH, gemms: HeadGemms, targets: ChunkTargets, cfg: LossConfig, norms, candidates=None, sl=None):
    """(the chunk's (total, ce, kl, cap) terms, d total / d h_CBH) by fused_loss's derivative; records the
    chunk's top-K in `candidates` (DFlash 2's selector) from the same logits."""
    C, B, H = h_CBH.shape
    logits_XV = gemms.logits(h_CBH.detach().reshape(C * B, H))
    if candidates is not None:
        candidates.take(sl, logits_XV, targets.labels_CB)
    chunk_fn = compiled_loss_and_logit_grad() if logits_XV.is_cuda else loss_and_logit_grad
    *sums, grad_XV = chunk_fn(logits_XV, targets, *norms, kl_lambda=cfg.kl_lambda, cap_lambda=cfg.cap_lambda)
    return _combine(sums, *norms, cfg), gemms.input_grad(grad_XV).view(C, B, H)


def _frozen_lm_head(head) -> torch.Tensor:
    weight = lm_head_weight(head)
    if weight.requires_grad:
        raise ValueError(
            "the target lm_head must be frozen (requires_grad False); the chunked loss returns no gradient for it"
        )
    return weight


def block_loss(
    hidden_NBH: torch.Tensor,
    lm_head,
    blocks: TrainingBlocks,
    cfg: LossConfig,
    target_topk_ids_TK: torch.Tensor | None = None,
    target_topk_logprobs_TK: torch.Tensor | None = None,
    candidates: CandidateSet | None = None,
    transform=None,
    gemms: HeadGemms | None = None,
) -> LossParts:
    """Chunked loss of the drafter's normed block states [NB, B, H]; lm_head is a TargetHead or [V, H].
    gemms: how the lm_head's two GEMMs run (head_gemms.py: Fp8HeadGemms for --fp8 linears+head); None =
    plain matmuls over lm_head.
    candidates: DFlash 2's selector candidate set, filled from the chunks' raw logits (train/loss/selector.py).
    transform: DFlash 2's logit transform (DFlashDrafter.logit_transform), applied before the softmax;
    it runs the autograd path (the fused derivative has no transform)."""
    if not torch.is_grad_enabled():
        hidden_NBH = hidden_NBH.detach()  # evaluation: skip the in-forward gradient work
    total, parts = _ChunkedBlockLoss.apply(
        hidden_NBH,
        gemms or HeadGemms(_frozen_lm_head(lm_head)),
        blocks,
        cfg,
        target_topk_ids_TK,
        target_topk_logprobs_TK,
        candidates,
        transform,
    )
    return LossParts(total, parts[1], parts[2], parts[3])


def block_loss_unchunked(
    hidden_NBH: torch.Tensor,
    lm_head,
    blocks: TrainingBlocks,
    cfg: LossConfig,
    target_topk_ids_TK: torch.Tensor | None = None,
    target_topk_logprobs_TK: torch.Tensor | None = None,
) -> LossParts:
    """Same loss in one pass with plain autograd (all logits at once): the reference for tests."""
    fdt = _float_dtype(hidden_NBH.dtype)
    ce_norm, cap_norm = _normalisers(blocks, fdt)
    targets = _chunk_targets(blocks, cfg, target_topk_ids_TK, target_topk_logprobs_TK, slice(0, blocks.num_blocks))
    sums = _chunk_sums(hidden_NBH, HeadGemms(_frozen_lm_head(lm_head)), targets, cfg.cap_lambda > 0)
    total, ce, kl, cap = _combine(sums, ce_norm, cap_norm, cfg)
    return LossParts(total, ce.detach(), kl.detach(), cap.detach())
