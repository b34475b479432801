"""The decoding walk against a brute-force per-response loop of single-block inference forwards, and
against drafters that are always right (B tokens per step) or always wrong (1 per step)."""

from __future__ import annotations

import pytest
import torch

from shards import ShardReader, decode_hidden, load_target_head
from shards.common.chat_mode import describe_mode
from tests.helpers.drafter import drafter_for_target
from tests.helpers.train import mix_modes, rewrite_shard, tiny_cache
from train.drafter.attention import BlockAttentionLayout
from train.drafter.model import DFlashDrafter, TargetHead
from train.eval.evaluate import evaluate_drafter
from train.eval.tree import tree_acceptance
from train.eval.walk import WalkCounts, response_spans, walk_shard

VOCAB, B = 8, 4
EDGES = (0, 8, 24)  # context-length buckets that the tiny cache's short sequences reach


def _multi_turn_cache(tmp_path):
    """Tiny random cache over 8 tokens whose supervised runs are cut in two (multi-turn responses)."""
    cache = tiny_cache(tmp_path / "cache", num_batches=2, vocab_size=VOCAB, max_seqs=4)
    for batch_id in (0, 1):

        def edit(t):
            mask = t["loss_mask"]
            for s in range(t["cu_seqlens"].shape[0] - 1):
                a, b = int(t["cu_seqlens"][s]), int(t["cu_seqlens"][s + 1])
                if b - a > 12:
                    mask[(a + b) // 2 : (a + b) // 2 + 2] = 0  # a user turn in the middle

        rewrite_shard(cache, batch_id, edit)
    return cache


def _confident_drafter(seed: int = 0) -> DFlashDrafter:
    cfg = drafter_for_target(32, 64, VOCAB, num_layers=1, block_size=B)
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg).double()
    with torch.no_grad():
        model.norm.weight.mul_(20)  # confident argmaxes over 8 tokens: some drafts are right by chance
    return model


def brute_force_walk(model, head, t, budget=None) -> WalkCounts:
    """Every response walked alone: one inference forward per step over its own sequence's prefix; each
    step also counted in the EDGES bucket of its anchor's position."""
    ids, mask, pos = t["input_ids"].long().tolist(), t["loss_mask"].tolist(), t["position_ids"].long()
    hidden = decode_hidden(t["hidden"]).double()
    cu = t["cu_seqlens"].tolist()
    counts = WalkCounts(B, context_edges=EDGES)
    for s0, s1 in zip(cu[:-1], cu[1:]):
        runs, t0 = [], None
        for i in range(s0, s1 + 1):
            on = i < s1 and mask[i] == 1
            if on and t0 is None:
                t0 = i
            if not on and t0 is not None:
                runs.append((t0, i - 1))
                t0 = None
        for first, last in runs:
            if last == first:
                continue
            p, tokens, steps = first, 0, 0
            while p < last:
                block = torch.tensor([ids[p]] + [model.config.mask_token_id] * (B - 1))
                with torch.no_grad():
                    out = model.forward_block(hidden[s0:p], pos[s0:p], head.embed(block), pos[p] + torch.arange(B))
                logits = model.draft_logits(out[1:], head).float()
                labels = [ids[p + k] if p + k <= last else -1 for k in range(1, B)]
                valid = [p + k <= last for k in range(1, B)]
                if budget is None:
                    pred, a = _chain(model, head, out[1:], logits, ids[p]), 0
                    while a < B - 1 and valid[a] and pred[a] == labels[a]:
                        a += 1
                else:
                    lp, top = torch.log_softmax(logits, -1).topk(min(budget, VOCAB), -1)
                    a = tree_acceptance(lp.tolist(), top.tolist(), labels, valid, budget) - 1
                counts.add_step(a, sum(valid))
                bucket = max(i for i, edge in enumerate(EDGES) if int(pos[p]) >= edge)
                counts.context_steps[bucket] += 1
                counts.context_tokens[bucket] += min(a + 1, last - p)
                tokens += min(a + 1, last - p)
                steps += 1
                p += a + 1
            counts.add_response(tokens, steps)
    return counts


