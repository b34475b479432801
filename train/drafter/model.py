"""The DFlash drafter: Qwen3-style decoder layers with KV injection of the fused target context.

What is unusual about this model (z-lab's DFlashDraftModel, which serving engines load):
- No embedding or LM head of its own: block tokens are embedded with the target's frozen
  embed_tokens and its output goes through the target's frozen lm_head (`TargetHead`, kept
  outside the module so it is neither trained, saved, exported nor broadcast by DDP).
- Context = the K tapped target hidden states of each token, fused: hidden_norm(fc(concat)). A drafter
  trained on a projected cache reads codes z = A concat (A = P D, shards/projection.py) through an fc'
  of R inputs and holds A as the buffer context_projection (not trained): full taps are projected by it
  (context_of_taps), and the export folds it, fc = fc' A, into a standard drafter.
- In every layer K/V come from [fused context ; block hidden] and Q from the block only; the
  context is not layer-normed (only the block stream passes input_layernorm).
- RMSNorms are Qwen3's (w * x_normed, w initialised to ones), not the target's (1 + w).
- RoPE rotates the whole head; context key t sits at its position id, block slot k at
  pos(anchor)+k; queries at the block positions.
- Layers are full (the block sees all its context and itself bidirectionally) or sliding
  (config.layer_types "sliding_attention": window sliding_window, the block causal, or both ways under
  config.json is_causal false), as attention.py defines.

Parameter names equal z-lab's: fc, hidden_norm, norm, layers.N.{input_layernorm,
post_attention_layernorm}, layers.N.self_attn.{q,k,v,o}_proj / {q,k}_norm, layers.N.mlp.{gate,up,down}_proj.

Legend: T context tokens, K taps, H hidden, NB blocks, B block size, Q = NB*B block tokens,
L = T + Q keys, A query heads, M kv heads, D head dim, I MLP width, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from shards.projection import codes_of
from train.drafter.attention import BlockAttentionLayout, block_attention, full_attention, window_attention
from train.drafter.config import DrafterConfig
from train.drafter.dflash2 import BlockConv, CandidateSelector, init_dflash2_weights_, transform_logits
from train.drafter.linear import Linear

AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ContextKV(NamedTuple):
    """Every layer's (k, v) [T, M, D] of one packed batch's fused context (DFlashDrafter.context): the
    part of a forward that depends on the batch and the weights only, not on the blocks."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k (k_norm, RoPE at the context positions), v


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: w * (x / rms(x)), statistics in float32, the result in x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    # Cast after the weight: fp32 master weights must not turn bf16 activations into fp32 ones.
    return (weight * x32).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


# The pointwise regions (norm, SwiGLU, RoPE) are called through these class attributes;
# train/drafter/pointwise.py sets compiled twins on the modules of the training model only.
class RMSNorm(nn.Module):
    """Qwen3 RMSNorm (rms_norm), weight initialised to ones."""

    norm_fn = staticmethod(rms_norm)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(x, self.weight, self.eps)


def rope_cos_sin(
    pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*pos.shape, D] for positions `pos` (any int shape), full-head NeoX layout."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim)
    freqs = pos.float().unsqueeze(-1) * inv_freq  # [..., D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_SHD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2, x1], broadcast over heads."""
    x1, x2 = x_SHD.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x_SHD * cos_SD.unsqueeze(1) + rotated * sin_SD.unsqueeze(1)


