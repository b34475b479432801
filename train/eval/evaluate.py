"""Held-out evaluation of a drafter: the decoding walk (the headline), DDTree along the walk, the
held-out loss and the random-anchor diagnostics (what `dflash-train eval` decides before it runs:
train/eval/run.py).

Three acceptance figures, and when each is exact (docs/GUIDE.md says the same for users):
  acceptance_length            the decoding walk (train/eval/walk.py): anchors where greedy speculative
                               decoding puts them, averaged per response. Equal to real decoding's
                               acceptance when the data are the target's own greedy output.
  tree_acceptance[budget]      the same walk with DDTree verification at `budget` nodes.
  random_anchor_chain_length   a diagnostic, never "acceptance": blocks at random supervised anchors
                               (as training samples them), pooled over blocks. It overstates decoding,
                               which anchors right after each rejection, where the drafter is weakest.
Real decoding with the target in the loop is train/eval/speculative.py (`eval --target`).

Whose tokens: acceptance is agreement with the *target's* greedy choice. When the cache stores the
target's top-k, `data_is_target_greedy` = P(data token == target top-1) over supervised positions;
without it the figures are agreement with the data.

One number per set of weights: the drafter is evaluated with its weights and activations in one
dtype (default: the training compute dtype), no autocast, so a run's in-training eval (a copy of the
fp32 master weights rounded to that dtype), `eval` on its checkpoint and `eval` on its bf16 export
read the same weights and give the same figures.

Every rank takes every world_size-th shard; counts are summed across ranks before dividing.

Legend: T token budget, K taps, H hidden, NB blocks, B block size, S = B-1 draft slots, V vocab.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shards import ShardReader, decode_context
from shards.common.chat_mode import describe_mode
from shards.common.progress import format_figure
from train.blocks import anchor_seed, default_num_blocks, sample_shard_blocks
from train.drafter.attention import BlockAttentionLayout
from train.drafter.model import DFlashDrafter, TargetHead
from train.eval.config import CONTEXT_BUCKETS
from train.eval.tree import tree_acceptance  # noqa: F401  (re-exported: the DDTree rule lives in train/eval/tree.py)
from train.eval.walk import WalkCounts, response_spans, walk_shard
from train.loss.chunked import block_loss
from train.loss.config import LossConfig
from train.metrics.block_metrics import accepted_prefix_length
from train.metrics.sums import COUNT, Sums

log = logging.getLogger(__name__)


def cache_mode(cache_cfg) -> str | None:
    """The serving mode a cache's chats were rendered in (cache.json chat_mode), as the flags say it
    ("thinking off, reasoning_effort=\"high\""); None for token rows given as they are. A cache of several
    modes (chat_modes) names them all: the walk reports acceptance per mode then (mode_names)."""
    if cache_cfg.chat_modes is not None:
        return " | ".join(mode_names(cache_cfg))
    mode = cache_cfg.chat_mode
    return None if mode is None else describe_mode(mode)


def mode_names(cache_cfg) -> tuple[str, ...]:
    """The described modes a sample's mode index points into (CacheConfig.modes)."""
    return tuple(describe_mode(m) for m in cache_cfg.modes)


def mode_tag(name: str) -> str:
    """A described mode as a metrics key's suffix: `thinking on, reasoning_effort="low"` -> `thinking_on,reasoning_effort=low`."""
    return name.replace(", ", ",").replace(" ", "_").replace('"', "")


