"""Monitoring metrics of draft blocks, as (sum, count) device tensor pairs (no host sync).

They need a full pass over the vocabulary, so the loop calls `block_metrics` only every
metrics_every steps, under no_grad, chunk by chunk like the loss. Sums and counts are meant to be
SUM-all-reduced across ranks and divided at log time, which keeps averages exact.

Per slot k = 1..B-1 (index k-1 of the [B-1] vectors), over valid labels:
  top1_slot       argmax q_k == y_k
  topk_slot       y_k among the top-k of q_k (rank = number of strictly larger logits < k)
  ce_slot         -log q_k(y_k)
Per valid block:
  accept_streak   length of the prefix of slots with argmax == label (greedy chain acceptance,
                  without the +1 bonus token)
  topk_streak     length of the prefix with the label in the top-k (upper bound of tree acceptance)
  expected_accept sum_k prod_{j<=k} q_j(y_j): the drafter's expected accepted length (the CAP quantity)

Legend: NB blocks, B block size, C blocks in a chunk, H hidden, V vocab.
"""

from __future__ import annotations

import torch

from train.blocks import TrainingBlocks
from train.drafter.model import lm_head_weight

Counted = tuple[torch.Tensor, torch.Tensor]
_SLOT_NAMES = ("top1_slot", "topk_slot", "ce_slot")
_BLOCK_NAMES = ("accept_streak", "topk_streak", "expected_accept")
# DFlash 2's selector (train/metrics/selector_metrics.py and the selector loss): counted only with DFlash 2.
SELECTOR_NAMES = ("selector_loss", "selector_recall", "selector_accuracy", "selector_accept")


def metric_sizes(block_size: int) -> dict[str, int]:
    """Name -> elements of each metric `block_metrics` returns: B-1 per *_slot, 1 for the rest."""
    return {**{name: block_size - 1 for name in _SLOT_NAMES}, **{name: 1 for name in _BLOCK_NAMES + SELECTOR_NAMES}}


def accepted_prefix_length(ok_CS: torch.Tensor) -> torch.Tensor:
    """[C] length of the all-True prefix of each row: the greedy chain's accepted drafts when
    ok = (argmax == label) & valid (without the +1 bonus token of the target's own next token)."""
    return torch.cumprod(ok_CS.to(torch.int32), dim=1).sum(1)


@torch.no_grad()
def block_metrics(
    hidden_NBH: torch.Tensor, lm_head, blocks: TrainingBlocks, *, topk: int, chunk_blocks: int
) -> dict[str, Counted]:
    """(sum, count) float32 tensors per metric: [B-1] vectors for *_slot, scalars for the rest."""
    if topk < 1:
        raise ValueError(f"metrics topk must be >= 1, got {topk}")
    lm_head_VH = lm_head_weight(lm_head)
    NB, B, H = hidden_NBH.shape
    device = hidden_NBH.device
    f32 = dict(dtype=torch.float32, device=device)
    acc = {name: torch.zeros(B - 1, **f32) for name in _SLOT_NAMES}
    acc.update({name: torch.zeros((), **f32) for name in _BLOCK_NAMES})

    for start in range(0, NB, chunk_blocks):
        sl = slice(start, start + chunk_blocks)
        h_CBH = hidden_NBH[sl]
        C = h_CBH.shape[0]
        logits_CBV = (h_CBH.reshape(C * B, H) @ lm_head_VH.T).float().view(C, B, -1)
        labels_CB = blocks.labels_NB[sl]
        valid_CS = blocks.label_valid_NB[sl][:, 1:]  # slots 1..B-1
        label_logit_CB1 = logits_CBV.gather(2, labels_CB.unsqueeze(-1))
        logp_label_CB = label_logit_CB1.squeeze(-1) - torch.logsumexp(logits_CBV, dim=-1)
        top1_CS = (logits_CBV.argmax(-1) == labels_CB)[:, 1:] & valid_CS
        topk_CS = ((logits_CBV > label_logit_CB1).sum(-1) < topk)[:, 1:] & valid_CS
        valid_f_CS = valid_CS.float()

        acc["top1_slot"] += top1_CS.float().sum(0)
        acc["topk_slot"] += topk_CS.float().sum(0)
        acc["ce_slot"] += (-logp_label_CB[:, 1:] * valid_f_CS).sum(0)
        acc["accept_streak"] += accepted_prefix_length(top1_CS).float().sum()
        acc["topk_streak"] += accepted_prefix_length(topk_CS).float().sum()
        q_CS = torch.where(valid_CS, logp_label_CB[:, 1:].exp(), torch.zeros_like(valid_f_CS))
        acc["expected_accept"] += torch.cumprod(q_CS, dim=1).sum()

    slot_count_S = blocks.label_valid_NB[:, 1:].float().sum(0)
    block_count = blocks.block_valid_N.float().sum()
    return {name: (value, slot_count_S if name.endswith("_slot") else block_count) for name, value in acc.items()}
