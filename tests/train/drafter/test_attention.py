"""Block attention mask and backends (train/drafter/attention.py) against masks built with plain loops."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.drafter import random_ranges, ranges_at_sequence_starts
from train.drafter.attention import BlockAttentionLayout, block_attention, block_mask_dense


def loop_mask(seq_start, anchor, num_ctx, block_size, window=None, causal=True):
    """Pair by pair. A sliding layer (window W) is a causal window over positions: the query at
    position p sees a visible key at position p' iff 0 <= p - p' <= W - 1 (context token j sits at
    position j relative to its sequence, block slot s at anchor + s, the query of slot k at anchor + k).
    A non-causal one (config.json is_causal false; z-lab's _attention_mask): iff |p - p'| <= W - 1."""
    nearest = 0 if causal else -(window - 1) if window else 0
    nb = len(anchor)
    rows = []
    for q in range(nb * block_size):
        n, k = divmod(q, block_size)
        row = []
        for j in range(num_ctx + nb * block_size):
            ctx = seq_start[n] <= j < anchor[n]
            own = num_ctx + n * block_size <= j < num_ctx + (n + 1) * block_size
            if window is not None:
                key_pos = j if j < num_ctx else anchor[n] + (j - num_ctx) % block_size
                query_pos = anchor[n] + k
                ctx = ctx and nearest <= query_pos - key_pos <= window - 1
                own = own and nearest <= query_pos - key_pos <= window - 1
            row.append(bool(ctx or own))
        rows.append(row)
    return torch.tensor(rows)


# Windows: one token, shorter than the block, the block, between, far larger than any context.
WINDOWS = [None, 1, 3, 4, 9, 10_000]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_mask_matches_loops(seed):
    num_ctx, nb, bs = 37, 6, 4
    seq_start, anchor = random_ranges(num_ctx, nb, seed)
    got = block_mask_dense(seq_start, anchor, num_ctx=num_ctx, block_size=bs)
    assert torch.equal(got, loop_mask(seq_start.tolist(), anchor.tolist(), num_ctx, bs))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("ranges", [random_ranges, ranges_at_sequence_starts])
def test_dense_mask_with_windows_matches_loops(seed, window, ranges, causal):
    num_ctx, nb, bs = 37, 6, 4
    seq_start, anchor = ranges(num_ctx, nb, seed)
    got = block_mask_dense(seq_start, anchor, num_ctx=num_ctx, block_size=bs, sliding_window=window, causal=causal)
    want = loop_mask(seq_start.tolist(), anchor.tolist(), num_ctx, bs, window, causal)
    assert torch.equal(got, want)
    assert want.any(1).all(), "every query must see at least itself"


def test_window_larger_than_context_is_causal_full_context():
    num_ctx, nb, bs = 37, 6, 4
    seq_start, anchor = random_ranges(num_ctx, nb, 3)
    full = block_mask_dense(seq_start, anchor, num_ctx=num_ctx, block_size=bs)
    wide = block_mask_dense(seq_start, anchor, num_ctx=num_ctx, block_size=bs, sliding_window=10_000)
    assert torch.equal(wide[:, :num_ctx], full[:, :num_ctx])  # the whole context before the anchor
    own = full[:, num_ctx:] & ~wide[:, num_ctx:]  # what the causal block hides: later slots only
    slot_q, slot_k = torch.arange(nb * bs).view(-1, 1) % bs, torch.arange(nb * bs).view(1, -1) % bs
    assert torch.equal(own, full[:, num_ctx:] & (slot_k > slot_q))


def ordered_to_set(num, idx):
    return {(i, int(idx[i, c])) for i in range(num.shape[0]) for c in range(int(num[i]))}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(
    "seed,num_ctx,ranges",
    [
        (0, 37, random_ranges),
        (1, 40, random_ranges),
        (2, 61, random_ranges),
        (3, 61, ranges_at_sequence_starts),
        (4, 200, random_ranges),
    ],
)
def test_flex_block_mask_tiles_match_loops(seed, num_ctx, ranges, window, causal):
    nb, bs, tile = 8, 4, 8
    seq_start, anchor = ranges(num_ctx, nb, seed)
    layout = BlockAttentionLayout(
        num_ctx=num_ctx,
        num_blocks=nb,
        block_size=bs,
        backend="flex",
        tile_size=tile,
        sliding_window=window,
        sliding_causal=causal,
    )
    layout.update(seq_start, anchor)
    flex = layout.flex_mask(sliding=window is not None)
    bm, mask_mod = flex.block_mask, flex.mask_mod
    dense = loop_mask(seq_start.tolist(), anchor.tolist(), num_ctx, bs, window, causal)
    nq, nkv = bm.kv_indices.shape[-2:]
    partial = ordered_to_set(bm.kv_num_blocks[0, 0], bm.kv_indices[0, 0])
    full = ordered_to_set(bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0])
    assert not partial & full
    for i in range(nq):
        for j in range(nkv):
            tile_mask = dense[i * tile : (i + 1) * tile, j * tile : (j + 1) * tile]
            ragged = tile_mask.shape[1] < tile
            if (i, j) in full:
                assert tile_mask.all() and not ragged, f"tile {(i, j)} marked full but not all visible"
            elif tile_mask.any():
                assert (i, j) in partial, f"tile {(i, j)} has visible keys but is skipped"
            else:
                assert (i, j) not in partial, f"tile {(i, j)} has no visible key but is visited"
    # The backward pass walks the transpose: it must list the same tiles.
    q_partial = {(i, j) for j, i in ordered_to_set(bm.q_num_blocks[0, 0], bm.q_indices[0, 0])}
    q_full = {(i, j) for j, i in ordered_to_set(bm.full_q_num_blocks[0, 0], bm.full_q_indices[0, 0])}
    assert q_partial == partial and q_full == full
    # mask_mod, evaluated element-wise, is the same rule.
    q_idx = torch.arange(nb * bs).view(-1, 1)
    kv_idx = torch.arange(num_ctx + nb * bs).view(1, -1)
    assert torch.equal(mask_mod(0, 0, q_idx, kv_idx), dense)


def test_sliding_flex_mask_skips_tiles_outside_the_window():
    """Long sequences: the sliding mask visits a bounded number of kv tiles per query tile."""
    num_ctx, nb, bs, tile, window = 4096, 64, 16, 128, 256
    anchor = torch.sort(torch.randperm(num_ctx - 1, generator=torch.Generator().manual_seed(0))[:nb] + 1).values
    seq_start = torch.zeros(nb, dtype=torch.int32)  # one long sequence
    layout = BlockAttentionLayout(
        num_ctx=num_ctx, num_blocks=nb, block_size=bs, backend="flex", tile_size=tile, sliding_window=window
    )
    layout.update(seq_start, anchor.int())
    visited = {}
    for sliding in (False, True):
        bm = layout.flex_mask(sliding).block_mask
        visited[sliding] = (bm.kv_num_blocks + bm.full_kv_num_blocks)[0, 0]
    # A q tile holds 8 consecutive anchors; its window reaches (W-1) before the first of them.
    span_I = anchor.view(-1, tile // bs)[:, -1] - anchor.view(-1, tile // bs)[:, 0]
    bound_I = (span_I + window - 1) // tile + 2 + 1  # context tiles (+ straddling) + the tile of its own blocks
    assert (visited[True] <= bound_I).all(), (visited[True], bound_I)
    assert visited[True].sum() < visited[False].sum() / 2, (visited[True].sum(), visited[False].sum())


def test_update_reuses_tensors():
    num_ctx, nb, bs = 40, 8, 4
    layout = BlockAttentionLayout(num_ctx=num_ctx, num_blocks=nb, block_size=bs, backend="flex", tile_size=8)
    ptrs = [t.data_ptr() for t in (layout.block_mask.kv_indices, layout.block_mask.q_indices, layout.seq_start_N)]
    for seed in range(2):
        layout.update(*random_ranges(num_ctx, nb, seed))
    assert ptrs == [
        t.data_ptr() for t in (layout.block_mask.kv_indices, layout.block_mask.q_indices, layout.seq_start_N)
    ]


def attend_reference(q, k, v, mask):
    return F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True
    )[0].transpose(0, 1)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 3, 9, 10_000])
def test_flex_eager_matches_sdpa_on_cpu(window):
    num_ctx, nb, bs = 45, 8, 4
    seq_start, anchor = ranges_at_sequence_starts(num_ctx, nb, 5)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(nb * bs, 4, 8, generator=g)
    k, v = torch.randn(2, num_ctx + nb * bs, 2, 8, generator=g)
    dense = BlockAttentionLayout(num_ctx=num_ctx, num_blocks=nb, block_size=bs, sliding_window=window)
    flex = BlockAttentionLayout(
        num_ctx=num_ctx,
        num_blocks=nb,
        block_size=bs,
        backend="flex",
        tile_size=8,
        compile_flex=False,
        sliding_window=window,
    )
    ref = attend_reference(q, k, v, loop_mask(seq_start.tolist(), anchor.tolist(), num_ctx, bs, window))
    with torch.no_grad():  # eager flex on CPU has no backward
        for layout in (dense.update(seq_start, anchor), flex.update(seq_start, anchor)):
            diff = (block_attention(q, k, v, layout, sliding=window is not None) - ref).abs().max().item()
            assert diff < 1e-5, f"{layout.backend}: max abs diff {diff}"


def test_flex_rejects_partial_query_tiles():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAttentionLayout(num_ctx=40, num_blocks=9, block_size=4, backend="flex", tile_size=8)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "window,causal", [(None, True), (7, True), (300, True), (100_000, True), (7, False), (300, False)]
)
def test_flex_compiled_matches_dense_bf16_forward_backward(window, causal):
    device = "cuda"
    num_ctx, nb, bs, heads, kv_heads, dim = 3000, 64, 16, 8, 2, 128
    seq_start, anchor = ranges_at_sequence_starts(num_ctx, nb, 7)
    seq_start, anchor = seq_start.to(device), anchor.to(device)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(nb * bs, heads, dim, device=device, generator=g, dtype=torch.bfloat16)
    k, v = torch.randn(2, num_ctx + nb * bs, kv_heads, dim, device=device, generator=g, dtype=torch.bfloat16)
    grad_out = torch.randn_like(q)
    flex = BlockAttentionLayout(
        num_ctx=num_ctx,
        num_blocks=nb,
        block_size=bs,
        backend="flex",
        device=device,
        sliding_window=window,
        sliding_causal=causal,
    )
    flex.update(seq_start, anchor)
    mask = block_mask_dense(seq_start, anchor, num_ctx=num_ctx, block_size=bs, sliding_window=window, causal=causal)
    results = []
    for fn in (
        lambda a, b, c: block_attention(a, b, c, flex, sliding=window is not None),
        lambda a, b, c: attend_reference(a.float(), b.float(), c.float(), mask),
    ):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad_out.to(out.dtype))
        results.append([out.float()] + [t.grad.float() for t in leaves])
    for name, got, ref in zip(("out", "dq", "dk", "dv"), *results):
        diff = (got - ref).abs().max().item()
        assert diff < 3e-2 * max(1.0, ref.abs().max().item()), f"{name}: max abs diff {diff}"


def test_compiled_flex_runs_with_a_raised_recompile_limit_and_fails_loudly(monkeypatch):
    # The H200 run hit dynamo's default limit of 8 entries for flex_attention and silently ran eager
    # (math) flex. The compiled flex must run with a higher limit and with the limit made an error.
    from torch._dynamo import config as dynamo_config

    import train.drafter.attention as attention

    seen = {}

    def fake_compile(fn, dynamic=None):
        def run(*args, **kwargs):
            for name in ("recompile_limit", "cache_size_limit", "fail_on_recompile_limit_hit"):
                if hasattr(dynamo_config, name):
                    seen[name] = getattr(dynamo_config, name)
            return "ran"

        return run

    monkeypatch.setattr(attention, "_compiled_flex", None)
    monkeypatch.setattr(torch, "compile", fake_compile)
    before = {
        name: getattr(dynamo_config, name)
        for name in ("recompile_limit", "cache_size_limit", "fail_on_recompile_limit_hit")
        if hasattr(dynamo_config, name)
    }
    assert attention._get_compiled_flex()() == "ran"
    limit = seen.get("recompile_limit", seen.get("cache_size_limit"))
    assert limit is not None and limit >= attention.FLEX_RECOMPILE_LIMIT >= 32
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        assert seen["fail_on_recompile_limit_hit"] is True
    assert {name: getattr(dynamo_config, name) for name in before} == before  # restored after the call


def attention_loop_float64(q, k, v, seq_start, anchor, num_ctx, block_size, window, causal):
    """Softmax attention written out query by query in float64, visibility decided from positions alone
    (key j of the context at position j, block slot s at anchor + s; the query of slot k at anchor + k):
    context keys of its own sequence before the anchor, its own block's keys, and of both only those with
    |query pos - key pos| <= W - 1 and (causal) key pos <= query pos."""
    q, k, v = q.double(), k.double(), v.double()
    num_heads, num_kv = q.shape[1], k.shape[1]
    out = torch.zeros_like(q)
    for qi in range(q.shape[0]):
        n, slot = divmod(qi, block_size)
        query_pos = anchor[n] + slot
        keys = [j for j in range(seq_start[n], anchor[n])]
        keys += [num_ctx + n * block_size + s for s in range(block_size)]
        visible = []
        for j in keys:
            key_pos = j if j < num_ctx else anchor[n] + (j - num_ctx) % block_size
            behind = query_pos - key_pos
            if behind <= window - 1 and (behind >= 0 if causal else behind >= -(window - 1)):
                visible.append(j)
        for h in range(num_heads):
            kv_head = h // (num_heads // num_kv)
            scores = [float(q[qi, h] @ k[j, kv_head]) / q.shape[-1] ** 0.5 for j in visible]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for w, j in zip(weights, visible, strict=True):
                out[qi, h] += w / total * v[j, kv_head]
    return out


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [2, 5, 64])
def test_bidirectional_sliding_attention_matches_a_float64_loop(window):
    """is_causal false over sliding layers (published DFlash 2 configs): both backends against the loop,
    and the block is really seen both ways (the causal layer differs from it)."""
    num_ctx, nb, bs = 45, 8, 4
    seq_start, anchor = ranges_at_sequence_starts(num_ctx, nb, 2)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(nb * bs, 4, 8, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, num_ctx + nb * bs, 2, 8, generator=g, dtype=torch.float64)
    want = attention_loop_float64(q, k, v, seq_start.tolist(), anchor.tolist(), num_ctx, bs, window, causal=False)
    causal = attention_loop_float64(q, k, v, seq_start.tolist(), anchor.tolist(), num_ctx, bs, window, causal=True)
    assert (want - causal).abs().max() > 1e-3, "the bidirectional block must differ from the causal one"
    common = dict(num_ctx=num_ctx, num_blocks=nb, block_size=bs, sliding_window=window, sliding_causal=False)
    dense = BlockAttentionLayout(**common)
    flex = BlockAttentionLayout(**common, backend="flex", tile_size=8, compile_flex=False)
    with torch.no_grad():
        for layout in (dense.update(seq_start, anchor), flex.update(seq_start, anchor)):
            got = block_attention(q.float(), k.float(), v.float(), layout, sliding=True).double()
            diff = (got - want).abs().max().item()
            assert diff < 1e-5, f"{layout.backend}: max abs diff {diff}"