@torch.no_grad()
def _chain(model, head, out_SH, logits_SV, anchor_id) -> list[int]:
    """The chain's drafts: the argmaxes, or for DFlash 2 the selector's greedy walk, one slot and one
    candidate at a time (score = unary + sum_r P[prev, r] (W h)_r S[c, r])."""
    if not model.config.is_dflash2:
        return logits_SV.argmax(-1).tolist()
    sel = model.candidate_selector
    prev, path = anchor_id, []
    for s in range(logits_SV.shape[0]):
        projected = sel.hidden_projection.weight @ out_SH[s]
        candidates = logits_SV[s].topk(model.config.selector_top_k).indices.tolist()
        scores = {
            c: float(logits_SV[s, c])
            + float((sel.predecessor_codebook[prev] * projected * sel.successor_codebook[c]).sum())
            for c in candidates
        }
        prev = max(candidates, key=scores.get)
        path.append(prev)
    return path


def _slot_states(model, head, t):
    """(slot states, draft logits, anchor id) of one block at the shard's first supervised token."""
    p = int(t["loss_mask"].nonzero()[0])
    pos = t["position_ids"].long()
    block = torch.tensor([int(t["input_ids"][p])] + [model.config.mask_token_id] * (B - 1))
    with torch.no_grad():
        out = model.forward_block(
            decode_hidden(t["hidden"]).double()[:p], pos[:p], head.embed(block), pos[p] + torch.arange(B)
        )
    return out[1:], model.draft_logits(out[1:], head), int(block[0])


def _walk(model, head, t, layout, budget=None, dtype=torch.float64) -> WalkCounts:
    """walk_shard over one shard's tensors, its context K/V computed once as evaluate_drafter does."""
    with torch.no_grad():
        context = model.context(decode_hidden(t["hidden"]), t["position_ids"], dtype)
    spans = response_spans(t["loss_mask"], t["cu_seqlens"])
    return walk_shard(
        model, head, context, t["input_ids"], t["position_ids"], spans, layout, budget=budget, context_edges=EDGES
    )


# sdpa: the CPU round (only the busy lanes); flex (eager on CPU): the GPU's fixed-shape round of all lanes.
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    "budget,lanes,backend", [(None, 2, "sdpa"), (None, 8, "sdpa"), (3, 2, "sdpa"), (None, 4, "flex"), (3, 4, "flex")]
)
def test_walk_equals_brute_force_per_response_loop(tmp_path, budget, lanes, backend):
    cache = _multi_turn_cache(tmp_path)
    model = _confident_drafter()
    head_t = load_target_head(cache)
    head = TargetHead(head_t["embed_tokens"].double(), head_t["lm_head"].double())
    reader = ShardReader(cache)
    T = reader.config.token_budget
    total = WalkCounts(B, context_edges=EDGES)
    want = WalkCounts(B, context_edges=EDGES)
    for batch_id in (0, 1):
        t, _ = reader.read(batch_id)
        layout = BlockAttentionLayout(
            num_ctx=T, num_blocks=lanes, block_size=B, backend=backend, tile_size=8, compile_flex=False
        )
        got = _walk(model, head, t, layout, budget)
        ref = brute_force_walk(model, head, t, budget)
        assert got.as_vector() == pytest.approx(ref.as_vector(), abs=1e-9), f"batch {batch_id}"
        total = WalkCounts.from_vector(B, [a + b for a, b in zip(total.as_vector(), got.as_vector())], EDGES)
        want = WalkCounts.from_vector(B, [a + b for a, b in zip(want.as_vector(), ref.as_vector())], EDGES)
    assert total.responses > 4, "the cache should hold several (multi-turn) responses"
    assert all(total.context_steps), f"every context bucket needs steps to mean anything: {total.context_steps}"
    assert sum(total.context_steps) == total.steps and sum(total.context_tokens) == total.tokens
    assert sum(total.accepted_histogram[1:]) > 0, "the test needs some accepted drafts to mean anything"
    assert total.tokens == sum(
        r.last - r.first
        for b in (0, 1)
        for r in response_spans(reader.read(b)[0]["loss_mask"], reader.read(b)[0]["cu_seqlens"])
    )


