"""Tiny packed batches and drafters shared by the drafter/loss/export tests (no tests here)."""

from __future__ import annotations

import torch

from train.blocks import TrainingBlocks, sample_blocks
from train.drafter.attention import BlockAttentionLayout
from train.drafter.config import QWEN36_27B_TARGET, DrafterConfig  # noqa: F401  (QWEN36_27B_TARGET: for the tests)
from train.drafter.model import DFlashDrafter, TargetHead

VOCAB = 97
MASK_ID = 96


def drafter_for_target(hidden_size: int, intermediate_size: int, vocab_size: int, **changes) -> DrafterConfig:
    """DrafterConfig.for_target for a target shaped like the synthetic caches': 8 layers, taps 1, 3, 5 and
    the last token id as MASK; `changes` are for_target's own (num_layers, block_size, ...)."""
    target = dict(num_target_layers=8, tap_layer_ids=[1, 3, 5], mask_token_id=vocab_size - 1)
    return DrafterConfig.for_target(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        **{**target, **changes},
    )


def tiny_config(**changes) -> DrafterConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        block_size=4,
        mask_token_id=MASK_ID,
        tap_layer_ids=[0, 2, 3],
        num_target_layers=4,
        vocab_size=VOCAB,
    )
    base.update(changes)
    return DrafterConfig(**base)


def make_batch(
    seq_lens: list[int],
    token_budget: int,
    max_seqs: int,
    num_taps: int,
    hidden: int,
    seed: int = 0,
    unsupervised: tuple[int, ...] = (),
) -> dict[str, torch.Tensor]:
    """A packed batch shaped like one cache shard. The first 2 tokens of each sequence (a 'prompt') and
    the packed indices in `unsupervised` have loss_mask 0; padding is zero."""
    g = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    assert total <= token_budget and len(seq_lens) <= max_seqs
    input_ids = torch.zeros(token_budget, dtype=torch.int32)
    input_ids[:total] = torch.randint(0, VOCAB - 1, (total,), generator=g, dtype=torch.int32)
    position_ids = torch.zeros(token_budget, dtype=torch.int32)
    loss_mask = torch.zeros(token_budget, dtype=torch.uint8)
    cu = [0]
    for n in seq_lens:
        s = cu[-1]
        position_ids[s : s + n] = torch.arange(n, dtype=torch.int32)
        loss_mask[s + 2 : s + n] = 1
        cu.append(s + n)
    for t in unsupervised:
        loss_mask[t] = 0
    cu += [total] * (max_seqs + 1 - len(cu))
    hidden_TKH = torch.zeros(token_budget, num_taps, hidden)
    hidden_TKH[:total] = torch.randn(total, num_taps, hidden, generator=g)
    return dict(
        input_ids_T=input_ids,
        position_ids_T=position_ids,
        loss_mask_T=loss_mask,
        cu_seqlens_S1=torch.tensor(cu, dtype=torch.int32),
        hidden_TKH=hidden_TKH,
    )


def tiny_model_and_head(cfg: DrafterConfig, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg).to(dtype)
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm cannot pass unnoticed
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    g = torch.Generator().manual_seed(seed + 1)
    head = TargetHead(
        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=dtype),
        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=dtype) * 0.3,
    )
    return model, head


def batch_blocks(batch: dict, **kwargs) -> TrainingBlocks:
    """sample_blocks over a make_batch() batch; kwargs are sample_blocks' own (num_blocks, ...)."""
    return sample_blocks(
        input_ids_T=batch["input_ids_T"],
        position_ids_T=batch["position_ids_T"],
        loss_mask_T=batch["loss_mask_T"],
        cu_seqlens_S1=batch["cu_seqlens_S1"],
        **kwargs,
    )


def random_ranges(num_ctx: int, num_blocks: int, seed: int):
    """Sorted anchors over random sequences; about one block in five is padding (seq_start == anchor)."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(set(torch.randint(1, num_ctx, (4,), generator=g).tolist()))
    bounds = [0] + cuts + [num_ctx]
    anchor = torch.sort(torch.randperm(num_ctx, generator=g)[:num_blocks]).values
    seq_start = torch.tensor([max(b for b in bounds if b <= a) for a in anchor.tolist()])
    pad = torch.rand(num_blocks, generator=g) < 0.2
    return torch.where(pad, anchor, seq_start).int(), anchor.int()


def ranges_at_sequence_starts(num_ctx, num_blocks, seed):
    """Like random_ranges, but half of the anchors sit exactly at a sequence start (empty context)."""
    seq_start, anchor = random_ranges(num_ctx, num_blocks, seed)
    starts = sorted(set(seq_start.tolist()) | {0})
    for n in range(0, num_blocks, 2):
        anchor[n] = seq_start[n] = starts[n % len(starts)]
    order = torch.argsort(anchor, stable=True)
    return seq_start[order].int(), anchor[order].int()


def blocks_and_layout(cfg, batch, num_blocks):
    """Seeded blocks over a 48-token batch and the dense attention layout they imply."""
    blocks = batch_blocks(
        batch,
        num_blocks=num_blocks,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    layout = BlockAttentionLayout.for_drafter(cfg, num_ctx=48, num_blocks=num_blocks)
    return blocks, layout.update(blocks.seq_start_N, blocks.anchor_N)


def forward_blocks(model, head, batch: dict, blocks: TrainingBlocks, layout, **kwargs):
    """The training forward of `model` over a make_batch() batch and its blocks; kwargs are forward's own."""
    return model(
        batch["hidden_TKH"],
        batch["position_ids_T"],
        head.embed(blocks.block_ids_NB),
        blocks.block_pos_NB,
        layout,
        **kwargs,
    )
