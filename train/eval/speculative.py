"""Greedy speculative decoding with a DFlash drafter and the target in the loop: lossless by
construction (every emitted token is the target's own greedy choice), measured per step.

    prefill   the verifier runs the prompt: the target's greedy next token is the first anchor, and
              its tapped hidden states are the drafter's context
    step      draft: block [anchor, MASK x (B-1)] over the context strictly before the anchor ->
              B-1 drafts d_1..d_{B-1} (argmax); verify: the target runs prompt + output + drafts and
              returns its greedy token g_k after every position; accept the longest prefix with
              d_k == g_k (a drafts, never past max_new_tokens); emit g_1..g_{a+1} (the a drafts and
              the bonus token), cut at max_new_tokens; the bonus token is the next anchor
This is the loop of z-lab's dflash_generate; the decoding walk over cached shards (train/eval/walk.py)
does the same steps on data, and on the target's own greedy data it gives the same figures.

The target is any `Verifier`: given token ids it returns the target's greedy next token after every
position and the tapped hidden states (recomputing the whole prefix each call is acceptable: this
measures acceptance and relative speed, not a serving engine). train/ never imports extract/ (house
rule), so the target verifier is built in tools/ (tools/cli/verifier.py) and handed in as an argument:
the `dflash-train` console script (tools/cli/dflash_train.py) gives train/cli.py's commands a factory
for extract's target model (train.cli.EntryPoint), and `eval` passes it to run_eval and on to
build_verifier. `--target` without one (e.g. `python -m train.cli`) is refused, naming the entry point.

Legend: L tokens so far, K taps, H hidden, B block size, S = B-1 drafts, V vocab.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from shards.common.json_input import InputFileError, iter_json_lines
from shards.common.progress import ProgressLog, format_duration, format_figure, plural
from train.drafter.model import DFlashDrafter, TargetHead
from train.eval.walk import WalkCounts


class Verifier(Protocol):
    """The target as speculative decoding needs it."""

    embed_tokens_VH: torch.Tensor  # the target's input embedding (the drafter embeds its block with it)
    lm_head_VH: torch.Tensor  # the target's LM head (the drafter's logits)

    def __call__(self, input_ids_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(greedy next token after every position [L] int64, tapped hidden states [L, K, H])."""
        ...


log = logging.getLogger(__name__)

VerifierFactory = Callable[..., Verifier]  # (target_dir, tap_layer_ids, device, dtype) -> Verifier


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
    tokens: list[int]  # the max_new_tokens generated tokens
    step_tokens: list[int] = field(default_factory=list)  # tokens emitted per verification step
    step_accepted: list[int] = field(default_factory=list)  # drafts accepted per step
    step_labels: list[int] = field(default_factory=list)  # drafts that could be accepted per step (the cut)
    seconds: float = 0.0


@torch.no_grad()
def speculative_generate(
    model: DFlashDrafter,
    head: TargetHead,
    verifier: Verifier,
    prompt: list[int],
    max_new_tokens: int,
    *,
    context_dtype: torch.dtype | None = torch.bfloat16,
) -> Decoded:
    """Greedy speculative decoding of `max_new_tokens` tokens after `prompt`.

    context_dtype: the verifier's hidden states are rounded to it before the drafter sees them (the
    cache's storage dtype, so decoding feeds the drafter what training and the walk fed it); None = as is.
    """
    cfg = model.config
    B, S = cfg.block_size, cfg.block_size - 1
    device, dtype = head.embed_tokens_VH.device, head.embed_tokens_VH.dtype
    t0 = time.perf_counter()
    n0 = len(prompt)
    next_L, hidden_LKH = verifier(torch.tensor(prompt, device=device))
    out = [int(next_L[-1])]
    result = Decoded(out)
    mask_block = torch.full((B,), cfg.mask_token_id, device=device, dtype=torch.long)
    while len(out) < max_new_tokens:
        p, remaining = n0 + len(out) - 1, max_new_tokens - len(out)  # anchor position, tokens still to emit
        ctx_LKH = hidden_LKH[:p]
        if context_dtype is not None:
            ctx_LKH = ctx_LKH.to(context_dtype)
        block_B = mask_block.clone()
        block_B[0] = out[-1]
        pos = torch.arange(p + B, device=device)
        hidden_BH = model.forward_block(ctx_LKH.to(dtype), pos[:p], head.embed(block_B), pos[p:])
        drafts = model.greedy_drafts(hidden_BH[1:], head, block_B[0]).tolist()
        next_L, hidden_LKH = verifier(torch.tensor(prompt + out + drafts, device=device))
        greedy = next_L[p : p + B].tolist()  # greedy[k-1]: the target's token at position p + k
        labels = min(S, remaining)
        a = 0
        while a < labels and drafts[a] == greedy[a]:
            a += 1
        emitted = greedy[: min(a + 1, remaining)]
        out += emitted
        result.step_tokens.append(len(emitted))
        result.step_accepted.append(a)
        result.step_labels.append(labels)
    result.seconds = time.perf_counter() - t0
    return result


@torch.no_grad()
def greedy_generate(verifier: Verifier, prompt: list[int], max_new_tokens: int) -> Decoded:
    """Plain greedy decoding with the same verifier (one target forward per token)."""
    device = verifier.embed_tokens_VH.device
    t0 = time.perf_counter()
    out: list[int] = []
    while len(out) < max_new_tokens:
        next_L, _ = verifier(torch.tensor(prompt + out, device=device))
        out.append(int(next_L[-1]))
    return Decoded(out, seconds=time.perf_counter() - t0)