@dataclass
class EvalResult:
    dtype: str  # weights and activations of the evaluation
    walk: WalkCounts  # the decoding walk, greedy chain
    tree_walks: dict[int, WalkCounts]  # node budget -> the decoding walk with DDTree verification
    heldout_loss: float  # training CE (same decay weights) at random anchors, mean over shards
    random_anchor_chain_length: float  # diagnostic: chain acceptance (+1) of random-anchor blocks, pooled
    random_anchor_slot_accuracy: list[float]  # diagnostic: top-1 accuracy of slots 1..B-1 at random anchors
    num_blocks: int  # valid random-anchor blocks
    data_is_target_greedy: float | None  # P(data == target top-1) on supervised positions; None: no top-k
    batch_ids: list[int] = field(default_factory=list)
    mode: str | None = None  # how the cache's chats were rendered (cache_mode); None: token rows as given

    @property
    def acceptance_length(self) -> float:
        return self.walk.acceptance_length

    @property
    def acceptance_length_pooled(self) -> float:
        return self.walk.acceptance_length_pooled

    @property
    def tree_acceptance(self) -> dict[int, float]:
        return {b: w.acceptance_length for b, w in self.tree_walks.items()}

    def to_dict(self) -> dict[str, Any]:
        """The JSON of `eval --out` and OUT/eval.json."""
        w = self.walk
        return {
            **w.figures(),
            "num_responses": w.responses,
            "num_tokens": w.tokens,
            "tree_acceptance": {str(b): t.acceptance_length for b, t in self.tree_walks.items()},
            "tree_acceptance_pooled": {str(b): t.acceptance_length_pooled for b, t in self.tree_walks.items()},
            "heldout_loss": self.heldout_loss,
            "random_anchor_chain_length": self.random_anchor_chain_length,
            "random_anchor_slot_accuracy": self.random_anchor_slot_accuracy,
            "random_anchor_blocks": self.num_blocks,
            "data_is_target_greedy": self.data_is_target_greedy,
            "dtype": self.dtype,
            "batch_ids": self.batch_ids,
            "mode": self.mode,
        }

    def to_record(self) -> dict[str, Any]:
        """Flat, namespaced scalars for metrics.jsonl / TensorBoard."""
        rec = {
            "eval/acceptance_length": self.acceptance_length,
            "eval/acceptance_length_pooled": self.acceptance_length_pooled,
            "eval/heldout_loss": self.heldout_loss,
            "eval/random_anchor_chain_length": self.random_anchor_chain_length,
            **{f"eval/tree_acceptance_{b}": v for b, v in self.tree_acceptance.items()},
            **{f"eval/slot_acceptance_{k:02d}": v for k, v in enumerate(self.walk.slot_acceptance, start=1)},
            # Named under eval/acceptance_length so that `dflash-train plot` draws each bucket's curve.
            **{
                f"eval/acceptance_length_ctx_{label}": value
                for label, (value, steps) in self.walk.acceptance_by_context.items()
                if steps
            },
            # And each mode's, when the cache holds several.
            **{
                f"eval/acceptance_length_mode_{mode_tag(name)}": value
                for name, (value, _, n) in self.walk.acceptance_by_mode.items()
                if n
            },
        }
        if self.data_is_target_greedy is not None:
            rec["eval/data_is_target_greedy"] = self.data_is_target_greedy
        return rec

    def summary_line(self) -> str:
        trees = "".join(f", tree@{b} {format_figure(v, '.3f')}" for b, v in self.tree_acceptance.items())
        return (
            f"acceptance length {format_figure(self.acceptance_length, '.3f')} (decoding walk, "
            f"{self.walk.responses} responses, pooled {format_figure(self.acceptance_length_pooled, '.3f')}{trees}), "
            f"held-out loss {format_figure(self.heldout_loss, '.4f')}, "
            f"random-anchor chain {format_figure(self.random_anchor_chain_length, '.3f')} (diagnostic)"
            + self._context_summary()
            + self._mode_summary()
        )

    def _mode_summary(self) -> str:
        """ ", by mode thinking on 3.10, thinking off 2.75" when the cache holds several modes."""
        seen = [(name, v) for name, (v, _, n) in self.walk.acceptance_by_mode.items() if n]
        return ", by mode " + ", ".join(f"{name} {v:.3f}" for name, v in seen) if seen else ""

    def _context_summary(self) -> str:
        """ ", by context 0-2K 3.10, 2K-8K 2.75" when the walk's steps fall in more than one bucket."""
        seen = [(label, v) for label, (v, steps) in self.walk.acceptance_by_context.items() if steps]
        return ", by context " + ", ".join(f"{label} {v:.3f}" for label, v in seen) if len(seen) > 1 else ""

    def whose_tokens(self) -> str:
        if self.data_is_target_greedy is None:
            return (
                "the cache holds no target top-k, so these figures are agreement with the data: they are the "
                "target's acceptance only when the data are its own greedy output. Measure real decoding "
                "with `dflash-train eval --target DIR --prompts FILE`, or regenerate the data with the target"
            )
        share = self.data_is_target_greedy
        exact = (
            "exact: the data are the target's greedy output"
            if share == 1.0
            else (f"on the other {1 - share:.1%} the figures measure agreement with the data, not acceptance")
        )
        return f"data == target greedy on {share:.1%} of supervised positions ({exact})"

    def table(self, held_out: bool = True) -> str:
        """The figures as printed (undefined ones as `-`). held_out=False: the shards include ones the
        drafter was trained on, and the loss is labelled as such, not as held-out."""
        w = self.walk
        rows = [
            ("acceptance length", format_figure(w.acceptance_length, ".3f")),
            ("  pooled over steps", format_figure(w.acceptance_length_pooled, ".3f")),
            ("  responses / steps", f"{w.responses} / {w.steps}"),
        ]
        rows += [
            (f"tree acceptance @{b}", format_figure(t.acceptance_length, ".3f")) for b, t in self.tree_walks.items()
        ]
        rows += [
            ("held-out loss" if held_out else "loss (trained-on shards)", format_figure(self.heldout_loss, ".4f")),
            ("random-anchor chain (diag.)", format_figure(self.random_anchor_chain_length, ".3f")),
        ]
        rows += [
            (f"slot {k} accepted | reached", format_figure(a, ".3f")) for k, a in enumerate(w.slot_acceptance, start=1)
        ]
        hist = " ".join(str(c) for c in w.accepted_histogram)
        lines = [f"{'metric':<30}{'value':>12}", "-" * 42] + [f"{m:<30}{v:>12}" for m, v in rows]
        lines += ["acceptance by context length (the anchor's position):", *w.context_lines()] if w.steps else []
        lines += (
            ["acceptance by serving mode (mean over the mode's responses):", *w.mode_lines()] if w.mode_lines() else []
        )
        lines += [
            f"accepted drafts per step, 0..{len(w.accepted_histogram) - 1}: {hist}",
            f"dtype {self.dtype}; shards {self.batch_ids}; mode {self.mode or 'token rows as given'}",
            f"whose tokens: {self.whose_tokens()}",
        ]
        return "\n".join(lines)


