"""Block attention of DFlash training: each draft block sees its own sequence's context strictly
before its anchor, plus its own block, never other blocks or other sequences; full layers and
sliding-window layers differ in how much of both they see.

Key layout (one packed batch): keys 0..T-1 are the T context tokens (fused target hidden states);
keys T + n*B .. T + n*B + B-1 are the B tokens of block n. Query row q is slot k = q % B of block
n = q // B, at position pos(anchor[n]) + k. Query (n, k) may attend key j iff

  full layer (full_attention):
      seq_start[n] <= j < anchor[n]                     context of its own sequence, before the anchor
   or T + n*B <= j < T + (n+1)*B                        its whole block (bidirectional)
  sliding layer (sliding_attention, window W):
      max(seq_start[n], anchor[n] + k - (W-1)) <= j < anchor[n]
   or j = T + n*B + s with s <= k and k - s <= W-1      its block, causal, inside the window
  bidirectional sliding layer (sliding_attention under config.json is_causal false, window W):
      max(seq_start[n], anchor[n] + k - (W-1)) <= j < anchor[n]
   or j = T + n*B + s with |k - s| <= W-1               its block both ways, inside the window

Blocks with weight 0 (padding) get seq_start == anchor: they see only their own block, so no
softmax row is ever empty (slot k always sees itself). Packed indices measure distance in positions
because positions run contiguously inside a sequence.

What the serving engines do today (read from their newest loaders, December 2026), which the rule above
follows:
- vLLM qwen3_dflash.py: a layer is causal iff layer_types[i] == "sliding_attention" (unless is_causal
  or dflash_config.causal override it); a sliding layer's window is dflash_config.swa_window_size or
  sliding_window, passed as vLLM's per-layer sliding window (the query and W-1 keys before it).
- SGLang models/dflash.py + dflash_utils.py: full_attention runs as ENCODER_ONLY (non-causal),
  sliding_attention as DECODER (causal) with window_left = sliding_window - 1.
So a sliding query at position p sees every key at positions [p - (W-1), p], context and block alike.
- SpecForge's training mask (create_dflash_block_mask / create_dflash_sdpa_mask) has the same context
  bound (anchor + k - (W-1)) and causal block keys, but does not clip block keys by the window. The two
  differ only when W < block_size; we follow the engines, which is what serving runs.
- z-lab's HF reference as released (the `dflash` 0.1.0 package, dflash/model.py: Qwen3DFlashAttention and
  _attention_mask) makes a sliding layer causal unless is_causal says otherwise and windows it the same
  way, the context included; tests/train/checkpoint/test_zlab_reference.py runs it against this rule.
- llama.cpp runs every draft layer non-causally and its converter drops the window: a drafter with
  sliding layers is for vLLM and SGLang only (`dflash-train export` says so).
- Published DFlash 2 configs (Muse-Glimmer-30B, SpecForge's Qwen3.6-27B layout) set a top-level
  is_causal false over all-sliding layers. z-lab's reference (_attention_mask, DFlash 2 era) then keeps
  |query position - key position| < W and drops the causal bound, and vLLM (_dflash_layer_causal: top-level
  is_causal first, PR #52816) runs such a layer as a non-causal one with the same per-layer window: the
  block is attended both ways, the context (all of it behind the query) through the same window as a
  causal sliding layer. DrafterConfig.sliding_causal says which a drafter's sliding layers are.

Two backends behind `block_attention`:
  "sdpa": a dense [Q, L] boolean mask and torch SDPA; the reference, for CPU and tests.
  "flex": torch flex_attention with a BlockMask built analytically on device from the per-block
          ranges (tile flags from comparisons, indices from a sort): fixed shapes, no host syncs,
          its tensors updated in place so a CUDA graph can replay it and compile sees one object.
          A sliding layer's BlockMask lists only the kv tiles its window touches, so its cost per
          query is bounded by W instead of the sequence length.

Legend: T context tokens, NB blocks, B block size, Q = NB*B query tokens, L = T + Q keys,
A query heads, M kv heads, D head dim, W sliding window (tokens, the query included).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from train.drafter.config import DrafterConfig

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


def block_mask_dense(
    seq_start_N: torch.Tensor,
    anchor_N: torch.Tensor,
    *,
    num_ctx: int,
    block_size: int,
    sliding_window: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Boolean [Q, L] mask (True = may attend) of the block-attention rule above.

    sliding_window: None = a full layer's mask; W = a sliding layer's (window W; its block causal, or
    both ways when causal is False)."""
    num_blocks = seq_start_N.shape[0]
    num_keys = num_ctx + num_blocks * block_size
    device = seq_start_N.device
    q_Q = torch.arange(num_blocks * block_size, device=device)
    block_of_q_Q, slot_of_q_Q1 = q_Q // block_size, (q_Q % block_size).unsqueeze(1)
    key_L = torch.arange(num_keys, device=device)
    lo_Q1 = seq_start_N[block_of_q_Q].long().unsqueeze(1)
    hi_Q1 = anchor_N[block_of_q_Q].long().unsqueeze(1)
    if sliding_window is not None:
        lo_Q1 = torch.maximum(lo_Q1, hi_Q1 + slot_of_q_Q1 - (sliding_window - 1))
    in_context_QL = (key_L >= lo_Q1) & (key_L < hi_Q1)
    # Floor division makes context keys (key < T) negative, so they never match a block index.
    key_block_L = torch.div(key_L - num_ctx, block_size, rounding_mode="floor")
    own_block_QL = key_block_L == block_of_q_Q.unsqueeze(1)
    if sliding_window is not None:
        behind_QL = slot_of_q_Q1 - (key_L - num_ctx) % block_size  # slots from the key up to the query
        own_block_QL &= (behind_QL >= (0 if causal else 1 - sliding_window)) & (behind_QL <= sliding_window - 1)
    return in_context_QL | own_block_QL


