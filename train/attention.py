"""Block attention of DFlash training: each draft block sees its own sequence's context strictly
before its anchor, plus its whole block (bidirectional), never other blocks or other sequences.

Key layout (one packed batch): keys 0..T-1 are the T context tokens (fused target hidden states);
keys T + n*B .. T + n*B + B-1 are the B tokens of block n. Query row q belongs to block q // B.
Query of block n may attend key j iff
    seq_start[n] <= j < anchor[n]                 (context of its own sequence, before the anchor)
 or T + n*B <= j < T + (n+1)*B                    (its own block).
Blocks with weight 0 (padding) get seq_start == anchor: they see only their own block, so no
softmax row is ever empty.

Two backends behind `block_attention`:
  "sdpa": a dense [Q, L] boolean mask and torch SDPA; the reference, for CPU and tests.
  "flex": torch flex_attention with a BlockMask built analytically on device from the per-block
          ranges (tile flags from comparisons, indices from a sort): fixed shapes, no host syncs,
          its tensors updated in place so a CUDA graph can replay it and compile sees one object.

Legend: T context tokens, NB blocks, B block size, Q = NB*B query tokens, L = T + Q keys,
A query heads, M kv heads, D head dim.
"""
from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

Backend = Literal["sdpa", "flex"]
_compiled_flex = None


def choose_backend(requested: str, device: torch.device) -> Backend:
    """The block-attention backend: "auto" = flex on CUDA (tiled, no [Q, L] mask), sdpa elsewhere."""
    if requested == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if requested not in ("flex", "sdpa"):
        raise ValueError(f"--attention {requested}: must be auto, flex or sdpa")
    return requested


def block_mask_dense(seq_start_N: torch.Tensor, anchor_N: torch.Tensor, *, num_ctx: int,
                     block_size: int) -> torch.Tensor:
    """Boolean [Q, L] mask (True = may attend) of the block-attention rule above."""
    num_blocks = seq_start_N.shape[0]
    num_keys = num_ctx + num_blocks * block_size
    device = seq_start_N.device
    block_of_q_Q = torch.arange(num_blocks * block_size, device=device) // block_size
    key_L = torch.arange(num_keys, device=device)
    lo_Q1 = seq_start_N[block_of_q_Q].unsqueeze(1)
    hi_Q1 = anchor_N[block_of_q_Q].unsqueeze(1)
    in_context_QL = (key_L >= lo_Q1) & (key_L < hi_Q1)
    # Floor division makes context keys (key < T) negative, so they never match a block index.
    own_block_QL = torch.div(key_L - num_ctx, block_size, rounding_mode="floor") == block_of_q_Q.unsqueeze(1)
    return in_context_QL | own_block_QL


def _get_compiled_flex():
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
        log.info("attention: flex_attention compiled once (fixed shapes), block mask built analytically")
    return _compiled_flex


