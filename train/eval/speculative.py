"""Speculative decoding with a DFlash drafter and the target in the loop, measured per step: greedy
(lossless by construction: every emitted token is the target's own greedy choice) or at the serving
temperature (lossless in distribution: rejection sampling, train/eval/sampling.py).

    prefill   the verifier runs the prompt: the target's next token (greedy, or sampled from its
              distribution) is the first anchor, and its tapped hidden states are the drafter's context
    step      draft: a DraftProposer drafts S = B-1 tokens d_1..d_S after the anchor from the context
              strictly before it (DFlash 1: the block [anchor, MASK x S], argmax or sampled per slot);
              verify: the target runs prompt + output + drafts;
              greedy: accept the longest prefix with d_k == g_k (its greedy token at position p + k),
              emit g_1..g_{a+1} (the a drafts and the bonus token);
              T > 0: accept d_k with probability min(1, p_k(d_k)/q_k(d_k)) up to the first rejection,
              then one token from norm(max(p_k - q_k, 0)), or the bonus token from p when all pass;
              never past max_new_tokens; the last emitted token is the next anchor
This is the loop of z-lab's dflash_generate; the decoding walk over cached shards (train/eval/walk.py)
does the greedy steps on data, and on the target's own greedy data it gives the same figures.
Acceptance length = tokens per verify step, averaged per response (how model cards report it).

The target is any `Verifier`: given token ids it returns the target's greedy next token after every
position (or its logits, for sampling) and the tapped hidden states (recomputing the whole prefix each
call is acceptable: this measures acceptance and relative speed, not a serving engine). train/ never
imports extract/ (house rule), so the target verifier is built in tools/ (tools/cli/verifier.py) and
handed in as an argument: the `dflash-train` console script (tools/cli/dflash_train.py) gives
train/cli.py's commands a factory for extract's target model (train.cli.EntryPoint), and `eval` passes
it to run_eval and on to build_verifier. `--target` without one (e.g. `python -m train.cli`) is
refused, naming the entry point.

Legend: L tokens so far, K taps, H hidden, B block size, S = B-1 drafts, V vocab, X rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from shards.common.chat_mode import MODE_COLUMN, describe_mode, mode_from_value, mode_text, row_mode
from shards.common.json_input import InputFileError, iter_json_lines
from shards.common.progress import ProgressLog, format_duration, format_figure, plural
from train.drafter.model import DFlashDrafter, TargetHead
from train.eval.config import CONTEXT_BUCKETS, DECODE_BATCH, SamplingConfig
from train.eval.sampling import DraftDistribution, sample_token, serving_probs, verify_drafts
from train.eval.walk import WalkCounts


class Verifier(Protocol):
    """The target as speculative decoding needs it."""

    embed_tokens_VH: torch.Tensor  # the target's input embedding (the drafter embeds its block with it)
    lm_head_VH: torch.Tensor  # the target's LM head (the drafter's logits)
    stop_ids: frozenset[int]  # the ids that end a reply (eos, end of turn), as serving stops decoding

    def __call__(self, input_ids_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(greedy next token after every position [L] int64, tapped hidden states [L, K, H])."""
        ...

    def next_token_logits(self, input_ids_L: torch.Tensor, num_last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the target's next-token logits after each of the last `num_last` positions [num_last, V] in
        float32 or wider, tapped hidden states [L, K, H]): what sampling at T > 0 needs."""
        ...

    # Optional, for decoding several prompts in lockstep (tools/cli/verifier.py has both): the two calls above
    # for a list of sequences in one target forward,
    #   verify_many(input_ids: list[Tensor [L_i]]) -> list[(next [L_i], hidden [L_i, K, H])]
    #   next_token_logits_many(input_ids, num_last) -> list[(logits [num_last, V], hidden [L_i, K, H])]
    # A verifier without them is called once per sequence.


class Proposal(NamedTuple):
    """One block's drafts: tokens d_1..d_S and, when sampled (T > 0), the distribution q_k each was drawn
    from (the rejection test's q); q None = greedy argmax drafts."""

    tokens: list[int]
    q: list[DraftDistribution] | None = None


class DraftProposer(Protocol):
    """The draft side of one chain step: DFlash 1's block (ChainProposer), or any drafter whose slots
    come with a DraftDistribution (DFlash 2's selector: q over its K candidates), without touching the
    verification below."""

    block_size: int

    def __call__(
        self, context_LKH: torch.Tensor, anchor: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Proposal:
        """Drafts after the token `anchor` at position L, the context being the target's taps of the
        positions before it [L, K, H]."""
        ...

    # Optional (ChainProposer has it): propose_many(contexts_LKH, anchors, sampling, generator) -> list[Proposal],
    # __call__ of several sequences in one drafter forward. A proposer without it is called once per sequence.


@dataclass
class ChainProposer:
    """One forward of [anchor, MASK x S] gives every slot's state. DFlash 1: greedy drafts are the slots'
    argmaxes, sampled drafts are drawn slot by slot from serving_probs of their logits (the same
    temperature, top-k and top-p as the target's). DFlash 2: greedy drafts are the selector's greedy walk
    from the anchor; sampled drafts walk it slot by slot, each drawn from softmax(scores / T) over the
    slot's K candidates given the token drawn before it, and that distribution is the slot's q."""

    model: DFlashDrafter
    head: TargetHead
    context_dtype: torch.dtype | None = torch.bfloat16  # the cache's storage rounding, as in training

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    def __call__(
        self, context_LKH: torch.Tensor, anchor: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Proposal:
        cfg, head = self.model.config, self.head
        device, dtype = head.embed_tokens_VH.device, head.embed_tokens_VH.dtype
        if self.context_dtype is not None:
            context_LKH = context_LKH.to(self.context_dtype)
        p = context_LKH.shape[0]
        block_B = torch.full((cfg.block_size,), cfg.mask_token_id, device=device, dtype=torch.long)
        block_B[0] = anchor
        pos = torch.arange(p + cfg.block_size, device=device)
        hidden_BH = self.model.forward_block(context_LKH.to(dtype), pos[:p], head.embed(block_B), pos[p:])
        if sampling.greedy:
            return Proposal(self.model.greedy_drafts(hidden_BH[1:], head, block_B[0]).tolist())
        return self._sampled(hidden_BH[1:], anchor, sampling, generator)

    def propose_many(
        self,
        contexts_LKH: list[torch.Tensor],
        anchors: list[int],
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> list[Proposal]:
        """__call__ for several sequences, their blocks in one drafter forward (DFlashDrafter.forward_blocks);
        sampled drafts are drawn block after block, in the order given."""
        if len(contexts_LKH) == 1:
            return [self(contexts_LKH[0], anchors[0], sampling, generator)]
        model, head = self.model, self.head
        device, dtype = head.embed_tokens_VH.device, head.embed_tokens_VH.dtype
        if self.context_dtype is not None:
            contexts_LKH = [c.to(self.context_dtype) for c in contexts_LKH]
        N, B = len(contexts_LKH), self.block_size
        block_NB = torch.full((N, B), model.config.mask_token_id, device=device, dtype=torch.long)
        block_NB[:, 0] = torch.tensor(anchors, device=device)
        lengths_N1 = torch.tensor([c.shape[0] for c in contexts_LKH], device=device)[:, None]
        pos_NB = lengths_N1 + torch.arange(B, device=device)
        hidden_NSH = model.forward_blocks([c.to(dtype) for c in contexts_LKH], head.embed(block_NB), pos_NB)[:, 1:]
        if sampling.greedy:
            if model.config.is_dflash2:
                drafts_NS = model.selector_path(hidden_NSH, head, block_NB[:, 0])
            else:
                drafts_NS = model.draft_logits(hidden_NSH.flatten(0, 1), head).float().argmax(-1).view(N, B - 1)
            return [Proposal(row) for row in drafts_NS.tolist()]
        return [self._sampled(h_SH, a, sampling, generator) for h_SH, a in zip(hidden_NSH, anchors, strict=True)]

    def _sampled(
        self, hidden_SH: torch.Tensor, anchor: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Proposal:
        if self.model.config.is_dflash2:
            return self._sampled_selector_walk(hidden_SH, anchor, sampling.temperature, generator)
        logits_SV = self.model.draft_logits(hidden_SH, self.head).float()
        q = [DraftDistribution(probs_V) for probs_V in serving_probs(logits_SV, sampling)]
        return Proposal([slot.sample(generator) for slot in q], q)

    def _sampled_selector_walk(
        self, hidden_SH: torch.Tensor, anchor: int, temperature: float, generator: torch.Generator | None
    ) -> Proposal:
        tokens, q, predecessor = [], [], anchor
        for hidden_1H in hidden_SH.split(1):
            ids_1K, scores_1K = self.model.slot_candidates(
                hidden_1H, self.head, torch.tensor([predecessor], device=hidden_1H.device)
            )
            slot = DraftDistribution(torch.softmax(scores_1K[0].float() / temperature, dim=-1), ids_1K[0])
            predecessor = slot.sample(generator)
            tokens.append(predecessor)
            q.append(slot)
        return Proposal(tokens, q)


log = logging.getLogger(__name__)

VerifierFactory = Callable[..., Verifier]  # (target_dir, tap_layer_ids, device, dtype) -> Verifier
# A conversation row of --prompts (row, file, row index) -> the prompt's token ids, rendered as served.
PromptRender = Callable[[Any, str, int], list[int]]
PromptRendererFactory = Callable[..., PromptRender]  # (target_dir, thinking, template_kwargs) -> PromptRender


def build_verifier(
    factory: VerifierFactory | None, target_dir: str, tap_layer_ids: list[int], device: torch.device, dtype: torch.dtype
) -> Verifier:
    """The target at `target_dir` as a verifier, built by the factory the console script handed in."""
    if factory is None:
        raise ValueError(
            "--target needs the target model, which the `dflash-train` console script provides "
            "(tools/cli/dflash_train.py); run `dflash-train eval ...` or `python -m tools.cli.dflash_train eval ...`"
            " rather than `python -m train.cli`"
        )
    return factory(target_dir, tap_layer_ids, device, dtype)


@dataclass
class Decoded:
    tokens: list[int]  # the generated tokens: max_new_tokens, or fewer ending with a stop token
    step_tokens: list[int] = field(default_factory=list)  # tokens emitted per verification step
    step_accepted: list[int] = field(default_factory=list)  # drafts accepted per step
    step_labels: list[int] = field(default_factory=list)  # drafts that could be accepted per step (the cut)
    step_positions: list[int] = field(default_factory=list)  # the anchor's position per step (prompt included)
    seconds: float = 0.0


GREEDY = SamplingConfig()


@torch.no_grad()
def speculative_generate(
    proposer: DraftProposer,
    verifier: Verifier,
    prompt: list[int],
    max_new_tokens: int,
    *,
    sampling: SamplingConfig = GREEDY,
    generator: torch.Generator | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> Decoded:
    """Speculative decoding of up to `max_new_tokens` tokens after `prompt`, ending at the first of
    `stop_ids` as serving ends a reply: greedy (exact, token for token the target's greedy output) or, at
    sampling.temperature > 0, rejection-sampled with `generator`'s draws."""
    return speculative_generate_many(
        proposer, verifier, [prompt], max_new_tokens, sampling=sampling, generator=generator, stop_ids=stop_ids
    )[0]


@torch.no_grad()
def speculative_generate_many(
    proposer: DraftProposer,
    verifier: Verifier,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    sampling: SamplingConfig = GREEDY,
    generator: torch.Generator | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> list[Decoded]:
    """speculative_generate of every prompt in lockstep: each step drafts for every unfinished prompt (in one
    drafter forward with a proposer that has propose_many), then verifies all of them in one target call (a
    packed forward with a verifier that has verify_many). Greedy, each prompt's tokens are the target's
    greedy tokens as alone, and its steps those of its own speculative_generate up to the rounding of the
    packed forwards (a near-tie between two drafts can go the other way); at T > 0 the prompts' draws
    interleave on the one generator. Each Decoded's seconds: an equal share of the call's."""
    S = proposer.block_size - 1
    device = verifier.embed_tokens_VH.device
    t0 = time.perf_counter()
    first = _next_tokens(verifier, [torch.tensor(p, device=device) for p in prompts], sampling, generator)
    results = [Decoded([token]) for token, _ in first]
    hidden = [hidden_LKH for _, hidden_LKH in first]

    def unfinished(r: Decoded) -> bool:
        return len(r.tokens) < max_new_tokens and r.tokens[-1] not in stop_ids

    active = [i for i, r in enumerate(results) if unfinished(r)]
    while active:
        positions = [len(prompts[i]) + len(results[i].tokens) - 1 for i in active]  # the anchors'
        contexts = [hidden[i][:p] for i, p in zip(active, positions, strict=True)]
        anchors = [results[i].tokens[-1] for i in active]
        many = getattr(proposer, "propose_many", None)
        if many is not None:
            proposals = many(contexts, anchors, sampling, generator)
        else:
            proposals = [proposer(c, a, sampling, generator) for c, a in zip(contexts, anchors, strict=True)]
        steps = [
            (i, p, drafts, min(S, max_new_tokens - len(results[i].tokens)))
            for i, p, drafts in zip(active, positions, proposals, strict=True)
        ]
        ids = [torch.tensor(prompts[i] + results[i].tokens + d.tokens, device=device) for i, _, d, _ in steps]
        for (i, p, drafts, labels), (target, hidden_LKH) in zip(steps, _verify(verifier, ids, sampling, S + 1)):
            hidden[i] = hidden_LKH
            if sampling.greedy:  # target: the greedy next token after every position
                a, emitted = _accept_greedy(drafts.tokens, target[p : p + S + 1].tolist(), labels)
            else:  # target: the logits after the anchor and after each draft
                a, emitted = verify_drafts(serving_probs(target, sampling), drafts.tokens, drafts.q, labels, generator)
            r = results[i]
            emitted = _until_stop(emitted[: max_new_tokens - len(r.tokens)], stop_ids)
            if emitted[-1] in stop_ids:  # the reply ends here: as at a walk's response end, slots past it
                a, labels = min(a, len(emitted)), min(labels, len(emitted))  # have no label, none accepted
            r.tokens += emitted
            r.step_tokens.append(len(emitted))
            r.step_accepted.append(a)
            r.step_labels.append(labels)
            r.step_positions.append(p)
        active = [i for i in active if unfinished(results[i])]
    _share_seconds(results, time.perf_counter() - t0)
    return results


def _verify(
    verifier: Verifier, ids: list[torch.Tensor], sampling: SamplingConfig, num_last: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence (greedy: the target's next token after every position [L]; sampling: its logits after the
    last num_last positions [num_last, V]; the taps [L, K, H]): one packed call when the verifier batches."""
    if sampling.greedy:
        many = getattr(verifier, "verify_many", None)
        return many(ids) if many is not None else [verifier(ids_L) for ids_L in ids]
    many = getattr(verifier, "next_token_logits_many", None)
    if many is not None:
        return many(ids, num_last)
    return [verifier.next_token_logits(ids_L, num_last) for ids_L in ids]


def _until_stop(tokens: list[int], stop_ids: frozenset[int]) -> list[int]:
    """`tokens` up to and including the first stop token (all of them when none is there)."""
    for k, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: k + 1]
    return tokens


def _share_seconds(results: list[Decoded], seconds: float) -> None:
    for r in results:
        r.seconds = seconds / len(results)


def _accept_greedy(drafts: list[int], greedy: list[int], num_labels: int) -> tuple[int, list[int]]:
    """(accepted a, emitted tokens): the longest prefix of drafts equal to the target's greedy tokens
    (greedy[k]: its token after slot k), within num_labels, then the target's next token."""
    a = 0
    while a < num_labels and drafts[a] == greedy[a]:
        a += 1
    return a, greedy[: a + 1]


@torch.no_grad()
def plain_generate(
    verifier: Verifier,
    prompt: list[int],
    max_new_tokens: int,
    *,
    sampling: SamplingConfig = GREEDY,
    generator: torch.Generator | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> Decoded:
    """Plain decoding with the same verifier (one target forward per token) up to `max_new_tokens` or the
    first of `stop_ids`: greedy, or sampled at sampling's temperature, top-k and top-p."""
    return plain_generate_many(
        verifier, [prompt], max_new_tokens, sampling=sampling, generator=generator, stop_ids=stop_ids
    )[0]


@torch.no_grad()
def plain_generate_many(
    verifier: Verifier,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    sampling: SamplingConfig = GREEDY,
    generator: torch.Generator | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> list[Decoded]:
    """plain_generate of every prompt in lockstep: one target call per token for all unfinished ones."""
    device = verifier.embed_tokens_VH.device
    t0 = time.perf_counter()
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        live = [i for i, out in enumerate(outs) if not (out and out[-1] in stop_ids)]
        if not live:
            break
        ids = [torch.tensor(prompts[i] + outs[i], device=device) for i in live]
        for i, (token, _) in zip(live, _next_tokens(verifier, ids, sampling, generator), strict=True):
            outs[i].append(token)
    results = [Decoded(out) for out in outs]
    _share_seconds(results, time.perf_counter() - t0)
    return results


def _next_tokens(
    verifier: Verifier, ids: list[torch.Tensor], sampling: SamplingConfig, generator: torch.Generator | None
) -> list[tuple[int, torch.Tensor]]:
    """Per sequence (the target's next token after it, greedy or sampled; its tapped hidden states [L, K, H])."""
    verified = _verify(verifier, ids, sampling, 1)
    if sampling.greedy:
        return [(int(next_L[-1]), hidden_LKH) for next_L, hidden_LKH in verified]
    return [
        (sample_token(serving_probs(logits_1V, sampling)[0], generator), hidden_LKH)
        for logits_1V, hidden_LKH in verified
    ]


@dataclass
class DecodeReport:
    walk: WalkCounts  # the same figures as the decoding walk, from real decoding
    prompts: int
    identical: int  # prompts whose speculative output equals plain greedy decoding token for token
    first_mismatch: list[tuple[int, int]]  # (prompt index, first differing token index)
    speculative_tokens_per_s: float
    greedy_tokens_per_s: float
    max_new_tokens: int = 0  # tokens decoded per prompt at most
    sampling: SamplingConfig = GREEDY  # T > 0: both decodings sample, so outputs are not compared
    longest_reply: int = 0  # tokens of the longest speculative reply (the prefill token included)
    stopped: int = 0  # replies that ended at a stop token (the rest ran to max_new_tokens)
    # The longest reply in the drafter's training cache (its export or checkpoint records it); None: unknown.
    longest_trained_response: int | None = None

    @property
    def past_training(self) -> bool:
        """Whether a reply ran past the longest reply the drafter was trained on."""
        return self.longest_trained_response is not None and self.longest_reply > self.longest_trained_response

    def to_dict(self) -> dict:
        w = self.walk
        return {
            **w.figures(),
            "max_new_tokens": self.max_new_tokens,
            "longest_reply": self.longest_reply,
            "replies_stopped": self.stopped,
            "longest_trained_response": self.longest_trained_response,
            "num_prompts": self.prompts,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "top_k": self.sampling.top_k,
            # Sampled outputs differ from plain sampling's by their random draws: only greedy compares.
            "identical_to_greedy": self.identical if self.sampling.greedy else None,
            "first_mismatch": self.first_mismatch,
            "speculative_tokens_per_s": self.speculative_tokens_per_s,
            "greedy_tokens_per_s": self.greedy_tokens_per_s,
            "speedup": self.speculative_tokens_per_s / self.greedy_tokens_per_s,
        }

    def table(self) -> str:
        w = self.walk
        lossless = (
            f"sampled at {self._mode()}: the target's distribution by the rejection rule (not comparable token "
            "for token with plain sampling)"
            if not self.sampling.greedy
            else "identical to plain greedy decoding"
            if self.identical == self.prompts
            else f"DIFFERS from plain greedy decoding on {self.prompts - self.identical} prompts "
            f"(prompt, token): {self.first_mismatch[:5]}"
        )
        plain = "plain greedy" if self.sampling.greedy else "plain sampling"
        warning = (
            [
                f"WARNING: decoded replies of up to {self.longest_reply} tokens, past the longest reply the drafter "
                f"was trained on ({self.longest_trained_response} tokens): the figures below include positions "
                f"it never learned to draft; --max-new-tokens {self.longest_trained_response} measures what it "
                "was trained for"
            ]
            if self.past_training
            else []
        )
        return "\n".join(
            warning
            + [
                f"real speculative decoding with the target at {self._mode()}, {plural(self.prompts, 'prompt')}, "
                f"{plural(w.steps, 'step')}; {self.stopped} of {self.prompts} replies ended at a stop token, the "
                f"rest at --max-new-tokens {self.max_new_tokens}:",
                f"  acceptance length {format_figure(w.acceptance_length, '.3f')} tokens per verify step (mean over prompts; pooled "
                f"{format_figure(w.acceptance_length_pooled, '.3f')})",
                f"  accepted drafts per step, 0..{len(w.accepted_histogram) - 1}: "
                + " ".join(map(str, w.accepted_histogram)),
                *w.context_lines(),
                *w.mode_lines(),
                f"  output {lossless}",
                f"  {self.speculative_tokens_per_s:.1f} tokens/s speculative vs {self.greedy_tokens_per_s:.1f} {plain} "
                f"({self.speculative_tokens_per_s / self.greedy_tokens_per_s:.2f}x; both recompute the prefix per "
                "target forward, same machine)",
            ]
        )

    def _mode(self) -> str:
        c = self.sampling
        if c.greedy:
            return "T=0 (greedy)"
        return (
            f"T={c.temperature:g}"
            + (f", top-p {c.top_p:g}" if c.top_p < 1 else "")
            + (f", top-k {c.top_k}" if c.top_k else "")
        )


def decode_prompts(
    proposer: DraftProposer,
    verifier: Verifier,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
    context_edges: tuple[int, ...] = CONTEXT_BUCKETS,
    modes: PromptModes | None = None,
    batch: int = DECODE_BATCH,
    stop_ids: frozenset[int] = frozenset(),
) -> DecodeReport:
    """Speculative and plain decoding of every prompt, `batch` prompts at a time in lockstep (one target
    forward per step for all of them); acceptance figures as the walk's (per context_edges bucket of the
    anchor's position too, and per serving mode when `modes` (read_prompts') holds several). Sampled runs
    draw from one generator seeded with `seed` on the verifier's device (the same seed and batch, the same
    outputs). A reply ends at the first of `stop_ids` (the target's end-of-turn and eos ids, as serving stops)
    or after max_new_tokens. Progress (prompts done, tokens/s of each, ETA) as a bar on a terminal, else a log
    line at most every 10 s."""
    names = modes.names if modes is not None else ("",)
    counts = WalkCounts(proposer.block_size, context_edges=context_edges, mode_names=names)
    identical, mismatch, spec_s, plain_s, spec_n, plain_n = 0, [], 0.0, 0.0, 0, 0
    longest, stopped = 0, 0
    generator = torch.Generator(verifier.embed_tokens_VH.device).manual_seed(seed)
    progress = ProgressLog(log, None, len(prompts), desc="decoding", unit="prompt")
    plain_name = "plain greedy" if sampling.greedy else "plain sampling"
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        decode = dict(sampling=sampling, generator=generator, stop_ids=stop_ids)
        specs = speculative_generate_many(proposer, verifier, chunk, max_new_tokens, **decode)
        plains = plain_generate_many(verifier, chunk, max_new_tokens, **decode)
        for i, spec, plain in zip(range(start, start + len(chunk)), specs, plains, strict=True):
            spec_s, plain_s = spec_s + spec.seconds, plain_s + plain.seconds
            spec_n, plain_n = spec_n + len(spec.tokens), plain_n + len(plain.tokens)
            longest, stopped = max(longest, len(spec.tokens)), stopped + (spec.tokens[-1] in stop_ids)
            if spec.tokens == plain.tokens:
                identical += 1
            elif sampling.greedy:
                pairs = zip(spec.tokens, plain.tokens)  # one may stop sooner: the first token past the other's end
                mismatch.append(
                    (
                        i,
                        next(
                            (j for j, (a, b) in enumerate(pairs) if a != b), min(map(len, (spec.tokens, plain.tokens)))
                        ),
                    )
                )
            _count(counts, spec, modes.of[i] if modes is not None else 0)
            _report(progress, i + 1, spec_n / spec_s, plain_n / plain_s, plain_name)  # per prompt, as a batch ends
    progress.close()
    return DecodeReport(
        counts,
        len(prompts),
        identical,
        mismatch,
        spec_n / spec_s,
        plain_n / plain_s,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        longest_reply=longest,
        stopped=stopped,
    )


def _count(counts: WalkCounts, spec: Decoded, mode: int) -> None:
    """One response's steps into the walk's figures, its serving mode's among them."""
    for a, labels, tokens, position in zip(
        spec.step_accepted, spec.step_labels, spec.step_tokens, spec.step_positions, strict=True
    ):
        counts.add_step(a, labels)
        counts.add_context_step(position, tokens)
    if spec.step_tokens:
        counts.add_response(sum(spec.step_tokens), len(spec.step_tokens), mode)


def _report(progress: ProgressLog, done: int, spec_rate: float, plain_rate: float, plain: str) -> None:
    rates = f"{spec_rate:.1f} tokens/s speculative, {plain_rate:.1f} {plain}"
    eta = f"ETA {format_duration(progress.eta(done))}"
    progress.report(
        {},
        f"eval --target: {done}/{progress.total_units} prompts | {rates} | {eta}",
        force=done == progress.total_units,
        done_units=done,
        postfix=rates,
    )


def _rows(path: Path):
    """(where, index, row) per line of a JSON Lines file, or per row of a Parquet file (input_ids, loss_mask)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if "input_ids" not in table.column_names:
            raise ValueError(f"--prompts {path}: no input_ids column (columns: {table.column_names})")
        for n, row in enumerate(
            table.select([c for c in ("input_ids", "loss_mask", MODE_COLUMN) if c in table.column_names]).to_pylist()
        ):
            yield f"--prompts {path} row {n}", n, row
        return
    try:
        for n, row in iter_json_lines(path):
            yield f"--prompts {path} line {n}", n, row
    except InputFileError as e:
        raise ValueError(
            f'--prompts {e}; write one list of token ids or one {{"input_ids": [...]}} object per line'
        ) from None


@dataclass
class PromptModes:
    """The serving mode of each prompt (read_prompts): names[of[i]] describes prompt i's."""

    names: tuple[str, ...] = ()
    of: list[int] = field(default_factory=list)
    _index: dict[str, int] = field(default_factory=dict)

    def add(self, mode: dict[str, Any]) -> None:
        key = mode_text(mode)
        if key not in self._index:
            self._index[key] = len(self.names)
            self.names = (*self.names, describe_mode(mode))
        self.of.append(self._index[key])


def _prompt_mode(row: Any, evaluated: dict[str, Any], where: str) -> dict[str, Any]:
    """A prompt's serving mode: a token row's chat_mode, a conversation's own mode fields over the mode
    evaluated (as dflash-data prepare renders them), else the mode evaluated."""
    if not isinstance(row, dict):
        return evaluated
    if "input_ids" in row:
        return mode_from_value(row[MODE_COLUMN], where) if row.get(MODE_COLUMN) is not None else evaluated
    return row_mode(row, evaluated, where)


def read_prompts(
    path: str | Path,
    vocab_size: int,
    max_prompts: int = 0,
    render: PromptRender | None = None,
    modes: PromptModes | None = None,
    evaluated: dict[str, Any] | None = None,
) -> list[list[int]]:
    """The first `max_prompts` prompts (0 = all) of a JSON Lines file (each line a list of token ids, an
    object with "input_ids" and optionally "loss_mask": the prompt is then the tokens before the first
    supervised one, as in the dataset, or a conversation ("messages" or "conversations"), rendered by
    `render` with the target's chat template up to its last reply) or of a Parquet dataset of token rows.
    `modes` (given): filled with each prompt's serving mode: a token row's chat_mode, a conversation's own
    enable_thinking / chat_template_kwargs over `evaluated`, else `evaluated` (the mode eval runs in)."""
    prompts = []
    for where, index, row in _rows(Path(path)):
        if max_prompts and len(prompts) == max_prompts:
            break
        if modes is not None and evaluated is not None:
            modes.add(_prompt_mode(row, evaluated, where))
        if isinstance(row, dict) and "input_ids" not in row and ("messages" in row or "conversations" in row):
            if render is None:
                raise ValueError(
                    f"{where}: a conversation, which needs the target's chat template: run the `dflash-train` "
                    "console script (it renders them), or give token ids"
                )
            row = render(row, str(path), index)
        ids = row.get("input_ids") if isinstance(row, dict) else row
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"{where}: expected a non-empty list of token ids (or an object with input_ids)")
        mask = row.get("loss_mask") if isinstance(row, dict) else None
        if mask is not None:
            first = next((i for i, m in enumerate(mask) if m), len(ids))
            ids = ids[:first]
            if not ids:
                raise ValueError(f"{where}: loss_mask starts supervised, so the prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        prompts.append(ids)
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts in the file")
    return prompts
