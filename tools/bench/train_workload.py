"""The workload of tools/bench/train.py: the drafter sizes, a random packed batch of fixed shapes, and
what one step costs, counted analytically (FLOPs, keys each query attends to, flex kv tiles visited).

FLOPs per step (printed by the script), with Q = blocks x block size query tokens, T context tokens,
L layers, keys_l = mean keys a query of layer l attends to (full: its context before the anchor + its
block; sliding: the part of both inside its window):
  layers      6 x P_layers x Q                (P_layers: trainable parameters of the decoder layers)
  ctx K/V     6 x L x (2 x H x M x D) x T     (each layer's k/v projections of the fused context)
  attention   12 x N x D x sum_l keys_l x Q   (QK^T and AV, forward 4, backward 8)
  LM head     4 x V x H x Q                   (frozen: logits forward and input gradient only)
  fc          4 x (K x H) x H x T             (forward and weight gradient; its input is frozen)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import click
import torch

from train.drafter.config import DFLASH2_27B_LAYOUT, SLIDING_ATTENTION, DrafterConfig
from train.drafter.model import count_parameters


@dataclass(frozen=True)
class Size:
    name: str
    hidden: int
    mlp: int
    heads: tuple[int, int, int]  # q heads, kv heads, head dim
    vocab: int
    layers: int
    token_budget: int
    seq_len: int  # packed sequence length of the random batch
    taps: int = 5
    block_size: int = 16
    num_blocks: int | None = None  # None = dflash-train's default for the budget
    arch: str = "dflash"  # "dflash2": the DFlash 2 drafter
    published_layout: bool = False  # every layer sliding at the published window unless --layer-types says


SIZES = {
    "27b": Size("27b", 5120, 17408, (32, 8, 128), 248320, 5, 49152, 4096),
    "4b": Size("4b", 2560, 9216, (32, 8, 128), 248320, 5, 8192, 2048),
    # Launch-bound: many small kernels per step (4B width, 2048-token budget, 32 blocks = 512 queries).
    "launch": Size("launch", 2560, 9216, (32, 8, 128), 248320, 5, 2048, 512, num_blocks=32),
    # CPU-sized (tests: --device cpu): 2 layers of width 64, 16 blocks of 16 per 512 tokens.
    "tiny": Size("tiny", 64, 128, (4, 2, 16), 512, 2, 512, 128, taps=3, num_blocks=16),
    # The published Qwen3.8-27B-DFlash2 layout at 27B width: 5 sliding layers (window 2048), block 8,
    # selector rank 256 / top 16, conv kernel 2 / group 16 (DrafterConfig's DFlash 2 defaults).
    "27b2": Size(
        "27b2", 5120, 17408, (32, 8, 128), 248320, 5, 49152, 4096, block_size=8, arch="dflash2", published_layout=True
    ),
    # DFlash 1 in that same layout: what 27b2's cost per query token is compared with. At block 8 a step
    # has half 27b's query tokens over the same context, so the context's fc and K/V cost twice as much
    # per query token whatever the architecture.
    "27b1-8": Size("27b1-8", 5120, 17408, (32, 8, 128), 248320, 5, 49152, 4096, block_size=8, published_layout=True),
    "tiny2": Size(
        "tiny2", 64, 128, (4, 2, 16), 512, 2, 512, 128, taps=3, num_blocks=16, arch="dflash2", published_layout=True
    ),
}


def bf16_matmul_peak(device: torch.device, n: int = 8192, iters: int = 20) -> float:
    """Measured dense bf16 matmul FLOP/s (best of 3 runs of `iters` n^3 products)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        torch.cuda.synchronize(device)
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - t0))
    return best


def drafter_config(
    size: Size, layer_types: list[str] | None = None, sliding_window: int | None = None
) -> DrafterConfig:
    q, kv, d = size.heads
    if size.published_layout and layer_types is None:
        layer_types, sliding_window = [SLIDING_ATTENTION] * size.layers, DFLASH2_27B_LAYOUT["sliding_window"]
    sliding = layer_types is not None and "sliding_attention" in layer_types
    return DrafterConfig(
        arch=size.arch,
        num_layers=size.layers,
        hidden_size=size.hidden,
        intermediate_size=size.mlp,
        num_attention_heads=q,
        num_key_value_heads=kv,
        head_dim=d,
        block_size=size.block_size,
        mask_token_id=size.vocab - 1,
        tap_layer_ids=list(range(size.taps)),
        num_target_layers=64,
        vocab_size=size.vocab,
        layer_types=layer_types,
        sliding_window=sliding_window if sliding else None,
    )


