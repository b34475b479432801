"""The drafter model (train/drafter/model.py, train/drafter/config.py): names, shape, and the math against a float64
naive implementation written from the architecture description, plus training vs inference forward."""

import math

import pytest
import torch

from tests.helpers.drafter import (
    QWEN36_27B_TARGET,
    batch_blocks,
    blocks_and_layout,
    drafter_for_target,
    forward_blocks,
    make_batch,
    tiny_config,
    tiny_model_and_head,
)
from train.checkpoint.export import zlab_parameter_names
from train.drafter.attention import BlockAttentionLayout
from train.drafter.config import DrafterConfig
from train.drafter.model import DFlashDrafter, count_parameters


def test_parameter_names_are_zlab():
    cfg = tiny_config(num_layers=3)
    names = [n for n, _ in DFlashDrafter(cfg).named_parameters()]
    assert sorted(names) == sorted(zlab_parameter_names(cfg))
    assert list(DFlashDrafter(cfg).buffers()) == []
    assert "layers.2.self_attn.k_norm.weight" in names and "fc.weight" in names


def test_27b_width_has_published_shape_and_1_73b_parameters():
    cfg = DrafterConfig.for_target(**QWEN36_27B_TARGET)
    assert (cfg.num_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (5, 32, 8, 128)
    # Closed form: fc + 5 x (q, k, v, o, gate/up/down, 4 norms) + 2 norms.
    H, I, qd, kvd = 5120, 17408, 32 * 128, 8 * 128  # noqa: E741 (I: the MLP width, as in the legend)
    layer = H * qd + 2 * H * kvd + qd * H + 3 * H * I + 2 * H + 2 * 128
    expected = 5 * H * H + 5 * layer + 2 * H
    got = count_parameters(cfg)
    assert got == expected
    assert abs(got / 1e9 - 1.73) < 0.01, got


@pytest.mark.parametrize("hidden", [16, 64, 256, 2048, 4096])
def test_for_target_scales_to_other_widths(hidden):
    cfg = drafter_for_target(hidden, 3 * hidden, 100)
    assert cfg.num_attention_heads * cfg.head_dim == hidden
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.head_dim == (128 if hidden >= 1024 else hidden // 8)


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_key_value_heads", 3),
        ("head_dim", 7),
        ("mask_token_id", 97),
        ("tap_layer_ids", [0, 4]),
        ("block_size", 1),
        ("tap_layer_ids", []),
        ("layer_types", ["full_attention"]),
        ("layer_types", ["full", "full"]),
        ("sliding_window", 64),
    ],
)
def test_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field if field != "num_key_value_heads" else "num_attention_heads"):
        tiny_config(**{field: value})


@pytest.mark.parametrize("window", [None, 0, -3, True])
def test_config_sliding_layers_need_a_window(window):
    with pytest.raises(ValueError, match="sliding_window"):
        tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=window)


def test_layout_without_window_refuses_sliding_drafter():
    cfg = tiny_config(**LAYOUTS["sliding_w3"])
    model, head = tiny_model_and_head(cfg)
    batch = make_batch([20, 28], 48, 4, cfg.num_taps, cfg.hidden_size)
    blocks = batch_blocks(batch, num_blocks=4, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id)
    layout = BlockAttentionLayout(num_ctx=48, num_blocks=4, block_size=cfg.block_size).update(
        blocks.seq_start_N, blocks.anchor_N
    )
    with pytest.raises(ValueError, match="sliding_window"):
        model(
            batch["hidden_TKH"], batch["position_ids_T"], head.embed(blocks.block_ids_NB), blocks.block_pos_NB, layout
        )


