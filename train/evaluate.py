"""Held-out evaluation of a drafter: chain acceptance, per-slot accuracy, DDTree tree acceptance.

For each held-out shard, blocks are sampled exactly as in training but with a fixed seed per
batch id on the CPU (the same anchors on any device and any number of ranks). Per valid block,
with labels y_1..y_{B-1} (the data's tokens after the anchor) and drafter log-probs q_k:
  chain acceptance   accepted = length of the prefix of slots k = 1..B-1 with argmax q_k == y_k
                     (and y_k a valid label); acceptance length = accepted + 1 (the bonus token).
  slot accuracy      P(argmax q_k == y_k) over valid labels, per slot k.
  tree acceptance    DDTree (Ringel & Romano): keep the top-`budget` tokens of each depth; grow a
                     tree best-first from a heap keyed by the path's summed log-prob, where popping
                     node (depth d, rank r) adds it and pushes its next sibling (d, r+1) and first
                     child (d+1, 0), until `budget` nodes; then walk the label path from the root
                     while the next label is a child in the tree. acceptance = depth reached + 1.
Sums and counts (train/sums.py) are all-reduced across ranks before dividing.

Legend: T token budget, K taps, H hidden, NB blocks, B block size, S = B-1 draft slots, V vocab.
"""
from __future__ import annotations

import heapq
from contextlib import nullcontext
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from shards import ShardReader, decode_hidden

from .attention import BlockAttentionLayout
from .blocks import sample_blocks
from .metrics_math import accepted_prefix_length
from .model import DFlashDrafter, TargetHead
from .sums import COUNT, Sums

log = logging.getLogger(__name__)

DEFAULT_BUDGETS = (16, 32, 64)


@dataclass
class EvalResult:
    num_blocks: int  # valid blocks evaluated
    acceptance_length: float  # mean chain acceptance length, +1 bonus included
    slot_accuracy: list[float]  # top-1 accuracy of slots 1..B-1
    tree_acceptance: dict[int, float]  # node budget -> mean tree acceptance length (+1)
    batch_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"eval/num_blocks": self.num_blocks, "eval/acceptance_length": self.acceptance_length,
                **{f"eval/acc_slot_{k:02d}": a for k, a in enumerate(self.slot_accuracy, start=1)},
                **{f"eval/tree_acceptance_{b}": v for b, v in self.tree_acceptance.items()},
                "eval/batch_ids": self.batch_ids}

    def summary_line(self) -> str:
        trees = " ".join(f"tree@{b} {v:.3f}" for b, v in self.tree_acceptance.items())
        return f"acceptance length {self.acceptance_length:.3f} ({self.num_blocks} blocks) {trees}"

    def table(self) -> str:
        lines = [f"{'metric':<28}{'value':>10}", "-" * 38,
                 f"{'blocks':<28}{self.num_blocks:>10}",
                 f"{'acceptance length (chain)':<28}{self.acceptance_length:>10.3f}"]
        lines += [f"{f'tree acceptance @{b}':<28}{v:>10.3f}" for b, v in self.tree_acceptance.items()]
        lines += [f"{f'accuracy slot {k}':<28}{a:>10.3f}" for k, a in enumerate(self.slot_accuracy, start=1)]
        return "\n".join(lines)


def tree_acceptance(logp_SR: Sequence[Sequence[float]], ids_SR: Sequence[Sequence[int]],
                    labels_S: Sequence[int], valid_S: Sequence[bool], budget: int) -> int:
    """DDTree acceptance length (+1) of one block: S depths, each with its top-R tokens (R >= budget
    or the vocabulary) sorted by log-prob descending."""
    num_depths, num_ranks = len(logp_SR), len(logp_SR[0])
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    # Heap entries: (-score, tie, depth, rank, parent node). Node 0 is the root (the anchor).
    heap = [(-logp_SR[0][0], 0, 0, 0, 0)]
    tie = 1
    while heap and len(children) < budget:
        neg, _, d, r, parent = heapq.heappop(heap)
        node = len(children) + 1
        children[(parent, ids_SR[d][r])] = node
        if r + 1 < num_ranks:  # next sibling: same parent, next-ranked token at this depth
            heapq.heappush(heap, (neg + logp_SR[d][r] - logp_SR[d][r + 1], tie, d, r + 1, parent))
            tie += 1
        if d + 1 < num_depths:  # first child: best token one depth deeper
            heapq.heappush(heap, (neg - logp_SR[d + 1][0], tie, d + 1, 0, node))
            tie += 1
    node, depth = 0, 0
    while depth < num_depths and valid_S[depth] and (node, labels_S[depth]) in children:
        node = children[(node, labels_S[depth])]
        depth += 1
    return depth + 1


