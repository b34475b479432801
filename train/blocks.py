"""Training blocks: sample a fixed number of anchors in a packed batch and build the draft blocks,
their labels, loss weights and the per-block attention ranges.

Anchor rule (SpecForge's; one definition for both stages, shards/anchors.py): position t is a valid
anchor iff loss_mask[t] == 1 and token t+1 is in the same sequence with loss_mask[t+1] == 1. NB
anchors are drawn uniformly without replacement among valid positions as the top-NB of i.i.d.
uniform keys (invalid positions get key -1): no nonzero, no randperm, fixed shapes. With fewer than NB valid positions the surplus blocks have weight 0.
A piece of a long sample (shards/format.py) allows anchors only in its own part (anchor_mask): its
context and label tail belong to its neighbours, so each position is an anchor candidate once, with the
window before it and the labels after it inside the piece, and its positions are the sample's own.

Block n = [token at anchor, MASK x (B-1)] at positions pos(anchor)+0..B-1. Slot k >= 1 is trained
to predict the token at anchor+k (same-position labels), with weight
    loss_mask[anchor+k] * exp(-(k-1)/gamma) * [anchor+k in the same sequence] * block_valid.

Legend: T packed tokens, S sequences (cu_seqlens has S+1 entries), NB blocks, B block size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shards.anchors import sequence_bounds, valid_anchors
from train.loss.config import LossConfig


@dataclass
class TrainingBlocks:
    """Everything the forward, the losses and the metrics need about one batch's NB blocks."""

    block_ids_NB: torch.Tensor  # [NB, B] int64: anchor token, then mask_token_id
    block_pos_NB: torch.Tensor  # [NB, B] int64: RoPE positions pos(anchor)+k
    labels_NB: torch.Tensor  # [NB, B] int64: token at anchor+k (clamped inside the batch where invalid)
    label_valid_NB: torch.Tensor  # [NB, B] bool: k >= 1, anchor+k in the sequence, supervised, block valid
    weights_NB: torch.Tensor  # [NB, B] float32: label_valid * exp(-(k-1)/gamma)
    prev_index_NB: torch.Tensor  # [NB, B] int64: packed index anchor+k-1 (the target's prediction of slot k)
    anchor_N: torch.Tensor  # [NB] int32: packed index of the anchor
    seq_start_N: torch.Tensor  # [NB] int32: first visible context index (== anchor_N for invalid blocks)
    block_valid_N: torch.Tensor  # [NB] bool

    @property
    def num_blocks(self) -> int:
        return self.block_ids_NB.shape[0]

    @property
    def block_size(self) -> int:
        return self.block_ids_NB.shape[1]


