"""Speculative sampling at the serving temperature: the target's distribution as serving engines shape
it, the drafter's per-slot distribution q, and the rejection rule that keeps the output distributed as
the target's (Leviathan et al. 2023; Chen et al. 2023; the rule of z-lab's reference).

    p      = serving_probs(target logits): logits / T, then top-k, then top-p (vLLM's and HF's order),
             renormalised
    q_k    = the drafter's distribution of slot k (a DraftDistribution: over the whole vocabulary, or
             over a candidate set as DFlash 2's selector gives it); the draft d_k was sampled from it
    accept d_k with probability min(1, p_k(d_k) / q_k(d_k)); on the first rejection emit one token
             sampled from norm(max(p_k - q_k, 0)) and stop; when every draft is accepted, the bonus
             token is sampled from p of the next position
Conditioned on the tokens already emitted, each emitted token is then distributed exactly as p, so the
output is the target's own sampled output in distribution (not token for token: the random draws differ).

T = 0 is greedy decoding and never reaches this module: train/eval/speculative.py keeps its exact
argmax path there. Every draw takes the caller's torch.Generator, so a seed reproduces a run.

Legend: V vocab, C candidates of one slot, X rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from train.eval.config import SamplingConfig


def serving_probs(logits_XV: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Rows of next-token probabilities as a serving engine samples them at cfg (T > 0), in float32 or
    wider: temperature, then top-k (ties at the k-th value kept), then top-p (the token that crosses P kept)."""
    scaled = logits_XV.to(torch.promote_types(logits_XV.dtype, torch.float32)) / cfg.temperature
    if cfg.top_k and cfg.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, cfg.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if cfg.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the more probable tokens
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before >= cfg.top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class DraftDistribution(NamedTuple):
    """q of one draft slot: `probs` over the whole vocabulary (ids None: DFlash 1's softmax) or over the
    candidate token ids `ids` (DFlash 2's selector: the softmax over its K candidates' scores)."""

    probs: torch.Tensor  # [V], or [C] beside ids
    ids: torch.Tensor | None = None  # [C] int64 candidate token ids; None = probs is over the vocabulary

    def prob(self, token: int) -> float:
        """q(token); 0 for a token outside the candidates."""
        if self.ids is None:
            return float(self.probs[token])
        hit = (self.ids == token).nonzero()
        return float(self.probs[hit[0, 0]]) if hit.numel() else 0.0

    def dense(self, vocab_size: int) -> torch.Tensor:
        """q over the whole vocabulary [V]."""
        if self.ids is None:
            return self.probs
        return torch.zeros(vocab_size, dtype=self.probs.dtype, device=self.probs.device).index_add_(
            0, self.ids, self.probs
        )

    def sample(self, generator: torch.Generator) -> int:
        i = int(torch.multinomial(self.probs, 1, generator=generator))
        return i if self.ids is None else int(self.ids[i])


def accept_draft(p_V: torch.Tensor, q: DraftDistribution, token: int, generator: torch.Generator) -> bool:
    """Accept the draft `token` (sampled from q) with probability min(1, p(token) / q(token))."""
    u = float(torch.rand((), generator=generator, device=p_V.device, dtype=torch.float64))
    return u * q.prob(token) < float(p_V[token])


def resample_rejected(p_V: torch.Tensor, q: DraftDistribution, generator: torch.Generator) -> int:
    """The token emitted after a rejection: sampled from norm(max(p - q, 0))."""
    residual = (p_V - q.dense(p_V.shape[-1]).to(p_V.dtype)).clamp_min(0)
    if not float(residual.sum()) > 0:  # p == q up to rounding: a rejection is then (almost) impossible
        residual = p_V
    return int(torch.multinomial(residual, 1, generator=generator))


def sample_token(p_V: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(p_V, 1, generator=generator))


def verify_drafts(
    p_XV: torch.Tensor,
    drafts: list[int],
    q: list[DraftDistribution],
    num_labels: int,
    generator: torch.Generator,
) -> tuple[int, list[int]]:
    """(accepted drafts a, emitted tokens) of one chain step: p_XV[k] is the target's distribution of the
    token after slot k (row 0: after the anchor), drafts[k] ~ q[k]; only the first num_labels slots may
    be accepted (the tokens still to emit cut the chain). Emits the a drafts, then the residual sample
    on a rejection or the bonus token from p_XV[a] when all num_labels drafts were accepted."""
    for a in range(num_labels):
        if not accept_draft(p_XV[a], q[a], drafts[a], generator):
            return a, [*drafts[:a], resample_rejected(p_XV[a], q[a], generator)]
    return num_labels, [*drafts[:num_labels], sample_token(p_XV[num_labels], generator)]