@torch.no_grad()
def evaluate_drafter(model: DFlashDrafter, head: TargetHead, cache_dir: str, batch_ids: list[int], *,
                     num_blocks: int, seed: int = 0, device: torch.device | str = "cpu",
                     autocast_dtype: torch.dtype | None = None, attention: str = "sdpa", chunk_blocks: int = 32,
                     budgets: Sequence[int] = DEFAULT_BUDGETS, rank: int = 0, world_size: int = 1) -> EvalResult:
    """Evaluate on `batch_ids` (this rank takes every world_size-th); every rank gets the same result."""
    device = torch.device(device)
    cfg = model.config
    reader = ShardReader(cache_dir)
    cc = reader.config
    B, S = cfg.block_size, cfg.block_size - 1
    budgets = sorted(set(int(b) for b in budgets))
    layout = BlockAttentionLayout(num_ctx=cc.token_budget, num_blocks=num_blocks, block_size=B,
                                  backend=attention, device=device)
    sums = Sums({"blocks": 1, "accepted": 1, "slot_correct": S, "slot_correct" + COUNT: S,
                 **{f"tree@{b}": 1 for b in budgets}}, device)  # accepted and tree@b are divided by blocks
    for batch_id in batch_ids[rank::world_size]:
        tensors, _ = reader.read(batch_id, verify_checksum=True)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + batch_id)
        blocks = sample_blocks(input_ids_T=tensors["input_ids"], position_ids_T=tensors["position_ids"],
                               loss_mask_T=tensors["loss_mask"], cu_seqlens_S1=tensors["cu_seqlens"],
                               num_blocks=num_blocks, block_size=B, mask_token_id=cfg.mask_token_id, generator=gen)
        blocks_dev = type(blocks)(**{k: v.to(device) for k, v in vars(blocks).items()})
        hidden_TKH = decode_hidden(tensors["hidden"], tensors.get("hidden_scale")).to(device, head.embed_tokens_VH.dtype)
        layout.update(blocks_dev.seq_start_N, blocks_dev.anchor_N)
        ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
        with ctx:
            block_embed_NBH = head.embed(blocks_dev.block_ids_NB)
            hidden_NBH = model(hidden_TKH, tensors["position_ids"].to(device), block_embed_NBH,
                               blocks_dev.block_pos_NB, layout)
            _score_blocks(sums, hidden_NBH, head, blocks_dev, budgets, chunk_blocks)
    host = sums.reduce_to_host()
    blocks_n = host.scalar("blocks")
    return EvalResult(
        num_blocks=int(blocks_n),
        acceptance_length=_or_nan(host.mean("accepted", "blocks")[0]),
        slot_accuracy=[_or_nan(a) for a in host.mean("slot_correct")],
        tree_acceptance={b: _or_nan(host.mean(f"tree@{b}", "blocks")[0]) for b in budgets},
        batch_ids=list(batch_ids))


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _score_blocks(sums: Sums, hidden_NBH: torch.Tensor, head: TargetHead, blocks, budgets: list[int],
                  chunk_blocks: int) -> None:
    NB, B, H = hidden_NBH.shape
    max_budget = min(max(budgets), head.lm_head_VH.shape[0])
    for start in range(0, NB, chunk_blocks):
        sl = slice(start, start + chunk_blocks)
        C = hidden_NBH[sl].shape[0]
        logits_CSV = (hidden_NBH[sl].reshape(C * B, H) @ head.lm_head_VH.T).float().view(C, B, -1)[:, 1:]
        logp_CSV = torch.log_softmax(logits_CSV, dim=-1)
        labels_CS = blocks.labels_NB[sl][:, 1:]
        valid_CS = blocks.label_valid_NB[sl][:, 1:]
        block_valid_C = blocks.block_valid_N[sl]
        correct_CS = (logp_CSV.argmax(-1) == labels_CS) & valid_CS
        sums.add("blocks", block_valid_C.sum())
        sums.add("accepted", ((accepted_prefix_length(correct_CS) + 1) * block_valid_C).sum())
        sums.add("slot_correct", correct_CS.sum(0))
        sums.add("slot_correct" + COUNT, valid_CS.sum(0))
        top_logp_CSR, top_ids_CSR = logp_CSV.topk(max_budget, dim=-1)
        top_logp, top_ids = top_logp_CSR.cpu().tolist(), top_ids_CSR.cpu().tolist()
        labels, valid, bvalid = labels_CS.cpu().tolist(), valid_CS.cpu().tolist(), block_valid_C.cpu().tolist()
        tree_sum = {budget: 0 for budget in budgets}
        for c in range(C):
            if not bvalid[c]:
                continue
            for budget in budgets:
                r = min(budget, max_budget)
                lp = [row[:r] for row in top_logp[c]]
                ids = [row[:r] for row in top_ids[c]]
                tree_sum[budget] += tree_acceptance(lp, ids, labels[c], valid[c], budget)
        for budget, total in tree_sum.items():
            sums.add(f"tree@{budget}", float(total))
