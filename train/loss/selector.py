"""DFlash 2's selector loss: a K-way cross-entropy over each slot's top-K candidates, scored with the
teacher-forced predecessor (the true token at anchor+k-1), weighted like the unary loss:

    score_k = unary(c_k) + < P[y_{k-1}] * W h, S[c_k] >            (train/drafter/dflash2.py)
    sel     = sum_{slots} w * (logsumexp_k score_k - score_gold) / sum_{slots} w

over the valid slots whose gold token y is in the candidate set. Where y is outside the top-K the peers
differ (field notes 2.4), so both are offered (LossConfig.selector_gold): "drop" (SpecForge, NeMo: the
strict top-K; the slot has no selector loss) and "swap" (speculators: y replaces the weakest candidate).

The candidates come from the unary loss's chunk loop (`CandidateSet.take`, called on each chunk's
logits), so the selector costs no extra pass over the vocabulary. Their unary values reach the hidden
states through `_UnaryAtCandidates`, whose backward sums the K lm_head rows a row used (embedding_bag),
never a [X, V] product; the codebooks are read and updated row by row (F.embedding).

Legend: NB blocks, B block size, S = B-1 draft slots, K candidates, H hidden, V vocab, X rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from train.blocks import TrainingBlocks
from train.drafter.dflash2 import transform_logits

GOLD_CHOICES = ("drop", "swap")


@dataclass
class CandidateSet:
    """Each block slot's top-K candidates, filled chunk by chunk by the unary loss (fixed shapes).

    ids_NBK / raw_NBK: the set the loss scores (with "swap", the gold token in place of the weakest
    candidate where it was missing); raw = lm_head(h) at the ids, before DFlash 2's logit transform.
    in_topk_NB: the gold token was among the true top-K. kept_id_NB / kept_raw_NB: the true K-th
    candidate, so the serving set (`serving`) can be rebuilt after a swap."""

    ids_NBK: torch.Tensor
    raw_NBK: torch.Tensor
    in_topk_NB: torch.Tensor
    kept_id_NB: torch.Tensor
    kept_raw_NB: torch.Tensor
    gold: str

    @classmethod
    def empty(cls, num_blocks: int, block_size: int, top_k: int, gold: str, device, dtype) -> CandidateSet:
        if gold not in GOLD_CHOICES:
            raise ValueError(f"selector gold choice must be one of {GOLD_CHOICES}, got {gold!r}")
        ids = torch.zeros(num_blocks, block_size, top_k, dtype=torch.int64, device=device)
        flat = torch.zeros(num_blocks, block_size, dtype=torch.int64, device=device)
        raw = torch.zeros(num_blocks, block_size, top_k, dtype=dtype, device=device)
        return cls(ids, raw, flat.bool(), flat, raw[..., 0].clone(), gold)

    @torch.no_grad()
    def take(self, sl: slice, logits_XV: torch.Tensor, labels_CB: torch.Tensor) -> None:
        """Record the top-K of one chunk's raw logits (rows = the chunk's blocks x slots)."""
        C, B = labels_CB.shape
        raw_XK, ids_XK = torch.topk(logits_XV, self.ids_NBK.shape[-1], dim=-1)  # sorted: the weakest is last
        gold_X1 = labels_CB.reshape(C * B, 1)
        in_topk_X = (ids_XK == gold_X1).any(-1)
        self.in_topk_NB[sl] = in_topk_X.view(C, B)
        self.kept_id_NB[sl], self.kept_raw_NB[sl] = (
            ids_XK[:, -1].view(C, B),
            raw_XK[:, -1].view(C, B).to(self.raw_NBK.dtype),
        )
        if self.gold == "swap":
            swap_X = ~in_topk_X
            ids_XK[:, -1] = torch.where(swap_X, gold_X1[:, 0], ids_XK[:, -1])
            raw_XK[:, -1] = torch.where(swap_X, logits_XV.gather(1, gold_X1)[:, 0], raw_XK[:, -1])
        self.ids_NBK[sl], self.raw_NBK[sl] = ids_XK.view(C, B, -1), raw_XK.view(C, B, -1).to(self.raw_NBK.dtype)

    def serving(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, raw) of the true top-K, as serving sees it (undoes a swap)."""
        if self.gold == "drop":
            return self.ids_NBK, self.raw_NBK
        ids, raw = self.ids_NBK.clone(), self.raw_NBK.clone()
        ids[..., -1], raw[..., -1] = self.kept_id_NB, self.kept_raw_NB
        return ids, raw