def decay_weights(block_size: int, gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B] float32: 0 at the anchor slot, exp(-(k-1)/gamma) for slots k >= 1 (DFlash paper Eq. 4)."""
    if not gamma > 0:
        raise ValueError(f"loss decay gamma must be > 0, got {gamma}")
    k_B = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k_B >= 1, torch.exp(-(k_B - 1) / gamma), torch.zeros_like(k_B))


_SEED_STRIDE = 1_000_003  # a prime: seeds of different batches and ranks never coincide for small seeds


def anchor_seed(seed: int, *, batch_id: int | None = None, rank: int | None = None) -> int:
    """Seed of one anchor-sampling generator. Held-out batch `batch_id`: seed * stride + batch_id
    (evaluation draws the same anchors on any device and any number of ranks). Training rank `rank`:
    seed + stride * (rank + 1) (ranks draw different anchors). Give exactly one of batch_id and rank."""
    if (batch_id is None) == (rank is None):
        raise ValueError(f"anchor_seed needs exactly one of batch_id and rank, got batch_id={batch_id}, rank={rank}")
    if batch_id is not None:
        return seed * _SEED_STRIDE + batch_id
    return seed + _SEED_STRIDE * (rank + 1)


def sample_blocks(
    *,
    input_ids_T: torch.Tensor,
    position_ids_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    cu_seqlens_S1: torch.Tensor,
    num_blocks: int,
    block_size: int,
    mask_token_id: int,
    gamma: float = LossConfig.gamma,
    generator: torch.Generator | None = None,
    anchor_mask_T: torch.Tensor | None = None,
) -> TrainingBlocks:
    """Sample NB anchors and build the blocks. Fixed output shapes, no host syncs.

    generator: drawn from for the anchor keys (must live on the batch's device); for CUDA-graph capture
    use the default CUDA generator or one registered with the graph.
    anchor_mask_T: the shard's anchor_mask (a piece's own part); None = a version 2 shard: every token.
    """
    num_tokens = input_ids_T.shape[0]
    if not 1 <= num_blocks <= num_tokens:
        raise ValueError(f"num_blocks must be in [1, token_budget={num_tokens}], got {num_blocks}")
    device = input_ids_T.device
    start_T, end_T = sequence_bounds(cu_seqlens_S1, num_tokens)
    valid_T = valid_anchors(loss_mask_T, cu_seqlens_S1)
    if anchor_mask_T is not None:
        valid_T = valid_T & anchor_mask_T.bool()

    # Uniform subset without replacement: top-NB of i.i.d. U[0,1) keys; invalid positions rank last.
    keys_T = torch.rand(num_tokens, generator=generator, device=device)
    keys_T = torch.where(valid_T, keys_T, torch.full_like(keys_T, -1.0))
    picked_N = torch.topk(keys_T, num_blocks, sorted=False).indices
    anchor_N = torch.sort(picked_N).values  # position order keeps each flex tile's context ranges tight
    block_valid_N = valid_T[anchor_N]

    k_B = torch.arange(block_size, device=device)
    index_NB = anchor_N.unsqueeze(1) + k_B  # packed index of slot k's label
    index_clamped_NB = index_NB.clamp(max=num_tokens - 1)
    in_sequence_NB = index_NB < end_T[anchor_N].unsqueeze(1).long()
    label_valid_NB = in_sequence_NB & loss_mask_T.bool()[index_clamped_NB] & (k_B >= 1) & block_valid_N.unsqueeze(1)
    weights_NB = label_valid_NB.float() * decay_weights(block_size, gamma, device)

    anchor_tokens_N1 = input_ids_T[anchor_N].long().unsqueeze(1)
    block_ids_NB = torch.where(k_B == 0, anchor_tokens_N1, torch.full_like(anchor_tokens_N1, mask_token_id))
    block_pos_NB = position_ids_T[anchor_N].long().unsqueeze(1) + k_B
    seq_start_N = torch.where(block_valid_N, start_T[anchor_N].long(), anchor_N)

    return TrainingBlocks(
        block_ids_NB=block_ids_NB,
        block_pos_NB=block_pos_NB,
        labels_NB=input_ids_T[index_clamped_NB].long(),
        label_valid_NB=label_valid_NB,
        weights_NB=weights_NB,
        prev_index_NB=(index_NB - 1).clamp(0, num_tokens - 1),
        anchor_N=anchor_N.to(torch.int32),
        seq_start_N=seq_start_N.to(torch.int32),
        block_valid_N=block_valid_N,
    )


def sample_shard_blocks(tensors: dict[str, torch.Tensor], **options) -> TrainingBlocks:
    """sample_blocks over one shard as ShardReader.read returns it (input_ids, position_ids, loss_mask,
    cu_seqlens, anchor_mask when the cache has it); options are sample_blocks' own (num_blocks, block_size, mask_token_id, gamma, generator)."""
    return sample_blocks(
        input_ids_T=tensors["input_ids"],
        position_ids_T=tensors["position_ids"],
        loss_mask_T=tensors["loss_mask"],
        cu_seqlens_S1=tensors["cu_seqlens"],
        anchor_mask_T=tensors.get("anchor_mask"),
        **options,
    )


def default_num_blocks(
    token_budget: int, block_size: int, tile_size: int = 128, anchors_per_token: float = 1 / 24
) -> int:
    """One anchor per 24 context tokens (2048 blocks, 32K query tokens at the 49152 budget), rounded
    down to whole flex query tiles so the fast attention path accepts it.

    SpecForge's density (512 anchors per 3072 tokens, 8192 blocks here) and half of it run out of
    memory for the 27B-width drafter on one H200; 2048 blocks peak at 117 GiB there (BENCHMARKS.md).
    """
    blocks_per_tile = max(1, tile_size // block_size)
    raw = int(math.floor(token_budget * anchors_per_token))
    return max(blocks_per_tile, raw // blocks_per_tile * blocks_per_tile)