class DFlashAttention(nn.Module):
    rope_fn = staticmethod(apply_rope)

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def context_kv(
        self, ctx_TH: torch.Tensor, rope_ctx: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """KV injection: this layer's (k, v) [T, M, D] of the fused context; they depend on the batch and the
        weights only, never on the blocks (a walk computes them once per shard: DFlashDrafter.context)."""
        T, D = ctx_TH.shape[0], self.head_dim
        k_ctx_TMD = self.rope_fn(self.k_norm(self.k_proj(ctx_TH).view(T, self.num_kv_heads, D)), *rope_ctx)
        v_ctx_TMD = self.v_proj(ctx_TH).view(T, self.num_kv_heads, D)
        return k_ctx_TMD, v_ctx_TMD

    def forward(
        self,
        x_QH: torch.Tensor,
        ctx_kv: tuple[torch.Tensor, torch.Tensor],
        rope_blk: tuple[torch.Tensor, torch.Tensor],
        attend: AttendFn,
    ) -> torch.Tensor:
        Q, D, rope = x_QH.shape[0], self.head_dim, self.rope_fn
        k_ctx_TMD, v_ctx_TMD = ctx_kv
        q_QAD = rope(self.q_norm(self.q_proj(x_QH).view(Q, self.num_heads, D)), *rope_blk)
        k_blk_QMD = rope(self.k_norm(self.k_proj(x_QH).view(Q, self.num_kv_heads, D)), *rope_blk)
        v_blk_QMD = self.v_proj(x_QH).view(Q, self.num_kv_heads, D)
        # Under autocast with fp32 norm weights q/k come out fp32 while v is bf16; flex needs one dtype.
        dtype = v_ctx_TMD.dtype
        k_LMD = torch.cat([k_ctx_TMD, k_blk_QMD], dim=0).to(dtype)
        v_LMD = torch.cat([v_ctx_TMD, v_blk_QMD], dim=0)
        out_QAD = attend(q_QAD.to(dtype), k_LMD, v_LMD)
        return self.o_proj(out_QAD.reshape(Q, self.num_heads * D))


class SwiGLU(nn.Module):
    act_fn = staticmethod(swiglu)

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x), self.up_proj(x)))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg)
        # DFlash 2: a block convolution around each sublayer (train/drafter/dflash2.py); None in DFlash 1.
        self.attention_conv = self.mlp_conv = None
        if cfg.is_dflash2:
            conv = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size)
            self.attention_conv, self.mlp_conv = BlockConv(*conv), BlockConv(*conv)

    def forward(self, x_QH, ctx_kv, rope_blk, attend: AttendFn) -> torch.Tensor:
        """ctx_kv: this layer's context (k, v), from self_attn.context_kv."""
        attention = partial(self.self_attn, ctx_kv=ctx_kv, rope_blk=rope_blk, attend=attend)
        x_QH = x_QH + _around(self.attention_conv, attention, self.input_layernorm(x_QH))
        return x_QH + _around(self.mlp_conv, self.mlp, self.post_attention_layernorm(x_QH))

    def forward_fused(self, x_QH, ctx_TH, rope_ctx, rope_blk, attend: AttendFn) -> torch.Tensor:
        """The layer computing its own context K/V from the fused context (training: inside the layer's
        activation checkpoint, so they are recomputed in backward rather than kept)."""
        return self(x_QH, self.self_attn.context_kv(ctx_TH, rope_ctx), rope_blk, attend)


def _around(conv: BlockConv | None, sublayer: Callable[[torch.Tensor], torch.Tensor], x_QH: torch.Tensor):
    """sublayer(x), or with DFlash 2's convolution before and after it."""
    if conv is None:
        return sublayer(x_QH)
    x_QH, delta = conv.prepare(x_QH)
    return conv.finish(sublayer(x_QH), delta)