# ---- float64 naive reference, written from the architecture text ---------------------------------
def ref_rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def ref_rope(x, pos, theta):
    """x [S, heads, D]; rotate pairs (i, i + D/2) by angle pos * theta^(-2i/D)."""
    D = x.shape[-1]
    out = x.clone()
    for s in range(x.shape[0]):
        for i in range(D // 2):
            a = float(pos[s]) * theta ** (-2 * i / D)
            c, si = math.cos(a), math.sin(a)
            x1, x2 = x[s, :, i], x[s, :, i + D // 2]
            out[s, :, i] = x1 * c - x2 * si
            out[s, :, i + D // 2] = x2 * c + x1 * si
    return out


def ref_forward_block(params, cfg, ctx_hidden_LKH, ctx_pos, block_embed_BH, block_pos):
    """One block attending to its whole context and itself, in float64 with explicit softmax loops.
    A sliding layer's query at position p only sees keys at positions p-(W-1) .. p (causal window), or
    p-(W-1) .. p+(W-1) under is_causal false (z-lab's DFlash 2 reference)."""
    P = {k: v.detach().double() for k, v in params.items()}
    eps, N, M, D = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = ref_rms(ctx_hidden_LKH.double().flatten(1) @ P["fc.weight"].T, P["hidden_norm.weight"], eps)
    x = block_embed_BH.double()
    L, B = ctx.shape[0], x.shape[0]
    for i in range(cfg.num_layers):

        def p(n, i=i):
            return P[f"layers.{i}.{n}.weight"]

        h = ref_rms(x, p("input_layernorm"), eps)
        q = ref_rope(
            ref_rms((h @ p("self_attn.q_proj").T).view(B, N, D), p("self_attn.q_norm"), eps), block_pos, cfg.rope_theta
        )
        kv_in = torch.cat([ctx, h])
        kv_pos = torch.cat([ctx_pos, block_pos])
        k = ref_rope(
            ref_rms((kv_in @ p("self_attn.k_proj").T).view(L + B, M, D), p("self_attn.k_norm"), eps),
            kv_pos,
            cfg.rope_theta,
        )
        v = (kv_in @ p("self_attn.v_proj").T).view(L + B, M, D)
        att = torch.zeros(B, N, D, dtype=torch.float64)
        for qi in range(B):
            for head in range(N):
                kvh = head // (N // M)
                scores = [float(q[qi, head] @ k[j, kvh]) / math.sqrt(D) for j in range(L + B)]
                if cfg.layer_types[i] == "sliding_attention":
                    nearest = 0 if cfg.is_causal is not False else 1 - cfg.sliding_window
                    behind = [int(block_pos[qi]) - int(kv_pos[j]) for j in range(L + B)]
                    seen = [nearest <= b < cfg.sliding_window for b in behind]
                    scores = [sc if ok else -math.inf for sc, ok in zip(scores, seen)]
                mx = max(scores)
                ws = [math.exp(s - mx) for s in scores]
                tot = sum(ws)
                for j in range(L + B):
                    att[qi, head] += ws[j] / tot * v[j, kvh]
        x = x + att.reshape(B, N * D) @ p("self_attn.o_proj").T
        h = ref_rms(x, p("post_attention_layernorm"), eps)
        gate = h @ p("mlp.gate_proj").T
        x = x + (gate * torch.sigmoid(gate) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    return ref_rms(x, P["norm.weight"], eps)


SLIDING = "sliding_attention"
LAYOUTS = {
    "full": {},
    "sliding_w3": dict(layer_types=[SLIDING, "full_attention"], sliding_window=3),
    "sliding_w7": dict(layer_types=["full_attention", SLIDING], sliding_window=7),
    "all_sliding_w100": dict(layer_types=[SLIDING, SLIDING], sliding_window=100),
    "bidirectional_w2": dict(layer_types=[SLIDING, "full_attention"], sliding_window=2, is_causal=False),
    "bidirectional_w100": dict(layer_types=[SLIDING, SLIDING], sliding_window=100, is_causal=False),
}


@pytest.mark.parametrize("layers", sorted(LAYOUTS))
def test_forward_block_matches_float64_reference(layers):
    cfg = tiny_config(**LAYOUTS[layers])
    model, head = tiny_model_and_head(cfg)
    g = torch.Generator().manual_seed(5)
    ctx_hidden = torch.randn(6, cfg.num_taps, cfg.hidden_size, generator=g)
    ctx_pos = torch.arange(6)
    block_ids = torch.tensor([5] + [cfg.mask_token_id] * (cfg.block_size - 1))
    block_pos = torch.arange(6, 6 + cfg.block_size)
    with torch.no_grad():
        got = model.forward_block(ctx_hidden, ctx_pos, head.embed(block_ids), block_pos)
    ref = ref_forward_block(dict(model.named_parameters()), cfg, ctx_hidden, ctx_pos, head.embed(block_ids), block_pos)
    diff = (got.double() - ref).abs().max().item()
    assert diff < 1e-4, f"max abs diff {diff}"


@pytest.mark.parametrize("layers", sorted(LAYOUTS))
def test_training_forward_matches_inference_forward_per_block(layers):
    cfg = tiny_config(**LAYOUTS[layers])
    model, head = tiny_model_and_head(cfg)
    batch = make_batch([9, 14, 3, 11], 48, 6, cfg.num_taps, cfg.hidden_size, unsupervised=(20,))
    blocks, layout = blocks_and_layout(cfg, batch, num_blocks=12)
    with torch.no_grad():
        out_NBH = model(
            batch["hidden_TKH"], batch["position_ids_T"], head.embed(blocks.block_ids_NB), blocks.block_pos_NB, layout
        )
        assert out_NBH.shape == (12, cfg.block_size, cfg.hidden_size)
        checked = 0
        for n in range(12):
            s, a = int(blocks.seq_start_N[n]), int(blocks.anchor_N[n])
            one = model.forward_block(
                batch["hidden_TKH"][s:a],
                batch["position_ids_T"][s:a],
                head.embed(blocks.block_ids_NB[n]),
                blocks.block_pos_NB[n],
            )
            diff = (one - out_NBH[n]).abs().max().item()
            assert diff < 1e-5, f"block {n} (context [{s}, {a})): max abs diff {diff}"
            checked += bool(blocks.block_valid_N[n])
        assert checked >= 8


def test_activation_checkpointing_keeps_values_and_grads():
    cfg = tiny_config()
    model, head = tiny_model_and_head(cfg)
    batch = make_batch([9, 14, 3, 11], 48, 6, cfg.num_taps, cfg.hidden_size)
    blocks, layout = blocks_and_layout(cfg, batch, num_blocks=8)
    results = []
    for ckpt in (False, True):
        model.zero_grad(set_to_none=True)
        out = forward_blocks(model, head, batch, blocks, layout, checkpoint_layers=ckpt)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    diff = max((a - b).abs().max().item() for a, b in zip(results[0][1], results[1][1]))
    assert diff < 1e-6, f"grad max abs diff {diff}"


def test_fp32_params_under_bf16_autocast_run_close_to_fp32():
    """The loop trains fp32 master weights under bf16 autocast: the forward must accept it and stay close."""
    cfg = tiny_config()
    model, head = tiny_model_and_head(cfg)
    batch = make_batch([9, 14, 3, 11], 48, 6, cfg.num_taps, cfg.hidden_size)
    blocks, layout = blocks_and_layout(cfg, batch, num_blocks=8)
    args = (batch["hidden_TKH"], batch["position_ids_T"], head.embed(blocks.block_ids_NB), blocks.block_pos_NB, layout)
    with torch.no_grad():
        ref = model(*args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(*args)
    diff = (got.float() - ref).abs().max().item()
    assert diff < 0.1 * ref.abs().max().item(), f"max abs diff {diff}"
