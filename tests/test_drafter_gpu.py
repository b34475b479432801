"""GPU checks of the drafter's fast path (run by the lead: pytest -m gpu tests/test_drafter_gpu.py).

No speed assertions: these check that the flex path equals the dense reference at the published
27B drafter width, and that one whole training step (sampling, mask, forward, chunked loss,
backward) captures into a CUDA graph and replays to the eager result.
"""

import copy

import pytest
import torch
from drafter_helpers import QWEN36_27B_TARGET, batch_blocks, drafter_for_target, make_batch

from train.attention import BlockAttentionLayout
from train.blocks import TrainingBlocks
from train.drafter_config import DrafterConfig
from train.losses import LossConfig, block_loss
from train.model import DFlashDrafter, TargetHead

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def cuda_batch(cfg, seq_lens, budget, max_seqs, seed=0):
    batch = make_batch(seq_lens, budget, max_seqs, cfg.num_taps, cfg.hidden_size, seed=seed)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    batch["input_ids_T"] = batch["input_ids_T"] % cfg.vocab_size
    batch["hidden_TKH"] = batch["hidden_TKH"].bfloat16()
    return batch


def build(cfg, seed=0, param_dtype=torch.bfloat16):
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg).to(DEVICE, param_dtype)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (cfg.vocab_size, cfg.hidden_size)
    head = TargetHead(
        torch.randn(shape, device=DEVICE, generator=g).bfloat16() * 0.02,
        torch.randn(shape, device=DEVICE, generator=g).bfloat16() * 0.02,
    )
    return model, head


def run_step(model, head, batch, blocks, layout, loss_cfg):
    layout.update(blocks.seq_start_N, blocks.anchor_N)
    # Autocast is a no-op for bf16 parameters and the trainer's setting for fp32 master parameters.
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        out = model(
            batch["hidden_TKH"], batch["position_ids_T"], head.embed(blocks.block_ids_NB), blocks.block_pos_NB, layout
        )
        parts = block_loss(out, head, blocks, loss_cfg)
    parts.total.backward()
    return parts


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


# The published Qwen3.6-27B layout (4 sliding + 1 full); window 512 < the 2048-token batch so it bites.
LAYOUTS = {"full": {}, "sliding": dict(layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=512)}


@pytest.mark.parametrize("layers", sorted(LAYOUTS))
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_flex_matches_sdpa_at_27b_width(param_dtype, layers):
    cfg = DrafterConfig.for_target(**QWEN36_27B_TARGET, **LAYOUTS[layers])
    model, head = build(cfg, param_dtype=param_dtype)
    batch = cuda_batch(cfg, [700, 900, 300, 100], 2048, 8)
    num_blocks = 64
    blocks = batch_blocks(
        batch,
        num_blocks=num_blocks,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        generator=torch.Generator(device=DEVICE).manual_seed(0),
    )
    loss_cfg = LossConfig(chunk_blocks=16)
    results = []
    for backend in ("flex", "sdpa"):
        model.zero_grad(set_to_none=True)
        layout = BlockAttentionLayout.for_drafter(
            cfg, num_ctx=2048, num_blocks=num_blocks, backend=backend, device=DEVICE
        )
        parts = run_step(model, head, batch, blocks, layout, loss_cfg)
        results.append((parts.total.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_f, grads_f), (loss_s, grads_s) = results
    assert abs(loss_f.item() - loss_s.item()) < 2e-2, f"loss flex {loss_f.item()} vs sdpa {loss_s.item()}"
    for name in (
        "fc.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.4.mlp.down_proj.weight",
        "norm.weight",
    ):
        err = rel_err(grads_f[name], grads_s[name])
        assert err < 5e-2, f"{name}: relative grad error {err}"


@pytest.mark.parametrize("layers", ["full", "sliding"])
def test_training_step_captures_into_cuda_graph_and_replays(layers):
    shape = {} if layers == "full" else dict(layer_types=["sliding_attention", "full_attention"], sliding_window=200)
    cfg = drafter_for_target(256, 512, 1000, num_layers=2, **shape)
    model, head = build(cfg, param_dtype=torch.float32)  # fp32 master weights under autocast, as the trainer
    reference = copy.deepcopy(model)
    batch = cuda_batch(cfg, [300, 400, 200], 1024, 4)
    num_blocks = 32
    loss_cfg = LossConfig(kl_lambda=0.0, cap_lambda=0.5, chunk_blocks=8)
    layout = BlockAttentionLayout.for_drafter(cfg, num_ctx=1024, num_blocks=num_blocks, backend="flex", device=DEVICE)

    def step():
        # Default CUDA generator: graph-safe, so each replay draws new anchors.
        blocks = batch_blocks(
            batch,
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            mask_token_id=cfg.mask_token_id,
        )
        return run_step(model, head, batch, blocks, layout, loss_cfg), blocks

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile flex and warm the allocator outside capture
            model.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        parts, blocks = step()

    anchors_seen = []
    for _ in range(2):
        for p in model.parameters():
            p.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        anchors_seen.append(blocks.anchor_N.clone())
    assert not torch.equal(*anchors_seen), "replays must draw fresh anchors"

    replayed = TrainingBlocks(**{k: v.clone() for k, v in vars(blocks).items()})
    dense = BlockAttentionLayout.for_drafter(cfg, num_ctx=1024, num_blocks=num_blocks, device=DEVICE)
    eager = run_step(reference, head, batch, replayed, dense, loss_cfg)
    assert torch.isfinite(parts.total).item()
    assert abs(parts.total.item() - eager.total.item()) < 2e-2, f"{parts.total.item()} vs {eager.total.item()}"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        err = rel_err(p.grad, q.grad)
        assert err < 5e-2, f"{name}: relative grad error {err}"