class BlockAttentionLayout:
    """The attention layout of one batch shape; built once, refreshed in place every step.

    update(seq_start_N, anchor_N) copies the new block ranges into persistent device tensors and
    rebuilds the mask from them, so every tensor the attention reads keeps its address (CUDA graphs)
    and the flex mask_mod keeps its identity (torch.compile does not recompile).
    """

    def __init__(self, *, num_ctx: int, num_blocks: int, block_size: int, backend: Backend = "sdpa",
                 device: torch.device | str = "cpu", tile_size: int = 128, compile_flex: bool = True):
        if backend not in ("sdpa", "flex"):
            raise ValueError(f"attention backend must be 'sdpa' or 'flex', got {backend!r}")
        if backend == "flex":
            if tile_size % block_size:
                raise ValueError(f"flex tile_size {tile_size} must be a multiple of block_size {block_size} "
                                 "(a query tile holds whole blocks)")
            if (num_blocks * block_size) % tile_size:
                raise ValueError(f"num_blocks ({num_blocks}) x block_size ({block_size}) must be a multiple of the "
                                 f"flex tile_size {tile_size}: use num_blocks a multiple of {tile_size // block_size}")
        self.num_ctx, self.num_blocks, self.block_size = num_ctx, num_blocks, block_size
        self.backend, self.tile_size, self.compile_flex = backend, tile_size, compile_flex
        self.num_queries = num_blocks * block_size
        self.num_keys = num_ctx + self.num_queries
        device = torch.device(device)
        self.seq_start_N = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        self.anchor_N = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        self.dense_mask_QL: torch.Tensor | None = None
        self.block_mask = None
        if backend == "flex":
            self._init_flex(device)

    # ---- flex: persistent BlockMask -------------------------------------------------------
    def _init_flex(self, device: torch.device) -> None:
        from torch.nn.attention.flex_attention import BlockMask
        num_q_tiles = self.num_queries // self.tile_size
        num_kv_tiles = -(-self.num_keys // self.tile_size)
        i32 = dict(dtype=torch.int32, device=device)
        self._kv = (torch.zeros(1, 1, num_q_tiles, **i32), torch.zeros(1, 1, num_q_tiles, num_kv_tiles, **i32))
        self._full_kv = (torch.zeros(1, 1, num_q_tiles, **i32), torch.zeros(1, 1, num_q_tiles, num_kv_tiles, **i32))
        self._q = (torch.zeros(1, 1, num_kv_tiles, **i32), torch.zeros(1, 1, num_kv_tiles, num_q_tiles, **i32))
        self._full_q = (torch.zeros(1, 1, num_kv_tiles, **i32), torch.zeros(1, 1, num_kv_tiles, num_q_tiles, **i32))
        seq_start_N, anchor_N = self.seq_start_N, self.anchor_N
        num_ctx, block_size = self.num_ctx, self.block_size

        def mask_mod(b, h, q_idx, kv_idx):
            n = q_idx // block_size
            in_context = (kv_idx >= seq_start_N[n]) & (kv_idx < anchor_N[n])
            own_block = (kv_idx >= num_ctx) & ((kv_idx - num_ctx) // block_size == n)
            return in_context | own_block

        self.mask_mod = mask_mod
        self.block_mask = BlockMask(
            (self.num_queries, self.num_keys), *self._kv, *self._full_kv, *self._q, *self._full_q,
            BLOCK_SIZE=(self.tile_size, self.tile_size), mask_mod=mask_mod)

    def _tile_flags(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(partial, full) tile flags [q tiles, kv tiles]: partial tiles need mask_mod, full ones do not."""
        tile, block_size, device = self.tile_size, self.block_size, self.seq_start_N.device
        num_kv_tiles = self._kv[1].shape[-1]
        tile_lo_J = torch.arange(num_kv_tiles, device=device) * tile
        tile_hi_J = tile_lo_J + tile  # unclipped: a ragged last tile is never "full"
        n_N = torch.arange(self.num_blocks, device=device)
        ranges = (  # per block: context [seq_start, anchor) and own block [T + nB, T + (n+1)B)
            (self.seq_start_N.long(), self.anchor_N.long()),
            (self.num_ctx + n_N * block_size, self.num_ctx + (n_N + 1) * block_size),
        )
        touch_NJ = torch.zeros(self.num_blocks, num_kv_tiles, dtype=torch.bool, device=device)
        cover_NJ = torch.zeros_like(touch_NJ)
        for lo_N, hi_N in ranges:
            lo_N1, hi_N1 = lo_N.unsqueeze(1), hi_N.unsqueeze(1)
            touch_NJ |= (lo_N1 < hi_N1) & (lo_N1 < tile_hi_J) & (hi_N1 > tile_lo_J)
            cover_NJ |= (lo_N1 <= tile_lo_J) & (hi_N1 >= tile_hi_J)
        blocks_per_tile = tile // block_size
        touch_IJ = touch_NJ.view(-1, blocks_per_tile, num_kv_tiles).any(1)  # [q tiles, kv tiles]
        full_IJ = cover_NJ.view(-1, blocks_per_tile, num_kv_tiles).all(1)
        return touch_IJ & ~full_IJ, full_IJ

    @staticmethod
    def _fill_ordered(flags_IJ: torch.Tensor, num_out: torch.Tensor, idx_out: torch.Tensor) -> None:
        """(count, indices) of the True columns of each row, sorted first; written in place."""
        num_out.copy_(flags_IJ.sum(-1).view_as(num_out))
        order_IJ = torch.argsort(flags_IJ.to(torch.int8), dim=-1, descending=True, stable=True)
        idx_out.copy_(order_IJ.view_as(idx_out))

    def update(self, seq_start_N: torch.Tensor, anchor_N: torch.Tensor) -> BlockAttentionLayout:
        """Load the block ranges of this step (int tensors [NB] on the layout's device)."""
        if seq_start_N.shape != (self.num_blocks,) or anchor_N.shape != (self.num_blocks,):
            raise ValueError(f"block ranges must have shape ({self.num_blocks},), got "
                             f"{tuple(seq_start_N.shape)} and {tuple(anchor_N.shape)}")
        self.seq_start_N.copy_(seq_start_N)
        self.anchor_N.copy_(anchor_N)
        if self.backend == "sdpa":
            self.dense_mask_QL = block_mask_dense(self.seq_start_N, self.anchor_N, num_ctx=self.num_ctx,
                                                  block_size=self.block_size)
            return self
        partial_IJ, full_IJ = self._tile_flags()
        self._fill_ordered(partial_IJ, *self._kv)
        self._fill_ordered(full_IJ, *self._full_kv)
        self._fill_ordered(partial_IJ.T, *self._q)
        self._fill_ordered(full_IJ.T, *self._full_q)
        return self


def block_attention(q_QAD: torch.Tensor, k_LMD: torch.Tensor, v_LMD: torch.Tensor,
                    layout: BlockAttentionLayout) -> torch.Tensor:
    """Softmax attention of the Q block queries over the L keys under the block rule; [Q, N, D]."""
    q_1AQD = q_QAD.transpose(0, 1).unsqueeze(0)
    k_1MLD = k_LMD.transpose(0, 1).unsqueeze(0)
    v_1MLD = v_LMD.transpose(0, 1).unsqueeze(0)
    if layout.backend == "sdpa":
        if layout.dense_mask_QL is None:
            raise RuntimeError("BlockAttentionLayout.update() must run before block_attention")
        out_1AQD = F.scaled_dot_product_attention(q_1AQD, k_1MLD, v_1MLD, attn_mask=layout.dense_mask_QL,
                                                  enable_gqa=True)
    else:
        from torch.nn.attention.flex_attention import flex_attention as flex
        # Inside a caller's torch.compile region dynamo compiles flex itself; otherwise use our one compile.
        if layout.compile_flex and not torch.compiler.is_compiling():
            flex = _get_compiled_flex()
        out_1AQD = flex(q_1AQD, k_1MLD, v_1MLD, block_mask=layout.block_mask, enable_gqa=True)
    return out_1AQD.squeeze(0).transpose(0, 1)


def full_attention(q_QAD: torch.Tensor, k_LMD: torch.Tensor, v_LMD: torch.Tensor) -> torch.Tensor:
    """Unmasked attention (inference: one block over its whole context and itself); [Q, N, D]."""
    out_1AQD = F.scaled_dot_product_attention(q_QAD.transpose(0, 1).unsqueeze(0), k_LMD.transpose(0, 1).unsqueeze(0),
                                              v_LMD.transpose(0, 1).unsqueeze(0), enable_gqa=True)
    return out_1AQD.squeeze(0).transpose(0, 1)