MODES = [{"thinking": "on", "template_kwargs": {}}, {"thinking": "off", "template_kwargs": {}}]
MODES.append({"thinking": "on", "template_kwargs": {"reasoning_effort": "low"}})


def test_acceptance_per_mode_equals_a_brute_force_walk_of_each_modes_samples(tmp_path):
    cache = mix_modes(_multi_turn_cache(tmp_path), MODES)
    model = _confident_drafter()
    head_t = load_target_head(cache)
    head = TargetHead(head_t["embed_tokens"].double(), head_t["lm_head"].double())
    reader = ShardReader(cache)
    result = evaluate_drafter(model, head, str(cache), [0, 1], budgets=(3,), context_edges=EDGES)
    for walk, budget in ((result.walk, None), (result.tree_walks[3], 3)):
        for m, mode in enumerate(MODES):
            # The reference: the brute-force walk over the shards with every other mode's supervision removed
            # (a sequence's context is its own prefix, so the others do not change it).
            want = WalkCounts(B, context_edges=EDGES)
            for b in (0, 1):
                t, info = reader.read(b)
                t = dict(t)
                t["loss_mask"] = t["loss_mask"].clone()
                cu = t["cu_seqlens"].tolist()
                for i, s in enumerate(info.samples):
                    if s.mode != m:
                        t["loss_mask"][cu[i] : cu[i + 1]] = 0
                ref = brute_force_walk(model, head, t, budget)
                want = WalkCounts.from_vector(B, [x + y for x, y in zip(want.as_vector(), ref.as_vector())], EDGES)
            value, pooled, responses = walk.acceptance_by_mode[describe_mode(mode)]
            assert want.responses > 0 and responses == want.responses, (budget, m)
            assert value == pytest.approx(want.acceptance_length, abs=1e-12), (budget, m)
            assert pooled == pytest.approx(want.acceptance_length_pooled, abs=1e-12), (budget, m)
    figures = result.to_dict()
    assert set(figures["acceptance_by_mode"]) == {describe_mode(m) for m in MODES}
    assert 'thinking on, reasoning_effort="low"' in result.table() and "by serving mode" in result.table()
    record = result.to_record()
    assert "eval/acceptance_length_mode_thinking_on,reasoning_effort=low" in record
    assert "by mode thinking on" in result.summary_line()


def test_a_cache_of_one_mode_reports_no_per_mode_split(tmp_path):
    cache = _multi_turn_cache(tmp_path)
    head_t = load_target_head(cache)
    head = TargetHead(head_t["embed_tokens"].double(), head_t["lm_head"].double())
    result = evaluate_drafter(_confident_drafter(), head, str(cache), [0, 1], budgets=(), context_edges=EDGES)
    assert result.walk.acceptance_by_mode == {} and "acceptance_by_mode" not in result.to_dict()
    assert "by serving mode" not in result.table() and "by mode" not in result.summary_line()
    assert not any("_mode_" in key for key in result.to_record())