class _UnaryAtCandidates(torch.autograd.Function):
    """raw[x, k] = h[x] . lm_head[ids[x, k]], its value already computed by the chunk loop; backward
    dh[x] = sum_k g[x, k] lm_head[ids[x, k]] by embedding_bag (no [X, K, H] tensor, no [X, V] product)."""

    @staticmethod
    def forward(ctx, hidden_XH, raw_XK, ids_XK, lm_head_VH):
        ctx.save_for_backward(ids_XK, lm_head_VH)
        ctx.hidden_dtype = hidden_XH.dtype
        return raw_XK.clone()

    @staticmethod
    def backward(ctx, grad_XK):
        ids_XK, lm_head_VH = ctx.saved_tensors
        grad_XH = F.embedding_bag(ids_XK, lm_head_VH, per_sample_weights=grad_XK.to(lm_head_VH.dtype), mode="sum")
        return grad_XH.to(ctx.hidden_dtype), None, None, None


def teacher_forced_predecessors(blocks: TrainingBlocks) -> torch.Tensor:
    """[NB, S] the true token before each draft slot: the anchor, then the labels of slots 1..B-2."""
    return torch.cat([blocks.block_ids_NB[:, :1], blocks.labels_NB[:, 1:-1]], dim=1)


def selector_scores(model, hidden_NBH, lm_head_VH, predecessors_NS, ids_NSK, raw_NSK):
    """[NB, S, K] float32 scores of the draft slots' candidates given `predecessors_NS`; differentiable
    in the hidden states (through the unary term and the projection) and the selector's parameters."""
    cfg = model.config
    NB, S, K = ids_NSK.shape
    hidden_XH = hidden_NBH[:, 1:].reshape(NB * S, -1)
    raw_XK = _UnaryAtCandidates.apply(hidden_XH, raw_NSK.reshape(NB * S, K), ids_NSK.reshape(NB * S, K), lm_head_VH)
    fdt = torch.promote_types(raw_XK.dtype, torch.float32)
    unary_XK = transform_logits(raw_XK.to(fdt), cfg.output_multiplier, cfg.final_logit_softcapping)
    scores_XK = model.candidate_selector.edge_scores(
        unary_XK, ids_NSK.reshape(NB * S, K), predecessors_NS.reshape(NB * S), hidden_XH
    )
    return scores_XK.to(fdt).view(NB, S, K)


def selector_loss(model, hidden_NBH, lm_head_VH, blocks: TrainingBlocks, candidates: CandidateSet) -> torch.Tensor:
    """The weighted K-way cross-entropy of the module docstring (a scalar; 0 when no slot qualifies)."""
    ids_NSK, raw_NSK = candidates.ids_NBK[:, 1:], candidates.raw_NBK[:, 1:]
    scores_NSK = selector_scores(model, hidden_NBH, lm_head_VH, teacher_forced_predecessors(blocks), ids_NSK, raw_NSK)
    gold_NSK = ids_NSK == blocks.labels_NB[:, 1:, None]
    included_NS = blocks.label_valid_NB[:, 1:] & gold_NSK.any(-1)  # with "swap" every valid slot
    ce_NS = torch.logsumexp(scores_NSK, dim=-1) - (scores_NSK * gold_NSK).sum(-1)
    weights_NS = blocks.weights_NB[:, 1:].to(scores_NSK.dtype) * included_NS
    return (weights_NS * ce_NS).sum() / weights_NS.sum().clamp_min(1e-6)


def selector_ramp(step_t: torch.Tensor, warmup_steps: int) -> torch.Tensor:
    """The selector weight's factor at 0-based step `step_t` (a device tensor): (step+1)/warmup up to 1."""
    if warmup_steps <= 0:
        return torch.ones((), device=step_t.device)
    return ((step_t.float() + 1) / warmup_steps).clamp(max=1.0)
