"""GPU checks of the drafter's fast path (run by the lead: pytest -m gpu tests/train/drafter/test_drafter_gpu.py).

No speed assertions: these check that the flex path equals the dense reference at the published
27B drafter width, that one whole training step (sampling, mask, forward, chunked loss,
backward) captures into a CUDA graph and replays to the eager result, and that the elementwise cuts
(working bf16 weight copies, the compiled fused loss, compiled pointwise regions) give the plain
step's loss and gradients in bf16 at 27B width.
"""

import copy

import pytest
import torch

from tests.helpers.drafter import QWEN36_27B_TARGET, batch_blocks, drafter_for_target, forward_blocks, make_batch
from train.blocks import TrainingBlocks
from train.drafter.attention import BlockAttentionLayout
from train.drafter.config import DrafterConfig
from train.drafter.model import DFlashDrafter, Linear, TargetHead
from train.drafter.pointwise import compile_pointwise_
from train.loss.chunked import block_loss
from train.loss.config import LossConfig
from train.precision import WorkingWeights

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


def run_step(model, head, batch, blocks, layout, loss_cfg, topk=(None, None), checkpoint_layers=False):
    layout.update(blocks.seq_start_N, blocks.anchor_N)
    # Autocast is a no-op for bf16 parameters and the trainer's setting for fp32 master parameters.
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        out = forward_blocks(model, head, batch, blocks, layout, checkpoint_layers=checkpoint_layers)
        parts = block_loss(out, head, blocks, loss_cfg, *topk)
    parts.total.backward()
    return parts


def seeded_blocks(cfg, batch, num_blocks):
    return batch_blocks(
        batch,
        num_blocks=num_blocks,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        generator=torch.Generator(device=DEVICE).manual_seed(0),
    )


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
    blocks = seeded_blocks(cfg, batch, num_blocks)
    loss_cfg = LossConfig(chunk_blocks=16, fused=False)
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
    loss_cfg = LossConfig(kl_lambda=0.0, cap_lambda=0.5, chunk_blocks=8, fused=False)
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


def random_topk(num_tokens, vocab, k=8, seed=0):
    """Stored-target-like top-k: distinct int32 ids and bf16 log-probabilities per token."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    ids = torch.randint(0, vocab, (num_tokens, k), device=DEVICE, generator=g, dtype=torch.int32)
    ids[:, 1:] = (ids[:, :1] + torch.arange(1, k, device=DEVICE, dtype=torch.int32) * 7919) % vocab
    logp = torch.log_softmax(torch.randn(num_tokens, k, device=DEVICE, generator=g) * 2, -1).bfloat16()
    return ids, logp


@pytest.mark.parametrize("lambdas", [(0.0, 0.0), (0.5, 0.5)])
def test_fused_loss_matches_the_autograd_loss_at_27b_vocab(lambdas):
    """The compiled fused chunk loss against autograd over float32 log-softmax, bf16 hidden states."""
    cfg = DrafterConfig.for_target(**QWEN36_27B_TARGET)
    _, head = build(cfg)
    batch = cuda_batch(cfg, [700, 900, 300, 100], 2048, 8)
    blocks = seeded_blocks(cfg, batch, 64)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    hidden = torch.randn(64, cfg.block_size, cfg.hidden_size, device=DEVICE, generator=g).bfloat16()
    topk = random_topk(2048, cfg.vocab_size)
    results = []
    for fused in (False, True):
        h = hidden.clone().requires_grad_()
        loss_cfg = LossConfig(kl_lambda=lambdas[0], cap_lambda=lambdas[1], chunk_blocks=16, fused=fused)
        parts = block_loss(h, head, blocks, loss_cfg, *topk)
        parts.total.backward()
        results.append((parts, h.grad))
    (plain, g_plain), (fused, g_fused) = results
    for name in ("total", "ce", "kl", "cap"):
        a, b = float(getattr(plain, name).detach()), float(getattr(fused, name).detach())
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), f"{name}: autograd {a}, fused {b}"
    err = rel_err(g_fused, g_plain)
    assert err < 1e-2, f"hidden gradient: relative error {err}"


@pytest.mark.parametrize("lambdas,checkpoint_layers", [((0.0, 0.0), False), ((0.5, 0.5), True)])
def test_elementwise_cuts_match_the_plain_step_at_27b_width(lambdas, checkpoint_layers):
    """fp32 master weights under bf16 autocast (the trainer's setting): plain step, then the same model
    with working bf16 weight copies, compiled pointwise regions and the fused loss."""
    cfg = DrafterConfig.for_target(**QWEN36_27B_TARGET)
    model, head = build(cfg, param_dtype=torch.float32)
    batch = cuda_batch(cfg, [700, 900, 300, 100], 2048, 8)
    blocks = seeded_blocks(cfg, batch, 64)
    layout = BlockAttentionLayout(num_ctx=2048, num_blocks=64, block_size=cfg.block_size, backend="flex", device=DEVICE)
    topk = random_topk(2048, cfg.vocab_size)
    results = []
    for cuts in (False, True):
        if cuts:
            WorkingWeights([m for m in model.modules() if isinstance(m, Linear)], torch.bfloat16)
            compile_pointwise_(model)
        model.zero_grad(set_to_none=True)
        loss_cfg = LossConfig(kl_lambda=lambdas[0], cap_lambda=lambdas[1], chunk_blocks=16, fused=cuts)
        parts = run_step(model, head, batch, blocks, layout, loss_cfg, topk, checkpoint_layers=checkpoint_layers)
        results.append((parts.total.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_plain, grads_plain), (loss_cut, grads_cut) = results
    assert abs(loss_plain.item() - loss_cut.item()) < 1e-2, f"loss plain {loss_plain.item()} vs cut {loss_cut.item()}"
    errors = {name: rel_err(grads_cut[name], want) for name, want in grads_plain.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 5e-2, f"{worst}: relative grad error {errors[worst]} (all: {errors})"