class _Recomputing(DFlashDrafter):
    """The walk as it ran before the context cache: every round recomputes the fused context and every
    layer's context K/V from the tapped states (the training forward); records how far the cached
    round (DFlashDrafter.forward_cached over the shard's ContextKV) is from it."""

    max_abs_diff, rounds = 0.0, 0

    def context(self, hidden_TKH, position_ids_T, dtype):
        return hidden_TKH.to(dtype), position_ids_T, super().context(hidden_TKH, position_ids_T, dtype)

    def forward_cached(self, context, block_embed_NBH, block_pos_NB, layout):
        hidden_TKH, position_ids_T, cached = context
        out = self(hidden_TKH, position_ids_T, block_embed_NBH, block_pos_NB, layout)
        diff = (super().forward_cached(cached, block_embed_NBH, block_pos_NB, layout) - out).abs().max().item()
        self.max_abs_diff, self.rounds = max(self.max_abs_diff, diff), self.rounds + 1
        return out


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("budget,backend", [(None, "sdpa"), (3, "sdpa"), (None, "flex")])
def test_cached_context_walk_equals_recomputing_walk_in_fp32(tmp_path, budget, backend):
    cache = _multi_turn_cache(tmp_path)
    model = _confident_drafter().float()
    uncached = _Recomputing(model.config)
    uncached.load_state_dict(model.state_dict())
    head_t = load_target_head(cache)
    head = TargetHead(head_t["embed_tokens"].float(), head_t["lm_head"].float())
    reader = ShardReader(cache)
    for batch_id in (0, 1):
        t, _ = reader.read(batch_id)

        def layout():
            return BlockAttentionLayout(
                num_ctx=reader.config.token_budget,
                num_blocks=4,
                block_size=B,
                backend=backend,
                tile_size=8,
                compile_flex=False,
            )

        got = _walk(model, head, t, layout(), budget, torch.float32)
        want = _walk(uncached, head, t, layout(), budget, torch.float32)
        assert got.as_vector() == want.as_vector(), f"batch {batch_id}"
        assert sum(got.accepted_histogram[1:]) > 0, "the test needs some accepted drafts to mean anything"
    assert uncached.rounds > 10 and uncached.max_abs_diff <= 1e-5, f"cached vs recomputed: {uncached.max_abs_diff}"


class _Oracle(torch.nn.Module):
    """A drafter that reads the answer (right=True) or its successor (right=False) from the packed ids:
    one-hot rows through an identity lm_head."""

    def __init__(self, input_ids_T, right: bool):
        super().__init__()
        # Only the walk reads the config (block size, MASK id); the forward below is the oracle.
        self.config = drafter_for_target(
            VOCAB, 8, VOCAB, num_layers=1, block_size=B, tap_layer_ids=[1], num_target_layers=4
        )
        self.ids, self.right = input_ids_T.long(), right

    def context(self, hidden_TKH, position_ids_T, dtype):
        return None  # reads the answer from the ids, needs no context

    def forward_cached(self, context, block_embed_NBH, block_pos_NB, layout):
        index_NB = (layout.anchor_N.long().unsqueeze(1) + torch.arange(B)).clamp(max=self.ids.shape[0] - 1)
        tokens_NB = self.ids[index_NB] if self.right else (self.ids[index_NB] + 1) % VOCAB
        return torch.nn.functional.one_hot(tokens_NB, VOCAB).float()