def default_lanes(max_seqs: int, block_size: int, tile_size: int = 128) -> int:
    """Walk lanes (blocks per round): one per sequence slot of a batch, rounded up to whole flex tiles."""
    per_tile = max(1, tile_size // block_size)
    return -(-max_seqs // per_tile) * per_tile


def eval_copy(model: DFlashDrafter, dtype: torch.dtype) -> DFlashDrafter:
    """The model as evaluated: itself when already in `dtype`, else a copy with weights rounded to it."""
    if all(p.dtype == dtype for p in model.parameters()):
        return model
    device = next(model.parameters()).device
    with torch.device("meta"):
        twin = DFlashDrafter(model.config).to(dtype)
    twin = twin.to_empty(device=device)  # no fp32 copy of a 27B-width drafter ever exists
    twin.load_state_dict({name: t.detach().to(dtype) for name, t in model.state_dict().items()}, strict=True)
    return twin.eval()


@torch.no_grad()
def evaluate_drafter(
    model: DFlashDrafter,
    head: TargetHead,
    cache_dir: str,
    batch_ids: list[int],
    *,
    num_blocks: int | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    attention: str = "sdpa",
    budgets: Sequence[int],
    loss: LossConfig | None = None,
    lanes: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    context_edges: Sequence[int] = CONTEXT_BUCKETS,
) -> EvalResult:
    """Evaluate on `batch_ids` (this rank takes every world_size-th); every rank gets the same result.
    model and head must already be in the evaluation dtype (see eval_copy). budgets: the DDTree node
    budgets walked besides the chain. loss: the run's loss settings (None: LossConfig's defaults); its
    gamma weights the held-out CE, its chunk bounds the logits held at once. num_blocks (random-anchor
    blocks per shard) and seed default to fixed values, not the run's, so every evaluation of the same
    weights draws the same blocks. context_edges: the context-length buckets the walks also count."""
    device = torch.device(device)
    cfg = model.config
    reader = ShardReader(cache_dir)
    cc = reader.config
    B, S = cfg.block_size, cfg.block_size - 1
    budgets = sorted(set(int(b) for b in budgets))
    dtype = next(model.parameters()).dtype
    lanes = lanes or default_lanes(cc.max_seqs, B)
    # Random anchors independent of the run's settings, so `eval` later draws the very same blocks.
    num_blocks = num_blocks or default_num_blocks(cc.token_budget, B)
    # One layout for the random-anchor blocks, one for the walk's lanes.
    random_layout, walk_layout = (
        BlockAttentionLayout.for_drafter(cfg, num_ctx=cc.token_budget, num_blocks=n, backend=attention, device=device)
        for n in (num_blocks, lanes)
    )
    rules: list[int | None] = [None, *budgets]
    edges = tuple(int(e) for e in context_edges)
    names = mode_names(cc)
    width = len(WalkCounts(B, context_edges=edges, mode_names=names).as_vector())
    sums = Sums(
        {
            **{_walk_key(rule): width for rule in rules},
            "shards": 1,
            "ce": 1,
            "blocks": 1,
            "chain": 1,
            "slot_correct": S,
            "slot_correct" + COUNT: S,
            "target_match": 1,
            "target_match" + COUNT: 1,
        },
        device,
    )
    loss = loss or LossConfig()
    chunk_blocks = loss.chunk_blocks
    loss_cfg = LossConfig(gamma=loss.gamma, chunk_blocks=chunk_blocks)  # the CE alone: no KL or CAP term
    for batch_id in batch_ids[rank::world_size]:
        tensors, info = reader.read(batch_id, verify_checksum=True)
        hidden_TKH = decode_context(tensors, reader.config).to(device, dtype)
        ids_T, pos_T = tensors["input_ids"].to(device), tensors["position_ids"].to(device)
        modes = [s.mode for s in info.samples]  # sequence i of the shard is its header's sample i
        responses = response_spans(tensors["loss_mask"], tensors["cu_seqlens"], tensors.get("anchor_mask"), modes)
        # The fused context and every layer's context K/V: once per shard, for every rule and the random anchors.
        context = model.context(hidden_TKH, pos_T, dtype)
        del hidden_TKH
        for rule in rules:
            counts = walk_shard(
                model,
                head,
                context,
                ids_T,
                pos_T,
                responses,
                walk_layout,
                budget=rule,
                chunk_blocks=chunk_blocks,
                context_edges=edges,
                mode_names=names,
            )
            sums.add(_walk_key(rule), torch.tensor(counts.as_vector(), dtype=torch.float64))
        gen = torch.Generator().manual_seed(anchor_seed(seed, batch_id=batch_id))
        blocks = sample_shard_blocks(
            tensors,
            num_blocks=num_blocks,
            block_size=B,
            mask_token_id=cfg.mask_token_id,
            gamma=loss.gamma,
            generator=gen,
        )
        blocks = type(blocks)(**{k: v.to(device) for k, v in vars(blocks).items()})
        random_layout.update(blocks.seq_start_N, blocks.anchor_N)
        hidden_NBH = model.forward_cached(context, head.embed(blocks.block_ids_NB), blocks.block_pos_NB, random_layout)
        sums.add("shards", 1.0)
        sums.add("ce", block_loss(hidden_NBH, head, blocks, loss_cfg, transform=model.logit_transform()).ce)
        _score_random_blocks(sums, hidden_NBH, head, blocks, chunk_blocks)
        if "target_topk_ids" in tensors:
            match, positions = _target_greedy_match(tensors)
            sums.add("target_match", match)
            sums.add("target_match" + COUNT, positions)
    host = sums.reduce_to_host()
    nan = float("nan")
    slot_accuracy = host.mean("slot_correct")
    (ce,) = host.mean("ce", "shards")
    (chain,) = host.mean("chain", "blocks")
    (target_greedy,) = host.mean("target_match")
    return EvalResult(
        dtype=str(dtype).removeprefix("torch."),
        walk=WalkCounts.from_vector(B, host[_walk_key(None)], edges, names),
        tree_walks={b: WalkCounts.from_vector(B, host[_walk_key(b)], edges, names) for b in budgets},
        heldout_loss=nan if ce is None else ce,
        random_anchor_chain_length=nan if chain is None else chain,
        random_anchor_slot_accuracy=[nan if a is None else a for a in slot_accuracy],
        num_blocks=int(host.scalar("blocks")),
        data_is_target_greedy=target_greedy if cc.target_topk > 0 else None,
        batch_ids=list(batch_ids),
        mode=cache_mode(cc),
    )


def _walk_key(budget: int | None) -> str:
    return "walk/chain" if budget is None else f"walk/tree@{budget}"


def _score_random_blocks(sums: Sums, hidden_NBH: torch.Tensor, head: TargetHead, blocks, chunk_blocks: int) -> None:
    """Valid blocks, chain acceptance (+1), per-slot correct and count of random-anchor blocks."""
    NB, B, H = hidden_NBH.shape
    S = B - 1
    for start in range(0, NB, chunk_blocks):
        sl = slice(start, start + chunk_blocks)
        C = hidden_NBH[sl].shape[0]
        logits_CSV = head.logits(hidden_NBH[sl, 1:].reshape(C * S, H)).float().view(C, S, -1)
        valid_CS = blocks.label_valid_NB[sl][:, 1:]
        correct_CS = (logits_CSV.argmax(-1) == blocks.labels_NB[sl][:, 1:]) & valid_CS
        block_valid_C = blocks.block_valid_N[sl]
        sums.add("blocks", block_valid_C.sum())
        sums.add("chain", ((accepted_prefix_length(correct_CS) + 1) * block_valid_C).sum())
        sums.add("slot_correct", correct_CS.sum(0))
        sums.add("slot_correct" + COUNT, valid_CS.sum(0))


def _target_greedy_match(tensors: dict[str, torch.Tensor]) -> tuple[float, float]:
    """[matches, positions]: supervised positions t (t-1 in the same sequence) whose data token equals
    the target's top-1 stored at t-1 (the stored top-k at t-1 is the target's next-token distribution)."""
    ids_T, mask_T = tensors["input_ids"].long(), tensors["loss_mask"].bool()
    top1_T = tensors["target_topk_ids"][:, 0].long()
    cu = tensors["cu_seqlens"].long()
    T = ids_T.shape[0]
    starts = torch.zeros(T, dtype=torch.bool)
    starts[cu[:-1].clamp(max=T - 1)] = True  # a sequence's first token has no prediction before it
    inside = torch.arange(T) < cu[-1]
    use_T = mask_T & ~starts & inside
    use_T[0] = False
    match_T = torch.zeros(T, dtype=torch.bool)
    match_T[1:] = ids_T[1:] == top1_T[:-1]
    return float((match_T & use_T).sum()), float(use_T.sum())