def parse_layer_types(spec: str) -> list[str]:
    """'sliding,full' -> ['sliding_attention', 'full_attention']."""
    names = {"full": "full_attention", "sliding": "sliding_attention"}
    out = [names.get(t.strip(), t.strip()) for t in spec.split(",") if t.strip()]
    if not out or any(t not in names.values() for t in out):
        raise click.BadParameter(f"--layer-types entries must be full or sliding, got {spec!r}")
    return out


def mean_keys_per_layer(blocks, cfg: DrafterConfig) -> list[float]:
    """Mean keys a valid block's query attends to, per layer (attention.py's rule, counted analytically)."""
    valid = blocks.block_valid_N
    ctx_N1 = (blocks.anchor_N - blocks.seq_start_N).float()[valid].unsqueeze(1)  # context before the anchor
    B = cfg.block_size
    k_1B = torch.arange(B, device=ctx_N1.device, dtype=torch.float32).unsqueeze(0)
    full = float((ctx_N1 + B).mean())
    if cfg.attention_window is None:
        return [full] * cfg.num_layers
    W = cfg.attention_window
    behind_1B = (k_1B + 1).clamp(max=W)  # block slots at or behind the query, inside the window
    ahead_1B = 0 if cfg.sliding_causal else (B - 1 - k_1B).clamp(max=W - 1)  # is_causal false: those ahead too
    sliding = float((ctx_N1.clamp(max=W - 1 - k_1B).clamp(min=0) + behind_1B + ahead_1B).mean())
    return [sliding if s else full for s in cfg.sliding_layers]


def visited_kv_tiles(layout) -> dict[str, float]:
    """Mean kv tiles (partial + full) each flex query tile visits, per mask kind (full / sliding)."""
    out = {}
    if layout.backend != "flex":
        return out
    for sliding in [False, True] if layout.sliding_window is not None else [False]:
        bm = layout.flex_mask(sliding).block_mask
        out["sliding" if sliding else "full"] = float((bm.kv_num_blocks + bm.full_kv_num_blocks).float().mean())
    out["of"] = float(bm.kv_indices.shape[-1])
    return out


def fill_random_batch(state, size: Size, gen: torch.Generator, position_offset: int = 0, context: int = 0) -> None:
    """Packed sequences of seq_len tokens; the first 10% of each is prompt (loss_mask 0). position_offset > 0:
    each is a piece of a long sample instead (dflash-extract --max-seq-len): positions from position_offset,
    anchors only past its first `context` tokens (anchor_mask)."""
    b = state.batch
    T, S = size.token_budget, b.cu_seqlens_S1.shape[0] - 1
    num_seqs = min(T // size.seq_len, S)
    starts = torch.arange(num_seqs + 1) * size.seq_len
    cu = torch.cat([starts, starts[-1:].repeat(S - num_seqs)]).to(torch.int32)
    pos = torch.zeros(T, dtype=torch.int32)
    mask = torch.zeros(T, dtype=torch.uint8)
    anchor_mask = torch.zeros(T, dtype=torch.uint8)
    for s in range(num_seqs):
        a = s * size.seq_len
        pos[a : a + size.seq_len] = position_offset + torch.arange(size.seq_len, dtype=torch.int32)
        mask[a + size.seq_len // 10 : a + size.seq_len] = 1
        anchor_mask[a + (context if position_offset else 0) : a + size.seq_len] = 1
    b.anchor_mask_T.copy_(anchor_mask)
    b.cu_seqlens_S1.copy_(cu)
    b.position_ids_T.copy_(pos)
    b.loss_mask_T.copy_(mask)
    b.input_ids_T.copy_(torch.randint(0, size.vocab - 1, (T,), generator=gen, dtype=torch.int32))
    b.hidden_TKH.normal_()
    b.batch_id.fill_(0)


def step_flops(size: Size, cfg: DrafterConfig, num_blocks: int, mean_keys: list[float]) -> dict[str, float]:
    H, L, V, T = size.hidden, size.layers, size.vocab, size.token_budget
    N, M, D = size.heads
    Q = num_blocks * size.block_size
    fc_params = size.taps * H * H
    layer_params = count_parameters(cfg) - fc_params - 2 * H  # minus fc, hidden_norm and final norm
    if cfg.is_dflash2:  # the codebooks are row gathers, not matmuls: Q rows read and scattered, ~0 FLOPs
        layer_params -= 2 * cfg.vocab_size * cfg.selector_rank
    return {
        "layers": 6 * layer_params * Q,
        "ctx_kv": 6 * L * (2 * H * M * D) * T,
        "attention": 12 * N * D * sum(mean_keys) * Q,
        "lm_head": 4 * V * H * Q,
        "fc": 4 * fc_params * T,
    }