# Each distinct (shape, dtype, grad mode, autocast, mask_mod code) the compiled flex sees is one more
# dynamo cache entry of flex_attention's frame (dynamic=False). One training process compiles the
# training masks (full + sliding) and the evaluations' (random anchors, walk, tree budgets; each under
# grad and no-grad): more than dynamo's default of 8, after which dynamo SILENTLY runs flex eagerly
# (the [Q, L] math path: OOM or ~10x slower at 27B, and it breaks CUDA graph capture). Seen in the
# H200 GPU run (December 2026): "hit config.recompile_limit (8)" then capture failed. So the compiled
# flex runs with a higher limit and fails loudly if even that is hit.
FLEX_RECOMPILE_LIMIT = 64


def flex_dynamo_config() -> dict:
    """The dynamo config keys (present in this torch) patched around every compiled-flex call."""
    from torch._dynamo import config as dynamo_config

    options = {}
    for name in ("recompile_limit", "cache_size_limit"):  # cache_size_limit: the older alias
        if hasattr(dynamo_config, name):
            options[name] = max(FLEX_RECOMPILE_LIMIT, getattr(dynamo_config, name))
            break
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        options["fail_on_recompile_limit_hit"] = True
    return options


def with_raised_recompile_limit(compiled):
    """`compiled` called under flex_dynamo_config: every compiled function of the step (flex, the pointwise
    regions, the FP8 head's casts) shares its code object's cache across models and shapes in a process."""
    options = flex_dynamo_config()

    def call(*args, **kwargs):
        with torch._dynamo.config.patch(**options):
            return compiled(*args, **kwargs)

    return call


def _get_compiled_flex():
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = with_raised_recompile_limit(torch.compile(flex_attention, dynamic=False))
        log.info("attention: flex_attention compiled once (fixed shapes), block mask built analytically")
    return _compiled_flex


