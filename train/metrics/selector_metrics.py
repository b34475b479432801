"""DFlash 2's selector, monitored as (sum, count) device pairs (no host sync), like block_metrics:

  selector_recall     the gold token is among the slot's true top-K (candidate recall@K), per valid slot
  selector_accuracy   the selector's choice with the teacher-forced predecessor is the gold token, per
                      valid slot (a gold token outside the true top-K counts as missed)
  selector_accept     the self-conditioned path's accepted length: the greedy walk from the anchor with
                      its own previous choices, drafts matching the labels before the first miss, per
                      valid block (without the target's bonus token)
The loss itself (selector_loss) rides the same counter every step (train/step.py).

Legend: NB blocks, B block size, S = B-1 draft slots, K candidates, H hidden.
"""

from __future__ import annotations

import torch

from train.blocks import TrainingBlocks
from train.drafter.dflash2 import transform_logits
from train.loss.selector import CandidateSet, selector_scores, teacher_forced_predecessors
from train.metrics.block_metrics import Counted, accepted_prefix_length


@torch.no_grad()
def selector_metrics(
    model, hidden_NBH: torch.Tensor, lm_head_VH: torch.Tensor, blocks: TrainingBlocks, candidates: CandidateSet
) -> dict[str, Counted]:
    cfg = model.config
    ids_NBK, raw_NBK = candidates.serving()
    ids_NSK, raw_NSK = ids_NBK[:, 1:], raw_NBK[:, 1:]
    labels_NS, valid_NS = blocks.labels_NB[:, 1:], blocks.label_valid_NB[:, 1:]
    num_slots = valid_NS.sum().float()

    recall = (candidates.in_topk_NB[:, 1:] & valid_NS).sum().float()
    scores_NSK = selector_scores(model, hidden_NBH, lm_head_VH, teacher_forced_predecessors(blocks), ids_NSK, raw_NSK)
    choice_NS = ids_NSK.gather(-1, scores_NSK.argmax(-1, keepdim=True)).squeeze(-1)
    accuracy = ((choice_NS == labels_NS) & valid_NS).sum().float()

    unary_NSK = transform_logits(raw_NSK.float(), cfg.output_multiplier, cfg.final_logit_softcapping)
    path_NS = model.candidate_selector.greedy_path(unary_NSK, ids_NSK, hidden_NBH[:, 1:], blocks.block_ids_NB[:, 0])
    streak_N = accepted_prefix_length((path_NS == labels_NS) & valid_NS).float()
    accept = (streak_N * blocks.block_valid_N).sum()
    num_blocks = blocks.block_valid_N.sum().float()
    return {
        "selector_recall": (recall, num_slots),
        "selector_accuracy": (accuracy, num_slots),
        "selector_accept": (accept, num_blocks),
    }
