"""The decoding walk: held-out acceptance measured the way greedy speculative decoding produces it.

Per response (a contiguous run of supervised tokens x_first..x_last inside one packed sequence):
  anchor p = first                the token the target's prefill produced
  repeat while p < last:          tokens remain to be produced
      block  = [x_p, MASK x (B-1)] at positions pos(p)..pos(p)+B-1; the drafter sees the context of
               its sequence strictly before p (the tapped hidden states of the cache), as in training
      a      = accepted drafts: chain = longest prefix of slots k = 1..B-1 with argmax q_k == x_{p+k}
               (DFlash 2: the selector's greedy path from x_p in place of the argmaxes);
               tree@budget = depth of the label path inside the DDTree of the block (train/eval/tree.py);
               slots past `last` are never accepted
      tokens = min(a + 1, last - p)     (the a drafts plus the target's bonus token, cut at the end)
      p      = p + a + 1                (the bonus token is the next anchor, right after a rejection)
This is what z-lab's dflash_generate does when the data are the target's greedy output (the data's
next tokens are then the target's greedy tokens), except that it counts the bonus of the last step
past max_new_tokens; here a response's tokens over its steps sum to last - first exactly.

Figures (WalkCounts):
  acceptance_length         mean over responses of (tokens / steps) of the response: how serving
                            benchmarks average (z-lab benchmark.py), the headline
  acceptance_length_pooled  all tokens / all steps (long responses weigh more)
  accepted_histogram[a]     steps with a accepted drafts, a = 0..B-1
  slot_acceptance[k-1]      P(slot k accepted | slots 1..k-1 accepted and slot k has a label)
  acceptance_by_context     per context-length bucket of the anchor's absolute position (default 0-2K,
                            2K-8K, 8K-32K, 32K+; dflash-train eval --context-buckets): tokens / steps of
                            the steps anchored there (a response crosses buckets, so pooled)
  acceptance_by_mode        per serving mode when the cache holds several (cache.json chat_modes): the
                            headline's mean over the responses of that mode's samples (and pooled)
A long sample's pieces (shards/format.py) are walked over their own parts only (anchor_mask): each
piece's responses start at its own part, as though the target had just emitted that token, and stop at
its end; one token per piece boundary goes uncounted.

Batched: every lane (one response at a time) puts its current anchor into one drafter forward per
round, through the training forward's layers and block attention (BlockAttentionLayout: context
[seq_start, anchor) plus the own block); a lane that finishes takes the shard's next response.
The fused context and every layer's context K/V depend on the shard and the weights only, so they
are computed once per shard (DFlashDrafter.context -> ContextKV) and every round runs only the
blocks (DFlashDrafter.forward_cached). On flex (GPU) a round has the fixed shape of all NB lanes;
on sdpa (CPU) it holds only the busy lanes.

Legend: T token budget, K taps, H hidden, NB lanes, R blocks of a round (NB on flex, the busy lanes on
sdpa), B block size, S = B-1 slots, V vocab.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from shards.common.progress import format_figure
from train.drafter.attention import BlockAttentionLayout
from train.drafter.model import ContextKV, DFlashDrafter, TargetHead
from train.eval.config import CONTEXT_BUCKETS
from train.eval.tree import tree_acceptance
from train.loss.config import LossConfig
from train.metrics.block_metrics import accepted_prefix_length


class Response(NamedTuple):
    """One response of a packed batch: packed indices of its sequence's first token and of its first
    and last supervised token."""

    seq_start: int
    first: int
    last: int
    mode: int = 0  # its sample's serving mode, an index into cache.json's modes (CacheConfig.modes)


def response_spans(
    loss_mask_T: torch.Tensor,
    cu_seqlens_S1: torch.Tensor,
    anchor_mask_T: torch.Tensor | None = None,
    modes: list[int] | None = None,
) -> list[Response]:
    """Contiguous supervised runs of every sequence with at least two tokens (one step or more), inside
    anchor_mask when given (a piece's own part); modes[i]: sequence i's mode (None: all mode 0)."""
    mask_T = loss_mask_T.bool() if anchor_mask_T is None else loss_mask_T.bool() & anchor_mask_T.bool()
    mask = mask_T.tolist()
    bounds = cu_seqlens_S1.tolist()
    spans = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        mode = modes[i] if modes is not None and i < len(modes) else 0
        t = start
        while t < end:
            if not mask[t]:
                t += 1
                continue
            first = t
            while t + 1 < end and mask[t + 1]:
                t += 1
            if t > first:
                spans.append(Response(start, first, t, mode))
            t += 1
    return spans


@dataclass
class WalkCounts:
    """Additive counts of one walk (one rule), host-side; `merge` adds another (ranks, shards)."""

    block_size: int
    responses: int = 0
    steps: int = 0
    tokens: int = 0
    response_mean_sum: float = 0.0  # sum over responses of tokens/steps
    accepted_histogram: list[int] = field(default_factory=list)  # [B]: steps with a = 0..B-1
    slot_reached: list[int] = field(default_factory=list)  # [S]
    slot_accepted: list[int] = field(default_factory=list)  # [S]
    # Context-length buckets: bucket c holds anchors at absolute positions [edges[c], edges[c+1]), the last
    # one open; () = none kept.
    context_edges: tuple[int, ...] = CONTEXT_BUCKETS
    context_steps: list[int] = field(default_factory=list)  # [C]: steps anchored in bucket c
    context_tokens: list[int] = field(default_factory=list)  # [C]: tokens those steps produced
    # Serving modes (cache.json's modes, described): mode m's responses, their sum of tokens/steps, steps
    # and tokens. A response stays in its sample's mode, so a mode's acceptance is the headline's mean.
    mode_names: tuple[str, ...] = ("",)
    mode_responses: list[int] = field(default_factory=list)  # [M]
    mode_mean_sum: list[float] = field(default_factory=list)  # [M]
    mode_steps: list[int] = field(default_factory=list)  # [M]
    mode_tokens: list[int] = field(default_factory=list)  # [M]

    def __post_init__(self) -> None:
        B, C = self.block_size, len(self.context_edges)
        self.accepted_histogram = self.accepted_histogram or [0] * B
        self.slot_reached = self.slot_reached or [0] * (B - 1)
        self.slot_accepted = self.slot_accepted or [0] * (B - 1)
        self.context_edges = tuple(self.context_edges)
        self.context_steps = self.context_steps or [0] * C
        self.context_tokens = self.context_tokens or [0] * C
        self.mode_names, M = tuple(self.mode_names), len(self.mode_names)
        self.mode_responses = self.mode_responses or [0] * M
        self.mode_mean_sum = self.mode_mean_sum or [0.0] * M
        self.mode_steps = self.mode_steps or [0] * M
        self.mode_tokens = self.mode_tokens or [0] * M

    def add_step(self, accepted: int, num_labels: int) -> None:
        """One step with `accepted` drafts out of `num_labels` slots that had a label."""
        self.steps += 1
        self.accepted_histogram[accepted] += 1
        for k in range(1, min(accepted + 1, num_labels) + 1):  # slot k was tried iff slots < k were accepted
            self.slot_reached[k - 1] += 1
            self.slot_accepted[k - 1] += k <= accepted

    def add_context_step(self, position: int, tokens: int) -> None:
        """One step anchored at absolute `position` that produced `tokens` tokens, into its bucket."""
        if self.context_edges:
            bucket = max(0, bisect_right(self.context_edges, position) - 1)
            self.context_steps[bucket] += 1
            self.context_tokens[bucket] += tokens

    def add_response(self, tokens: int, steps: int, mode: int = 0) -> None:
        self.responses += 1
        self.tokens += tokens
        self.response_mean_sum += tokens / steps
        self.mode_responses[mode] += 1
        self.mode_mean_sum[mode] += tokens / steps
        self.mode_steps[mode] += steps
        self.mode_tokens[mode] += tokens

    def as_vector(self) -> list[float]:
        return [
            self.responses,
            self.steps,
            self.tokens,
            self.response_mean_sum,
            *self.accepted_histogram,
            *self.slot_reached,
            *self.slot_accepted,
            *self.context_steps,
            *self.context_tokens,
            *self.mode_responses,
            *self.mode_mean_sum,
            *self.mode_steps,
            *self.mode_tokens,
        ]

    @classmethod
    def from_vector(
        cls,
        block_size: int,
        v: list[float],
        context_edges: tuple[int, ...] = CONTEXT_BUCKETS,
        mode_names: tuple[str, ...] = ("",),
    ) -> WalkCounts:
        B, S, C, M = block_size, block_size - 1, len(context_edges), len(mode_names)
        ints = [round(x) for x in v]
        ctx = 4 + B + 2 * S
        md = ctx + 2 * C
        return cls(
            block_size,
            ints[0],
            ints[1],
            ints[2],
            float(v[3]),
            ints[4 : 4 + B],
            ints[4 + B : 4 + B + S],
            ints[4 + B + S : ctx],
            tuple(context_edges),
            ints[ctx : ctx + C],
            ints[ctx + C : md],
            tuple(mode_names),
            ints[md : md + M],
            [float(x) for x in v[md + M : md + 2 * M]],
            ints[md + 2 * M : md + 3 * M],
            ints[md + 3 * M : md + 4 * M],
        )

    @property
    def acceptance_length(self) -> float:
        return self.response_mean_sum / self.responses if self.responses else float("nan")

    @property
    def acceptance_length_pooled(self) -> float:
        return self.tokens / self.steps if self.steps else float("nan")

    @property
    def slot_acceptance(self) -> list[float]:
        return [a / r if r else float("nan") for a, r in zip(self.slot_accepted, self.slot_reached)]

    @property
    def acceptance_by_context(self) -> dict[str, tuple[float, int]]:
        """Bucket label ("0-2K", ..., "32K+") -> (tokens / steps of the steps anchored there, steps)."""
        labels = context_bucket_labels(self.context_edges)
        return {
            label: (tokens / steps if steps else float("nan"), steps)
            for label, steps, tokens in zip(labels, self.context_steps, self.context_tokens)
        }

    @property
    def acceptance_by_mode(self) -> dict[str, tuple[float, float, int]]:
        """Described mode -> (acceptance length: mean over its responses, pooled over its steps, responses);
        empty when the data hold one mode."""
        if len(self.mode_names) < 2:
            return {}
        nan = float("nan")
        return {
            name: (mean / n if n else nan, tokens / steps if steps else nan, n)
            for name, n, mean, steps, tokens in zip(
                self.mode_names, self.mode_responses, self.mode_mean_sum, self.mode_steps, self.mode_tokens
            )
        }

    def figures(self) -> dict[str, float | int | list | dict]:
        """The walk's figures as every report writes them (eval.json, eval --out, the decode report);
        acceptance_by_mode only for data in several modes."""
        by_context, by_mode = self.acceptance_by_context, self.acceptance_by_mode
        per_mode = {
            "acceptance_by_mode": {name: value for name, (value, _, _) in by_mode.items()},
            "acceptance_by_mode_pooled": {name: pooled for name, (_, pooled, _) in by_mode.items()},
            "responses_by_mode": {name: n for name, (_, _, n) in by_mode.items()},
        }
        return {
            "acceptance_length": self.acceptance_length,
            "acceptance_length_pooled": self.acceptance_length_pooled,
            "num_steps": self.steps,
            "accepted_histogram": self.accepted_histogram,
            "slot_acceptance": self.slot_acceptance,
            "acceptance_by_context": {label: value for label, (value, _) in by_context.items()},
            "steps_by_context": {label: steps for label, (_, steps) in by_context.items()},
            **(per_mode if by_mode else {}),
        }

    def mode_lines(self) -> list[str]:
        """One line per mode with responses, for the printed tables (none for data in one mode)."""
        return [
            f"  {name}: acceptance {format_figure(value, '.3f')} ({n} responses, pooled {format_figure(pooled, '.3f')})"
            for name, (value, pooled, n) in self.acceptance_by_mode.items()
            if n
        ]

    def context_lines(self) -> list[str]:
        """One line per context bucket with steps, for the printed tables."""
        return [
            f"  anchors at {label:>8}: acceptance {format_figure(value, '.3f')} ({steps} steps, pooled)"
            for label, (value, steps) in self.acceptance_by_context.items()
            if steps
        ]


def context_bucket_labels(edges: tuple[int, ...]) -> list[str]:
    """Names of the buckets of `edges`: (0, 2048, 8192) -> ["0-2K", "2K-8K", "8K+"]."""

    def short(n: int) -> str:
        return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)

    ends = [f"-{short(e)}" for e in edges[1:]] + ["+"]
    return [f"{short(lo)}{end}" for lo, end in zip(edges, ends)]


def draft_accepted(
    hidden_NBH: torch.Tensor,
    head: TargetHead,
    labels_NS: torch.Tensor,
    valid_NS: torch.Tensor,
    budget: int | None,
    chunk_blocks: int,
    model: DFlashDrafter | None = None,
    anchor_ids_N: torch.Tensor | None = None,
) -> list[int]:
    """Accepted drafts per block: chain (budget None) or DDTree at `budget` nodes; labels [NB, S].
    model: the drafter's logits (DFlash 2's transform); a DFlash 2 chain drafts the selector's greedy
    path from anchor_ids_N (the blocks' anchor tokens); the DDTree of a DFlash 2 drafter is built on its
    unary logits. None = the target head's logits (a DFlash 1 drafter: the same)."""
    NB, B, H = hidden_NBH.shape
    out: list[int] = []
    logits_fn = head.logits if model is None else lambda h: model.draft_logits(h, head)
    selector = model is not None and model.config.is_dflash2
    for start in range(0, NB, chunk_blocks):
        sl = slice(start, start + chunk_blocks)
        C = hidden_NBH[sl].shape[0]
        if budget is None and selector:
            path_CS = model.selector_path(hidden_NBH[sl, 1:], head, anchor_ids_N[sl])
            out += accepted_prefix_length((path_CS == labels_NS[sl]) & valid_NS[sl]).tolist()
            continue
        logits_CSV = logits_fn(hidden_NBH[sl, 1:].reshape(C * (B - 1), H)).float().view(C, B - 1, -1)
        if budget is None:
            ok_CS = (logits_CSV.argmax(-1) == labels_NS[sl]) & valid_NS[sl]
            out += accepted_prefix_length(ok_CS).tolist()
            continue
        ranks = min(budget, logits_CSV.shape[-1])
        top_logp_CSR, top_ids_CSR = torch.log_softmax(logits_CSV, -1).topk(ranks, dim=-1)
        lp, ids = top_logp_CSR.tolist(), top_ids_CSR.tolist()
        labels, valid = labels_NS[sl].tolist(), valid_NS[sl].tolist()
        out += [tree_acceptance(lp[c], ids[c], labels[c], valid[c], budget) - 1 for c in range(C)]
    return out


@torch.no_grad()
def walk_shard(
    model: DFlashDrafter,
    head: TargetHead,
    context: ContextKV,
    input_ids_T: torch.Tensor,
    position_ids_T: torch.Tensor,
    responses: list[Response],
    layout: BlockAttentionLayout,
    *,
    budget: int | None = None,
    chunk_blocks: int = LossConfig.chunk_blocks,  # the loss's chunking: the same bound on logits memory
    context_edges: tuple[int, ...] = CONTEXT_BUCKETS,
    mode_names: tuple[str, ...] = ("",),
) -> WalkCounts:
    """Walk every response of one packed batch (all tensors on the model's device; `layout` sized for
    T context tokens and NB lanes). context = model.context(hidden_TKH, position_ids_T, dtype): the
    shard's context K/V, computed once and shared by every round (and every rule). budget None =
    greedy chain, else DDTree at that node budget. context_edges: the context-length buckets of the
    anchors' absolute positions (position_ids_T), counted besides; mode_names: the serving modes the
    responses' `mode` indexes, counted besides.

    flex (GPU): every round is the fixed-shape forward of all NB lanes (idle lanes included) through
    `layout`, as training runs it. sdpa (CPU, tests): no graph or compiled kernel needs a fixed shape,
    so a round runs only the busy lanes: a shard often holds fewer responses than max_seqs lanes, and
    lanes fall idle as responses end."""
    cfg = model.config
    B, S, NB = cfg.block_size, cfg.block_size - 1, layout.num_blocks
    device = input_ids_T.device
    counts = WalkCounts(B, context_edges=context_edges, mode_names=mode_names)
    position_of = position_ids_T.tolist()  # the anchors' absolute positions, for the buckets
    pending = list(reversed(responses))
    lane: list[list[int] | None] = [None] * NB  # [seq_start, anchor, last, tokens, steps, mode] per busy lane
    k_B = torch.arange(B, device=device)
    compact = layout.backend == "sdpa"
    while True:
        for n in range(NB):
            if lane[n] is None and pending:
                r = pending.pop()
                lane[n] = [r.seq_start, r.first, r.last, 0, 0, r.mode]
        busy = [n for n in range(NB) if lane[n] is not None]
        if not busy:
            return counts
        if compact:
            rows = [lane[n] for n in busy]
            round_layout = BlockAttentionLayout(
                num_ctx=layout.num_ctx,
                num_blocks=len(rows),
                block_size=B,
                backend="sdpa",
                device=device,
                sliding_window=layout.sliding_window,
                sliding_causal=layout.sliding_causal,
            )
        else:
            # Idle lanes: anchor 0 with an empty context (seq_start == anchor), ignored below.
            rows = [lane[n] or [0, 0, -1] for n in range(NB)]
            round_layout = layout
        seq_start_R = torch.tensor([r[0] for r in rows], dtype=torch.int32)
        anchor_R = torch.tensor([r[1] for r in rows], dtype=torch.int32)
        last_R = torch.tensor([r[2] for r in rows])
        round_layout.update(seq_start_R.to(device), anchor_R.to(device))
        anchor_dev = anchor_R.to(device).long()
        block_ids_RB = torch.where(
            k_B == 0,
            input_ids_T[anchor_dev].long().unsqueeze(1),
            torch.full((len(rows), B), cfg.mask_token_id, device=device, dtype=torch.long),
        )
        block_pos_RB = position_ids_T[anchor_dev].long().unsqueeze(1) + k_B
        index_RS = anchor_dev.unsqueeze(1) + k_B[1:]
        valid_RS = index_RS <= last_R.to(device).unsqueeze(1)
        labels_RS = input_ids_T[index_RS.clamp(max=input_ids_T.shape[0] - 1)].long()
        hidden_RBH = model.forward_cached(context, head.embed(block_ids_RB), block_pos_RB, round_layout)
        if not compact:  # the LM head and the verification rule only for the busy lanes
            keep = torch.tensor(busy, device=device)
            hidden_RBH, labels_RS, valid_RS = hidden_RBH[keep], labels_RS[keep], valid_RS[keep]
            block_ids_RB = block_ids_RB[keep]
        accepted = draft_accepted(
            hidden_RBH,
            head,
            labels_RS,
            valid_RS,
            budget,
            chunk_blocks,
            model=model if cfg.is_dflash2 else None,
            anchor_ids_N=block_ids_RB[:, 0],
        )
        for n, a in zip(busy, accepted, strict=True):
            seq_start, anchor, last, tokens, steps, mode = lane[n]
            counts.add_step(a, min(S, last - anchor))
            counts.add_context_step(position_of[anchor], min(a + 1, last - anchor))
            tokens, steps, anchor = tokens + min(a + 1, last - anchor), steps + 1, anchor + a + 1
            if anchor >= last:
                counts.add_response(tokens, steps, mode)
                lane[n] = None
            else:
                lane[n] = [seq_start, anchor, last, tokens, steps, mode]