class _FlexMask:
    """One persistent flex BlockMask (full or sliding) over the layout's shared block ranges."""

    def __init__(self, layout: BlockAttentionLayout, sliding_window: int | None, device: torch.device):
        from torch.nn.attention.flex_attention import BlockMask

        self.sliding_window, self.causal = sliding_window, layout.sliding_causal
        num_q_tiles = layout.num_queries // layout.tile_size
        num_kv_tiles = -(-layout.num_keys // layout.tile_size)
        i32 = dict(dtype=torch.int32, device=device)
        self.kv = (torch.zeros(1, 1, num_q_tiles, **i32), torch.zeros(1, 1, num_q_tiles, num_kv_tiles, **i32))
        self.full_kv = (torch.zeros(1, 1, num_q_tiles, **i32), torch.zeros(1, 1, num_q_tiles, num_kv_tiles, **i32))
        self.q = (torch.zeros(1, 1, num_kv_tiles, **i32), torch.zeros(1, 1, num_kv_tiles, num_q_tiles, **i32))
        self.full_q = (torch.zeros(1, 1, num_kv_tiles, **i32), torch.zeros(1, 1, num_kv_tiles, num_q_tiles, **i32))
        seq_start_N, anchor_N = layout.seq_start_N, layout.anchor_N
        num_ctx, block_size = layout.num_ctx, layout.block_size

        if sliding_window is None:

            def mask_mod(b, h, q_idx, kv_idx):
                n = q_idx // block_size
                in_context = (kv_idx >= seq_start_N[n]) & (kv_idx < anchor_N[n])
                own_block = (kv_idx >= num_ctx) & ((kv_idx - num_ctx) // block_size == n)
                return in_context | own_block
        else:
            window = sliding_window
            nearest = 0 if layout.sliding_causal else 1 - window  # the furthest-ahead block key, in slots behind

            def mask_mod(b, h, q_idx, kv_idx):
                n, k = q_idx // block_size, q_idx % block_size
                in_context = (
                    (kv_idx >= seq_start_N[n]) & (kv_idx >= anchor_N[n] + k - (window - 1)) & (kv_idx < anchor_N[n])
                )
                behind = k - (kv_idx - num_ctx) % block_size
                own_block = (
                    (kv_idx >= num_ctx)
                    & ((kv_idx - num_ctx) // block_size == n)
                    & (behind >= nearest)
                    & (behind <= window - 1)
                )
                return in_context | own_block

        self.mask_mod = mask_mod
        self.block_mask = BlockMask(
            (layout.num_queries, layout.num_keys),
            *self.kv,
            *self.full_kv,
            *self.q,
            *self.full_q,
            BLOCK_SIZE=(layout.tile_size, layout.tile_size),
            mask_mod=mask_mod,
        )

    def refresh(self, layout: BlockAttentionLayout) -> None:
        partial_IJ, full_IJ = _tile_flags(layout, self.sliding_window, self.causal, self.kv[1].shape[-1])
        _fill_ordered(partial_IJ, *self.kv)
        _fill_ordered(full_IJ, *self.full_kv)
        _fill_ordered(partial_IJ.T, *self.q)
        _fill_ordered(full_IJ.T, *self.full_q)


def _tile_flags(
    layout: BlockAttentionLayout, sliding_window: int | None, causal: bool, num_kv_tiles: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) tile flags [q tiles, kv tiles]: partial tiles need mask_mod, full ones do not.

    Per block, a kv tile is touched if some query of the block sees one of its keys, covered if every
    query of the block sees all of them; a q tile (whole blocks) then ORs touches and ANDs covers."""
    tile, block_size, device = layout.tile_size, layout.block_size, layout.seq_start_N.device
    tile_lo_J = torch.arange(num_kv_tiles, device=device) * tile
    tile_hi_J = tile_lo_J + tile  # unclipped: a ragged last tile is never "full"
    n_N = torch.arange(layout.num_blocks, device=device)
    seq_start_N, anchor_N = layout.seq_start_N.long(), layout.anchor_N.long()
    own_lo_N, own_hi_N = layout.num_ctx + n_N * block_size, layout.num_ctx + (n_N + 1) * block_size
    if sliding_window is None:
        touch_ranges = ((seq_start_N, anchor_N), (own_lo_N, own_hi_N))
        cover_ranges = touch_ranges
    else:
        # Slot 0 reaches furthest back (anchor - (W-1)); the last slot's window bounds what all slots see.
        # A causal block is touched, never covered (no query sees all of it); a bidirectional one is seen
        # whole by every slot iff the window spans it.
        touch_ranges = ((torch.maximum(seq_start_N, anchor_N - (sliding_window - 1)), anchor_N), (own_lo_N, own_hi_N))
        cover_ranges = ((torch.maximum(seq_start_N, anchor_N + block_size - sliding_window), anchor_N),)
        if not causal and sliding_window >= block_size:
            cover_ranges += ((own_lo_N, own_hi_N),)
    touch_NJ = torch.zeros(layout.num_blocks, num_kv_tiles, dtype=torch.bool, device=device)
    cover_NJ = torch.zeros_like(touch_NJ)
    for lo_N, hi_N in touch_ranges:
        lo_N1, hi_N1 = lo_N.unsqueeze(1), hi_N.unsqueeze(1)
        touch_NJ |= (lo_N1 < hi_N1) & (lo_N1 < tile_hi_J) & (hi_N1 > tile_lo_J)
    for lo_N, hi_N in cover_ranges:
        lo_N1, hi_N1 = lo_N.unsqueeze(1), hi_N.unsqueeze(1)
        cover_NJ |= (lo_N1 <= tile_lo_J) & (hi_N1 >= tile_hi_J)
    blocks_per_tile = tile // block_size
    touch_IJ = touch_NJ.view(-1, blocks_per_tile, num_kv_tiles).any(1)  # [q tiles, kv tiles]
    full_IJ = cover_NJ.view(-1, blocks_per_tile, num_kv_tiles).all(1)
    return touch_IJ & ~full_IJ, full_IJ


def _fill_ordered(flags_IJ: torch.Tensor, num_out: torch.Tensor, idx_out: torch.Tensor) -> None:
    """(count, indices) of the True columns of each row, sorted first; written in place."""
    num_out.copy_(flags_IJ.sum(-1).view_as(num_out))
    order_IJ = torch.argsort(flags_IJ.to(torch.int8), dim=-1, descending=True, stable=True)
    idx_out.copy_(order_IJ.view_as(idx_out))


class BlockAttentionLayout:
    """The attention layout of one batch shape; built once, refreshed in place every step.

    update(seq_start_N, anchor_N) copies the new block ranges into persistent device tensors and
    rebuilds the masks from them, so every tensor the attention reads keeps its address (CUDA graphs)
    and each flex mask_mod keeps its identity (torch.compile does not recompile).
    sliding_window: W when the drafter has sliding layers (a second mask is then kept), else None.
    sliding_causal: whether the sliding layers attend their block causally (else both ways, in the window).
    """

    def __init__(
        self,
        *,
        num_ctx: int,
        num_blocks: int,
        block_size: int,
        backend: Backend = "sdpa",
        device: torch.device | str = "cpu",
        tile_size: int = 128,
        compile_flex: bool = True,
        sliding_window: int | None = None,
        sliding_causal: bool = True,
    ):
        if backend not in ("sdpa", "flex"):
            raise ValueError(f"attention backend must be 'sdpa' or 'flex', got {backend!r}")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
        if backend == "flex":
            if tile_size % block_size:
                raise ValueError(
                    f"flex tile_size {tile_size} must be a multiple of block_size {block_size} "
                    "(a query tile holds whole blocks)"
                )
            if (num_blocks * block_size) % tile_size:
                raise ValueError(
                    f"num_blocks ({num_blocks}) x block_size ({block_size}) must be a multiple of the "
                    f"flex tile_size {tile_size}: use num_blocks a multiple of {tile_size // block_size}"
                )
        self.num_ctx, self.num_blocks, self.block_size = num_ctx, num_blocks, block_size
        self.backend, self.tile_size, self.compile_flex = backend, tile_size, compile_flex
        self.sliding_window, self.sliding_causal = sliding_window, sliding_causal
        self.num_queries = num_blocks * block_size
        self.num_keys = num_ctx + self.num_queries
        device = torch.device(device)
        self.seq_start_N = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        self.anchor_N = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        self.dense_mask_QL: torch.Tensor | None = None
        self.dense_sliding_mask_QL: torch.Tensor | None = None
        self._flex: dict[bool, _FlexMask] = {}
        if backend == "flex":
            self._flex[False] = _FlexMask(self, None, device)
            if sliding_window is not None:
                self._flex[True] = _FlexMask(self, sliding_window, device)

    @classmethod
    def for_drafter(cls, drafter: DrafterConfig, *, num_ctx: int, num_blocks: int, **options) -> BlockAttentionLayout:
        """The layout a drafter's forward needs: its block size, and its sliding window when it has
        sliding layers (else no sliding mask is built), and whether they are causal; options are the
        constructor's (backend, device, ...)."""
        return cls(
            num_ctx=num_ctx,
            num_blocks=num_blocks,
            block_size=drafter.block_size,
            sliding_window=drafter.attention_window,
            sliding_causal=drafter.sliding_causal,
            **options,
        )

    # The full layers' flex mask (the sliding one: flex_mask(sliding=True)).
    @property
    def block_mask(self):
        return self._flex[False].block_mask if self._flex else None

    @property
    def mask_mod(self):
        return self._flex[False].mask_mod if self._flex else None

    def flex_mask(self, sliding: bool = False) -> _FlexMask:
        if sliding and self.sliding_window is None:
            raise ValueError(
                "this BlockAttentionLayout has no sliding mask: build it with "
                "sliding_window=DrafterConfig.attention_window for a drafter with sliding layers"
            )
        return self._flex[sliding]

    def update(self, seq_start_N: torch.Tensor, anchor_N: torch.Tensor) -> BlockAttentionLayout:
        """Load the block ranges of this step (int tensors [NB] on the layout's device)."""
        if seq_start_N.shape != (self.num_blocks,) or anchor_N.shape != (self.num_blocks,):
            raise ValueError(
                f"block ranges must have shape ({self.num_blocks},), got "
                f"{tuple(seq_start_N.shape)} and {tuple(anchor_N.shape)}"
            )
        self.seq_start_N.copy_(seq_start_N)
        self.anchor_N.copy_(anchor_N)
        if self.backend == "sdpa":
            self.dense_mask_QL = block_mask_dense(
                self.seq_start_N, self.anchor_N, num_ctx=self.num_ctx, block_size=self.block_size
            )
            if self.sliding_window is not None:
                self.dense_sliding_mask_QL = block_mask_dense(
                    self.seq_start_N,
                    self.anchor_N,
                    num_ctx=self.num_ctx,
                    block_size=self.block_size,
                    sliding_window=self.sliding_window,
                    causal=self.sliding_causal,
                )
            return self
        for mask in self._flex.values():
            mask.refresh(self)
        return self


def block_attention(
    q_QAD: torch.Tensor, k_LMD: torch.Tensor, v_LMD: torch.Tensor, layout: BlockAttentionLayout, sliding: bool = False
) -> torch.Tensor:
    """Softmax attention of the Q block queries over the L keys under the block rule; [Q, A, D].

    sliding: apply the sliding layers' rule (the layout must have been built with a window)."""
    q_1AQD = q_QAD.transpose(0, 1).unsqueeze(0)
    k_1MLD = k_LMD.transpose(0, 1).unsqueeze(0)
    v_1MLD = v_LMD.transpose(0, 1).unsqueeze(0)
    if layout.backend == "sdpa":
        if sliding and layout.sliding_window is None:
            layout.flex_mask(sliding=True)  # raises the explanatory error
        mask_QL = layout.dense_sliding_mask_QL if sliding else layout.dense_mask_QL
        if mask_QL is None:
            raise RuntimeError("BlockAttentionLayout.update() must run before block_attention")
        out_1AQD = F.scaled_dot_product_attention(q_1AQD, k_1MLD, v_1MLD, attn_mask=mask_QL, enable_gqa=True)
    else:
        from torch.nn.attention.flex_attention import flex_attention as flex

        # Inside a caller's torch.compile region dynamo compiles flex itself; otherwise use our one compile.
        if layout.compile_flex and not torch.compiler.is_compiling():
            flex = _get_compiled_flex()
        out_1AQD = flex(q_1AQD, k_1MLD, v_1MLD, block_mask=layout.flex_mask(sliding).block_mask, enable_gqa=True)
    return out_1AQD.squeeze(0).transpose(0, 1)


def full_attention(q_QAD: torch.Tensor, k_LMD: torch.Tensor, v_LMD: torch.Tensor) -> torch.Tensor:
    """Unmasked attention (inference: one block over its whole context and itself); [Q, A, D]."""
    out_1AQD = F.scaled_dot_product_attention(
        q_QAD.transpose(0, 1).unsqueeze(0),
        k_LMD.transpose(0, 1).unsqueeze(0),
        v_LMD.transpose(0, 1).unsqueeze(0),
        enable_gqa=True,
    )
    return out_1AQD.squeeze(0).transpose(0, 1)


def window_attention(
    q_QAD: torch.Tensor,
    k_LMD: torch.Tensor,
    v_LMD: torch.Tensor,
    q_pos_Q: torch.Tensor,
    k_pos_L: torch.Tensor,
    sliding_window: int,
    causal: bool = True,
) -> torch.Tensor:
    """A sliding layer at inference (one block over its prefix): query at position p attends the keys
    at positions [p - (W-1), p], causal like vLLM's and SGLang's sliding DFlash layers, or (causal False)
    [p - (W-1), p + (W-1)] as z-lab's and vLLM's non-causal sliding layers; [Q, A, D]."""
    behind_QL = q_pos_Q.unsqueeze(1) - k_pos_L.unsqueeze(0)
    mask_QL = (behind_QL >= (0 if causal else 1 - sliding_window)) & (behind_QL <= sliding_window - 1)
    out_1AQD = F.scaled_dot_product_attention(
        q_QAD.transpose(0, 1).unsqueeze(0),
        k_LMD.transpose(0, 1).unsqueeze(0),
        v_LMD.transpose(0, 1).unsqueeze(0),
        attn_mask=mask_QL,
        enable_gqa=True,
    )
    return out_1AQD.squeeze(0).transpose(0, 1)