@dataclass
class DecodeReport:
    walk: WalkCounts  # the same figures as the decoding walk, from real decoding
    prompts: int
    identical: int  # prompts whose speculative output equals plain greedy decoding token for token
    first_mismatch: list[tuple[int, int]]  # (prompt index, first differing token index)
    speculative_tokens_per_s: float
    greedy_tokens_per_s: float
    max_new_tokens: int = 0  # tokens decoded per prompt
    # The longest reply in the drafter's training cache (its export or checkpoint records it); None: unknown.
    longest_trained_response: int | None = None

    @property
    def past_training(self) -> bool:
        """Whether decoding ran past the longest reply the drafter was trained on."""
        return self.longest_trained_response is not None and self.max_new_tokens > self.longest_trained_response

    def to_dict(self) -> dict:
        w = self.walk
        return {
            **w.figures(),
            "max_new_tokens": self.max_new_tokens,
            "longest_trained_response": self.longest_trained_response,
            "num_prompts": self.prompts,
            "identical_to_greedy": self.identical,
            "first_mismatch": self.first_mismatch,
            "speculative_tokens_per_s": self.speculative_tokens_per_s,
            "greedy_tokens_per_s": self.greedy_tokens_per_s,
            "speedup": self.speculative_tokens_per_s / self.greedy_tokens_per_s,
        }

    def table(self) -> str:
        w = self.walk
        lossless = (
            "identical to plain greedy decoding"
            if self.identical == self.prompts
            else f"DIFFERS from plain greedy decoding on {self.prompts - self.identical} prompts "
            f"(prompt, token): {self.first_mismatch[:5]}"
        )
        warning = (
            [
                f"WARNING: decoded {self.max_new_tokens} tokens per prompt, past the longest reply the drafter "
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
                f"real speculative decoding with the target, {plural(self.prompts, 'prompt')}, "
                f"{plural(w.steps, 'step')}:",
                f"  acceptance length {format_figure(w.acceptance_length, '.3f')} (mean over prompts; pooled "
                f"{format_figure(w.acceptance_length_pooled, '.3f')})",
                f"  accepted drafts per step, 0..{len(w.accepted_histogram) - 1}: "
                + " ".join(map(str, w.accepted_histogram)),
                f"  output {lossless}",
                f"  {self.speculative_tokens_per_s:.1f} tokens/s speculative vs {self.greedy_tokens_per_s:.1f} plain greedy "
                f"({self.speculative_tokens_per_s / self.greedy_tokens_per_s:.2f}x; both recompute the prefix per "
                "target forward, same machine)",
            ]
        )


def decode_prompts(
    model: DFlashDrafter,
    head: TargetHead,
    verifier: Verifier,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    context_dtype: torch.dtype | None = torch.bfloat16,
) -> DecodeReport:
    """Speculative and plain greedy decoding of every prompt; acceptance figures as the walk's. Progress
    (prompts done, tokens/s of each, ETA) as a bar on a terminal, else a log line at most every 10 s."""
    counts = WalkCounts(model.config.block_size)
    identical, mismatch, spec_s, greedy_s = 0, [], 0.0, 0.0
    progress = ProgressLog(log, None, len(prompts), desc="decoding", unit="prompt")
    for i, prompt in enumerate(prompts):
        spec = speculative_generate(model, head, verifier, prompt, max_new_tokens, context_dtype=context_dtype)
        plain = greedy_generate(verifier, prompt, max_new_tokens)
        spec_s, greedy_s = spec_s + spec.seconds, greedy_s + plain.seconds
        _report(progress, i + 1, max_new_tokens, spec_s, greedy_s)
        if spec.tokens == plain.tokens:
            identical += 1
        else:
            mismatch.append((i, next(j for j, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b)))
        for a, labels in zip(spec.step_accepted, spec.step_labels):
            counts.add_step(a, labels)
        if spec.step_tokens:
            counts.add_response(sum(spec.step_tokens), len(spec.step_tokens))
    progress.close()
    total = len(prompts) * max_new_tokens
    return DecodeReport(
        counts, len(prompts), identical, mismatch, total / spec_s, total / greedy_s, max_new_tokens=max_new_tokens
    )


def _report(progress: ProgressLog, done: int, max_new_tokens: int, spec_s: float, greedy_s: float) -> None:
    rates = f"{done * max_new_tokens / spec_s:.1f} tokens/s speculative, {done * max_new_tokens / greedy_s:.1f} plain greedy"
    eta = f"ETA {format_duration(progress.eta(done))}"
    progress.report(
        {},
        f"eval --target: {done}/{progress.total_units} prompts | {rates} | {eta}",
        force=done == progress.total_units,
        done_units=done,
        postfix=rates,
    )


def _rows(path: Path):
    """(where, row) per line of a JSON Lines file, or per row of a Parquet file (input_ids, loss_mask)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if "input_ids" not in table.column_names:
            raise ValueError(f"--prompts {path}: no input_ids column (columns: {table.column_names})")
        for n, row in enumerate(
            table.select([c for c in ("input_ids", "loss_mask") if c in table.column_names]).to_pylist()
        ):
            yield f"--prompts {path} row {n}", row
        return
    try:
        for n, row in iter_json_lines(path):
            yield f"--prompts {path} line {n}", row
    except InputFileError as e:
        raise ValueError(
            f'--prompts {e}; write one list of token ids or one {{"input_ids": [...]}} object per line'
        ) from None


def read_prompts(path: str | Path, vocab_size: int, max_prompts: int = 0) -> list[list[int]]:
    """The first `max_prompts` prompts (0 = all) of a JSON Lines file (each line a list of token ids, or
    an object with "input_ids" and optionally "loss_mask": the prompt is then the tokens before the
    first supervised one, as in the dataset) or of a Parquet dataset with those columns."""
    prompts = []
    for where, row in _rows(Path(path)):
        if max_prompts and len(prompts) == max_prompts:
            break
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
