"""Typed settings of evaluation on held-out shards: `dflash-train eval`'s (EvalConfig) and the evaluation
inside a training run (TrainEvalConfig, nested in TrainConfig). No torch import: the CLI builds its
options from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shards.common.chat_mode import parse_template_kwargs
from shards.common.cli_options import at_least, cli_field, config_error
from shards.common.compile_cache import CompileCacheConfig
from shards.format import canonical_precision

# Context-length buckets of acceptance, by the anchor's absolute position: 0-2K, 2K-8K, 8K-32K, 32K+.
CONTEXT_BUCKETS = (0, 2048, 8192, 32768)
DECODE_BATCH = 32  # prompts decoded in lockstep by eval --target: one target forward per step for all of them


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How the target's and the drafter's tokens are drawn (`dflash-train eval --target`)."""

    temperature: float = 0.0
    """Sampling temperature of --target decoding, as serving runs the target (Qwen's cards: 0.6-1.0);
    0 = greedy (exact: the output equals plain greedy decoding token for token). Above 0 drafts are
    checked by rejection sampling (chain drafting only; DDTree stays greedy)."""
    top_p: float = 1.0
    """Nucleus sampling at T > 0: keep the most probable tokens whose cumulative probability first
    reaches P, applied after temperature and top-k as vLLM applies it; 1 = off."""
    top_k: int = 0
    """At T > 0 keep only the K most probable tokens (after temperature, before top-p); 0 = off."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise config_error(self, "temperature", "must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise config_error(self, "top_p", "must be in (0, 1] (1 = off)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise config_error(self, "top_k", "must be an integer >= 0 (0 = off)")
        if self.greedy and (self.top_p < 1 or self.top_k):
            raise ValueError(
                f"--top-p {self.top_p} / --top-k {self.top_k} shape sampling, and --temperature 0 is greedy: "
                "give --temperature > 0 (e.g. 0.6) or leave --top-p and --top-k unset"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(kw_only=True)
class EvalConfig:
    """What `dflash-train eval` evaluates, where and how (flags map 1:1 to fields)."""

    drafter: str = cli_field(path="existing_dir")
    """Exported drafter dir, checkpoint step-NNNNNNNN/ or run dir (its newest checkpoint)."""
    cache: str | None = cli_field(None, path="existing_dir")
    """Hidden-state cache holding the held-out shards (the decoding walk); optional with --target. Default: none (then --target does all)."""
    shards: list[int] | None = None
    """Held-out batch ids. No default: give exactly one of --shards, --eval-shards, --holdout-frac."""
    eval_shards: int | None = None
    """The last N shards of the cache, as dflash-train train --eval-shards splits them (a long sample's
    pieces all on one side). No default: exactly one of --shards, --eval-shards, --holdout-frac."""
    holdout_frac: float | None = None
    """About the last ceil(F x shards) shards of the cache, 0 < F <= 1: a split that would cut a long sample's
    pieces moves to that sample's nearer end (warned), so no sample is on both sides.
    No default: exactly one of --shards, --eval-shards, --holdout-frac."""
    num_blocks: int | None = None
    """Random-anchor blocks per shard (held-out loss, diagnostics); None = one per 24 context tokens."""
    budgets: list[int] = field(default_factory=lambda: [16, 32, 64])
    """DDTree node budgets walked besides the greedy chain; [] = chain only."""
    seed: int = 0
    """Seed of the random-anchor sampling (the walk has no randomness) and of --temperature decoding."""
    device: str = "auto"
    """auto = cuda when available, else cpu."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Weights and activations of the drafter, and with --target of the target too (one dtype for both:
    the speculative-decoding check and its greedy reference run the target in it): bfloat16 | float32 |
    auto = the compute dtype the drafter was trained in."""
    lanes: int | None = None
    """Responses walked at once (blocks per drafter forward); None = the cache's max_seqs, whole flex tiles."""
    target: str | None = cli_field(None, path="existing_dir")
    """Target checkpoint dir: also run real greedy speculative decoding with the target in the loop (needs --prompts). Default: none (no real decoding)."""
    prompts: str | None = cli_field(None, path="existing_file")
    """Prompts for --target: JSON Lines (a list of token ids per line, {"input_ids": [...], "loss_mask": [...]}, or a conversation rendered with the target's chat template in --thinking / --template-kwarg's mode) or a Parquet dataset (prompt = the tokens before the first supervised one). Default: none."""
    max_prompts: int = 0
    """Decode only the first N prompts of --prompts; 0 = all."""
    max_new_tokens: int = 64
    """Tokens generated per prompt at most by --target decoding (speculative and plain); a reply ends
    sooner at the target's stop tokens (every eos_token_id of its config.json and generation_config.json),
    as serving ends it."""
    decode_batch: int = DECODE_BATCH
    """--target decoding: prompts decoded together in lockstep, each step verifying all of them in one
    packed target forward (greedy outputs are each prompt's own; at --temperature the prompts' draws
    interleave, so the draws depend on it); 1 = one prompt at a time. The batch's whole prefixes are in
    one forward: lower it when they do not fit the device's memory together."""
    context_buckets: list[int] = field(default_factory=lambda: list(CONTEXT_BUCKETS))
    """Acceptance is also reported per context-length bucket of the anchor's position: the buckets'
    lower edges in tokens, from 0, increasing (the last bucket is open)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    thinking: Literal["on", "off"] | None = None
    """The serving mode evaluated (with --template-kwarg): thinking on or off, as the target is served;
    conversation --prompts are rendered in it. A warning when it differs from the mode the drafter's
    training data or --cache were rendered in. Default: that recorded mode, else on."""
    template_kwargs: list[str] = cli_field(flag="--template-kwarg", repeat=True, default_factory=list)
    """Another chat-template keyword of the serving mode evaluated, KEY=VALUE (JSON scalar, else text),
    repeatable: e.g. --template-kwarg reasoning_effort=high; over the recorded mode's keywords (the others
    stay). Default: the recorded mode's."""

    compile: CompileCacheConfig = field(default_factory=CompileCacheConfig)
    """Where the compiled flex attention persists between runs (--compile-cache DIR)."""

    def __post_init__(self) -> None:
        self.dtype = canonical_precision(self.dtype, ("auto", "bfloat16", "float32"))  # bf16 taken too
        self.template_kwargs = list(self.template_kwargs or ())  # click passes a tuple
        parse_template_kwargs(self.template_kwargs)
        if self.cache is None and self.target is None:
            raise ValueError(
                "give --cache (the decoding walk on held-out shards), --target with --prompts (real "
                "speculative decoding with the target), or both"
            )
        if (self.target is None) != (self.prompts is None):
            raise ValueError("--target and --prompts go together: decoding needs the target and the prompts")
        if not self.sampling.greedy and self.target is None:
            raise ValueError(
                f"--temperature {self.sampling.temperature} samples --target decoding; the walk over cached "
                "shards is greedy: give --target and --prompts, or leave --temperature at 0"
            )
        if not self.sampling.greedy and self.cache is not None and self.budgets:
            raise ValueError(
                f"--budgets {','.join(map(str, self.budgets))}: DDTree is walked greedily and takes no "
                f"--temperature ({self.sampling.temperature}); give --budgets '' (the chain only) with "
                "--temperature, or evaluate the trees in a run at --temperature 0"
            )
        if self.max_prompts < 0:
            raise ValueError(f"--max-prompts {self.max_prompts}: must be >= 0 (0 = all)")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens}: must be >= 1")
        if self.decode_batch < 1:
            raise ValueError(f"--decode-batch {self.decode_batch}: must be >= 1 (1 = one prompt at a time)")
        chosen = sum(x is not None for x in (self.shards, self.eval_shards, self.holdout_frac))
        if self.cache is not None and chosen != 1:
            raise ValueError(
                "give exactly one of --shards, --eval-shards, --holdout-frac (which shards of --cache are held out)"
            )
        if self.cache is None and chosen:
            raise ValueError("--shards, --eval-shards and --holdout-frac choose shards of --cache: give --cache too")
        if self.holdout_frac is not None and not 0 < self.holdout_frac <= 1:
            raise ValueError(f"--holdout-frac {self.holdout_frac}: must be in (0, 1]")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"--dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        if any(b < 1 for b in self.budgets):
            raise ValueError(f"--budgets must be positive node counts, got {self.budgets}")
        edges = list(self.context_buckets or [])
        if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError(f"--context-buckets {edges}: must start at 0 and increase, e.g. 0,2048,8192,32768")
        for name in ("num_blocks", "lanes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


@dataclass(kw_only=True)
class TrainEvalConfig:
    """The held-out evaluation of a training run (dflash-train train's --eval-* options). Only which shards
    are held out decides the trajectory; when and how much is evaluated a resumed run may change."""

    shards: int = cli_field(0, name="eval_shards")
    """Hold out the last N shards of the cache (highest batch ids) for evaluation; never trained on. A split
    that would cut a long sample's pieces moves to the sample's nearer end (a warning says so)."""
    every: int = cli_field(0, name="eval_every", identity=False)
    """Evaluate on the held-out shards every N steps; 0 = at the end of every epoch (with --eval-shards > 0; also before training and at the end)."""
    max_shards: int = cli_field(8, name="eval_max_shards", identity=False)
    """Evaluate on at most this many held-out shards each time."""
    tree_budgets: list[int] = cli_field(name="eval_tree_budgets", identity=False, default_factory=list)
    """DDTree node budgets the in-training evaluation also walks, e.g. 16,32,64 (each costs about one
    more chain walk per shard). Default: none, the chain walk only (dflash-train eval walks 16,32,64
    by default)."""

    def __post_init__(self) -> None:
        at_least(self, 1, "max_shards")
        at_least(self, 0, "shards", "every")
        self.tree_budgets = [int(b) for b in self.tree_budgets or ()]  # the CLI passes None for []
        if any(b < 1 for b in self.tree_budgets):
            raise config_error(self, "tree_budgets", "must be positive node counts")