class DFlashDrafter(nn.Module):
    """Trainable part of the drafter; see the module docstring for the architecture (and
    train/drafter/dflash2.py for what a DFlash 2 drafter, config.arch "dflash2", adds)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.fc = Linear(cfg.fc_in_features, cfg.hidden_size)
        projected = cfg.context_width is not None
        # A [R, K*H] of a projected drafter: set from the cache (or a checkpoint), saved with the weights.
        self.register_buffer(
            "context_projection", torch.zeros(cfg.context_width, cfg.num_taps * cfg.hidden_size) if projected else None
        )
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.candidate_selector = (
            CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector_rank, cfg.selector_top_k)
            if cfg.is_dflash2
            else None
        )
        init_drafter_weights(self)

    def block_input(self, block_embed_XH: torch.Tensor) -> torch.Tensor:
        """The block stream's input: the target's embeddings (DFlash 2: times input_embedding_scale)."""
        scale = self.config.input_embedding_scale if self.config.is_dflash2 else 1.0
        return block_embed_XH if scale == 1.0 else block_embed_XH * scale

    def logit_transform(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """DFlash 2's map from lm_head(h) to the drafter's logits; None where it is the identity."""
        cfg = self.config
        if not cfg.is_dflash2 or (cfg.output_multiplier == 1.0 and cfg.final_logit_softcapping is None):
            return None
        return partial(transform_logits, output_multiplier=cfg.output_multiplier, softcap=cfg.final_logit_softcapping)

    def draft_logits(self, hidden_XH: torch.Tensor, head: TargetHead) -> torch.Tensor:
        """[X, V] logits of the drafter's normed states through the target's lm_head (DFlash 2's transform)."""
        logits_XV = head.logits(hidden_XH)
        if not self.config.is_dflash2:
            return logits_XV
        return transform_logits(logits_XV, self.config.output_multiplier, self.config.final_logit_softcapping)

    def slot_candidates(
        self, hidden_XH: torch.Tensor, head: TargetHead, predecessor_X: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DFlash 2: per row (a draft slot), its K candidate ids and their selector scores given the
        chosen predecessor token, both [X, K]; the slot's draft distribution at temperature T is
        softmax(scores / T) over the ids (greedy: the argmax)."""
        unary_XK, ids_XK = torch.topk(self.draft_logits(hidden_XH, head), self.config.selector_top_k, dim=-1)
        return ids_XK, self.candidate_selector.edge_scores(unary_XK, ids_XK, predecessor_X, hidden_XH)

    def greedy_drafts(self, hidden_SH: torch.Tensor, head: TargetHead, anchor_id: torch.Tensor) -> torch.Tensor:
        """[S] greedy drafts of one block's slots: the argmaxes (DFlash 1) or the selector's greedy walk
        from the anchor token (DFlash 2)."""
        if not self.config.is_dflash2:
            return self.draft_logits(hidden_SH, head).float().argmax(-1)
        return self.selector_path(hidden_SH.unsqueeze(0), head, anchor_id.view(1))[0]

    def selector_path(self, hidden_NSH: torch.Tensor, head: TargetHead, anchor_N: torch.Tensor) -> torch.Tensor:
        """DFlash 2: [N, S] greedy selector walk over the S draft slots of N blocks from their anchor tokens."""
        N, S, H = hidden_NSH.shape
        unary_XK, ids_XK = torch.topk(
            self.draft_logits(hidden_NSH.reshape(N * S, H), head), self.config.selector_top_k, dim=-1
        )
        return self.candidate_selector.greedy_path(unary_XK.view(N, S, -1), ids_XK.view(N, S, -1), hidden_NSH, anchor_N)

    def fuse_context(self, hidden_TKH: torch.Tensor) -> torch.Tensor:
        """[T, K, H] tapped target states (a projected drafter: codes [T, 1, R]) -> [T, H] fused context
        hidden_norm(fc(concat_k))."""
        return self.hidden_norm(self.fc(hidden_TKH.flatten(1)))

    def context_of_taps(self, hidden_TKH: torch.Tensor) -> torch.Tensor:
        """What fc reads of the target's full taps [T, K, H]: themselves, or a projected drafter's codes
        A concat_k [T, 1, R] (live decoding, where no cache stored them)."""
        if self.context_projection is None:
            return hidden_TKH
        return codes_of(hidden_TKH, self.context_projection).unsqueeze(1)

    def context(self, hidden_TKH: torch.Tensor, position_ids_T: torch.Tensor, dtype: torch.dtype) -> ContextKV:
        """Every layer's context K/V of one packed batch, activations in `dtype` (the block embeddings')."""
        cfg = self.config
        ctx_TH = self.fuse_context(hidden_TKH.to(dtype))
        rope_ctx = rope_cos_sin(position_ids_T, cfg.head_dim, cfg.rope_theta, dtype)
        return ContextKV([layer.self_attn.context_kv(ctx_TH, rope_ctx) for layer in self.layers])

    def _run_layers(
        self, ctx_TH, ctx_pos_T, x_QH, blk_pos_Q, attends: list[AttendFn], checkpoint_layers: bool = False
    ) -> torch.Tensor:
        """attends: one attention function per layer (full or sliding)."""
        cfg = self.config
        rope_ctx = rope_cos_sin(ctx_pos_T, cfg.head_dim, cfg.rope_theta, x_QH.dtype)
        rope_blk = rope_cos_sin(blk_pos_Q, cfg.head_dim, cfg.rope_theta, x_QH.dtype)
        for layer, attend in zip(self.layers, attends, strict=True):
            if checkpoint_layers and torch.is_grad_enabled():
                # Recompute each layer in backward: Q = NB*B block tokens at MLP width dominate memory.
                # No RNG inside a layer (no dropout): skipping the RNG stash keeps it CUDA-graph-capturable.
                x_QH = torch.utils.checkpoint.checkpoint(
                    layer.forward_fused,
                    x_QH,
                    ctx_TH,
                    rope_ctx,
                    rope_blk,
                    attend,
                    use_reentrant=False,
                    preserve_rng_state=False,
                )
            else:
                x_QH = layer.forward_fused(x_QH, ctx_TH, rope_ctx, rope_blk, attend)
        return self.norm(x_QH)

    def _block_attends(self, layout: BlockAttentionLayout) -> list[AttendFn]:
        """One block attention per layer (full or sliding) under `layout`, whose window must be the drafter's."""
        cfg = self.config
        if any(cfg.sliding_layers) and (layout.sliding_window, layout.sliding_causal) != (
            cfg.sliding_window,
            cfg.sliding_causal,
        ):
            raise ValueError(
                f"the drafter's sliding layers use window {cfg.sliding_window} (causal {cfg.sliding_causal}), the "
                f"attention layout has {layout.sliding_window} (causal {layout.sliding_causal}): build it with "
                "BlockAttentionLayout.for_drafter (sliding_window and sliding_causal of the DrafterConfig)"
            )
        return [partial(block_attention, layout=layout, sliding=s) for s in self.config.sliding_layers]

    def forward(
        self,
        hidden_TKH: torch.Tensor,
        position_ids_T: torch.Tensor,
        block_embed_NBH: torch.Tensor,
        block_pos_NB: torch.Tensor,
        layout: BlockAttentionLayout,
        checkpoint_layers: bool = False,
    ) -> torch.Tensor:
        """Training forward over one packed batch; returns normed block hidden states [NB, B, H].

        hidden_TKH: tapped target states of all T tokens (context K/V computed once per layer over them).
        block_embed_NBH: target embeddings of the block tokens; block_pos_NB: their positions.
        layout: the block attention rule for this batch (BlockAttentionLayout.update already called).
        checkpoint_layers: recompute every decoder layer in backward (activation checkpointing).
        """
        NB, B, H = block_embed_NBH.shape
        ctx_TH = self.fuse_context(hidden_TKH.to(block_embed_NBH.dtype))
        x_QH = self.block_input(block_embed_NBH.reshape(NB * B, H))
        attends = self._block_attends(layout)
        out_QH = self._run_layers(
            ctx_TH, position_ids_T, x_QH, block_pos_NB.reshape(NB * B), attends, checkpoint_layers
        )
        return out_QH.view(NB, B, H)

    def forward_cached(
        self,
        context: ContextKV,
        block_embed_NBH: torch.Tensor,
        block_pos_NB: torch.Tensor,
        layout: BlockAttentionLayout,
    ) -> torch.Tensor:
        """`forward` with the batch's context K/V already computed (`context`, no gradient path needed):
        only the blocks' own projections, attention and MLPs run; [NB, B, H]."""
        cfg = self.config
        NB, B, H = block_embed_NBH.shape
        x_QH = self.block_input(block_embed_NBH.reshape(NB * B, H))
        rope_blk = rope_cos_sin(block_pos_NB.reshape(NB * B), cfg.head_dim, cfg.rope_theta, x_QH.dtype)
        for layer, attend, ctx_kv in zip(self.layers, self._block_attends(layout), context.kv, strict=True):
            x_QH = layer(x_QH, ctx_kv, rope_blk, attend)
        return self.norm(x_QH).view(NB, B, H)

    def forward_block(
        self, hidden_LKH: torch.Tensor, ctx_pos_L: torch.Tensor, block_embed_BH: torch.Tensor, block_pos_B: torch.Tensor
    ) -> torch.Tensor:
        """Inference forward: one block over one sequence's prefix (all of it visible, its full taps); [B, H]."""
        ctx_LH = self.fuse_context(self.context_of_taps(hidden_LKH.to(block_embed_BH.dtype)))
        key_pos_L = torch.cat([ctx_pos_L, block_pos_B])
        cfg = self.config
        sliding = partial(
            window_attention,
            q_pos_Q=block_pos_B,
            k_pos_L=key_pos_L,
            sliding_window=cfg.sliding_window,
            causal=cfg.sliding_causal,
        )
        attends = [sliding if s else full_attention for s in cfg.sliding_layers]
        return self._run_layers(ctx_LH, ctx_pos_L, self.block_input(block_embed_BH), block_pos_B, attends)

    def forward_blocks(
        self, hidden_LKH: list[torch.Tensor], block_embed_NBH: torch.Tensor, block_pos_NB: torch.Tensor
    ) -> torch.Tensor:
        """Inference forward of N blocks at once, block n over sequence n's prefix hidden_LKH[n] (all of it
        visible, its full taps) and at positions block_pos_NB[n]: forward_block of each, in one packed
        forward under the training forward's block attention (no block sees another sequence); [N, B, H]."""
        N, B, H = block_embed_NBH.shape
        dtype, device = block_embed_NBH.dtype, block_embed_NBH.device
        sizes = [h.shape[0] for h in hidden_LKH]  # host ints: no device sync per sequence
        lengths = torch.tensor(sizes, device=device)
        ends_N = lengths.cumsum(0)
        ctx_TH = self.fuse_context(torch.cat([self.context_of_taps(h.to(dtype)) for h in hidden_LKH]))
        position_ids_T = torch.cat([torch.arange(n, device=device) for n in sizes])
        layout = BlockAttentionLayout.for_drafter(
            self.config, num_ctx=ctx_TH.shape[0], num_blocks=N, backend="sdpa", device=device
        ).update((ends_N - lengths).to(torch.int32), ends_N.to(torch.int32))  # block n's anchor follows its prefix
        x_QH = self.block_input(block_embed_NBH.reshape(N * B, H))
        attends = self._block_attends(layout)
        return self._run_layers(ctx_TH, position_ids_T, x_QH, block_pos_NB.reshape(N * B), attends).view(N, B, H)


@torch.no_grad()
def init_drafter_weights(model: DFlashDrafter, std: float = 0.02) -> None:
    """Every initialisation in one place: linears N(0, std) (Qwen3 initializer_range), RMSNorm weights 1,
    then DFlash 2's convolutions and selector inert (dflash2.init_dflash2_weights_)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if module.weight.device.type != "meta":
                nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            if module.weight.device.type != "meta":
                nn.init.ones_(module.weight)
    for module in model.modules():
        init_dflash2_weights_(module)


class TargetHead(nn.Module):
    """The target's frozen embed_tokens and lm_head (buffers, not parameters, never saved with the drafter).

    The target's final norm is not needed: the drafter applies its own `norm` before the lm_head.
    """

    def __init__(self, embed_tokens_VH: torch.Tensor, lm_head_VH: torch.Tensor):
        super().__init__()
        if embed_tokens_VH.shape != lm_head_VH.shape:
            raise ValueError(
                f"embed_tokens {tuple(embed_tokens_VH.shape)} and lm_head {tuple(lm_head_VH.shape)} "
                "must have the same [vocab, hidden] shape"
            )
        self.register_buffer("embed_tokens_VH", embed_tokens_VH.detach(), persistent=False)
        # Tied targets store lm_head as the embedding; share storage when they are the same tensor.
        same = lm_head_VH.data_ptr() == embed_tokens_VH.data_ptr()
        self.register_buffer("lm_head_VH", self.embed_tokens_VH if same else lm_head_VH.detach(), persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_tokens_VH)

    def logits(self, hidden_XH: torch.Tensor) -> torch.Tensor:
        return hidden_XH @ self.lm_head_VH.T


def lm_head_weight(head: TargetHead | torch.Tensor) -> torch.Tensor:
    """The [V, H] lm_head of a TargetHead, or the tensor itself (losses and metrics take either)."""
    return head if isinstance(head, torch.Tensor) else head.lm_head_VH


def count_parameters(cfg: DrafterConfig) -> int:
    """Trainable parameters of a drafter of this shape, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    return sum(p.numel() for p in model.parameters())