@pytest.mark.parametrize("right", [True, False])
def test_always_right_gives_block_size_and_always_wrong_gives_one(tmp_path, right):
    cache = _multi_turn_cache(tmp_path)
    reader = ShardReader(cache)
    t, _ = reader.read(0)
    head = TargetHead(torch.eye(VOCAB), torch.eye(VOCAB))
    responses = response_spans(t["loss_mask"], t["cu_seqlens"])
    layout = BlockAttentionLayout(num_ctx=reader.config.token_budget, num_blocks=2, block_size=B, backend="sdpa")
    got = _walk(_Oracle(t["input_ids"], right), head, t, layout)
    if not right:
        assert got.acceptance_length == got.acceptance_length_pooled == 1.0
        assert got.accepted_histogram[0] == got.steps
        return
    # Every step but a response's last yields B tokens; the last one what is left.
    steps = [-(-(r.last - r.first) // B) for r in responses]
    assert got.steps == sum(steps)
    assert got.acceptance_length == pytest.approx(
        sum((r.last - r.first) / n for r, n in zip(responses, steps)) / len(responses)
    )
    assert got.accepted_histogram[B - 1] >= got.steps - len(responses)
    assert got.slot_acceptance == [1.0] * (B - 1)
    full = [r for r in responses if (r.last - r.first) % B == 0]
    assert full, "the test needs a response whose length is a multiple of B"


def _buckets(counts: WalkCounts) -> tuple[list[int], list[int]]:
    assert all(counts.context_steps), f"every bucket needs steps to mean anything: {counts.context_steps}"
    return counts.context_steps, counts.context_tokens


def test_evaluate_drafter_reports_the_walk_and_the_diagnostics(tmp_path):
    cache = _multi_turn_cache(tmp_path)
    model = _confident_drafter()
    head_t = load_target_head(cache)
    head = TargetHead(head_t["embed_tokens"].double(), head_t["lm_head"].double())
    res = evaluate_drafter(model, head, str(cache), [0, 1], num_blocks=16, budgets=(3,), lanes=4, context_edges=EDGES)
    reader = ShardReader(cache)
    want = WalkCounts(B, context_edges=EDGES)
    for b in (0, 1):
        ref = brute_force_walk(model, head, reader.read(b)[0])
        want = WalkCounts.from_vector(B, [x + y for x, y in zip(want.as_vector(), ref.as_vector())], EDGES)
    assert res.acceptance_length == pytest.approx(want.acceptance_length, abs=1e-12)
    # Per context bucket: the brute-force walk's tokens / steps of the steps anchored there.
    by_context = {label: tokens / steps for label, steps, tokens in zip(("0-8", "8-24", "24+"), *_buckets(want))}
    assert res.to_dict()["acceptance_by_context"] == pytest.approx(by_context, abs=1e-12)
    assert res.to_record()["eval/acceptance_length_ctx_8-24"] == pytest.approx(by_context["8-24"], abs=1e-12)
    assert "anchors at     8-24" in res.table() and f"8-24 {by_context['8-24']:.3f}" in res.summary_line()
    assert res.acceptance_length_pooled == pytest.approx(want.acceptance_length_pooled, abs=1e-12)
    assert res.tree_acceptance[3] >= res.acceptance_length
    assert res.data_is_target_greedy is None and "agreement with the data" in res.whose_tokens()
    d = res.to_dict()
    assert d["batch_ids"] == [0, 1] and d["dtype"] == "float64"
    assert res.heldout_loss > 0 and res.random_anchor_chain_length >= 1.0


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("lanes,backend", [(2, "sdpa"), (4, "flex")])
def test_a_dflash2_walk_drafts_the_selector_path(tmp_path, lanes, backend):
    """DFlash 2 (convolutions and selector away from their inert start): the walk equals the loop."""
    cache = _multi_turn_cache(tmp_path)
    cfg = drafter_for_target(
        32, 64, VOCAB, num_layers=1, block_size=B, arch="dflash2", selector_top_k=4, sliding_window=5
    )
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).double()
    with torch.no_grad():
        model.norm.weight.mul_(20)
        for name, p in model.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.add_(torch.randn_like(p))
    head_t = load_target_head(cache)
    head = TargetHead(head_t["embed_tokens"].double(), head_t["lm_head"].double())
    reader = ShardReader(cache)
    t, _ = reader.read(0)
    layout = BlockAttentionLayout(
        num_ctx=reader.config.token_budget,
        num_blocks=lanes,
        block_size=B,
        backend=backend,
        tile_size=8,
        compile_flex=False,
        sliding_window=cfg.attention_window,
    )
    got, ref = _walk(model, head, t, layout), brute_force_walk(model, head, t)
    assert got.as_vector() == pytest.approx(ref.as_vector(), abs=1e-9)
    assert sum(got.accepted_histogram[1:]) > 0
    # The selector matters here: the unary argmax chain walks differently.
    plain = DFlashDrafter(cfg.replace(arch="dflash")).double()
    plain.load_state_dict(model.state_dict(), strict=False)
    assert _chain(model, head, *_slot_states(model, head, t)) != _chain(plain, head, *_slot_states(model, head, t))
