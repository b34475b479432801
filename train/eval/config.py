"""Typed settings of evaluation on held-out shards: `dflash-train eval`'s (EvalConfig) and the evaluation
inside a training run (TrainEvalConfig, nested in TrainConfig). No torch import: the CLI builds its
options from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shards.common.cli_options import at_least, cli_field, config_error
from shards.common.compile_cache import CompileCacheConfig
from shards.format import canonical_precision


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
    """The last N shards of the cache (as dflash-train train --eval-shards). No default: exactly one of
    --shards, --eval-shards, --holdout-frac."""
    holdout_frac: float | None = None
    """The last ceil(F x shards) shards of the cache, 0 < F <= 1. No default: exactly one of --shards,
    --eval-shards, --holdout-frac."""
    num_blocks: int | None = None
    """Random-anchor blocks per shard (held-out loss, diagnostics); None = one per 24 context tokens."""
    budgets: list[int] = field(default_factory=lambda: [16, 32, 64])
    """DDTree node budgets walked besides the greedy chain; [] = chain only."""
    seed: int = 0
    """Seed of the random-anchor sampling (the walk has no randomness)."""
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
    """Prompts for --target: JSON Lines (a list of token ids per line, or {"input_ids": [...], "loss_mask": [...]}) or a Parquet dataset (prompt = the tokens before the first supervised one). Default: none."""
    max_prompts: int = 0
    """Decode only the first N prompts of --prompts; 0 = all."""
    max_new_tokens: int = 64
    """Tokens generated per prompt by --target decoding (speculative and plain greedy)."""
    compile: CompileCacheConfig = field(default_factory=CompileCacheConfig)
    """Where the compiled flex attention persists between runs (--compile-cache DIR)."""

    def __post_init__(self) -> None:
        self.dtype = canonical_precision(self.dtype, ("auto", "bfloat16", "float32"))  # bf16 taken too
        if self.cache is None and self.target is None:
            raise ValueError(
                "give --cache (the decoding walk on held-out shards), --target with --prompts (real "
                "speculative decoding with the target), or both"
            )
        if (self.target is None) != (self.prompts is None):
            raise ValueError("--target and --prompts go together: decoding needs the target and the prompts")
        if self.max_prompts < 0:
            raise ValueError(f"--max-prompts {self.max_prompts}: must be >= 0 (0 = all)")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens}: must be >= 1")
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
        for name in ("num_blocks", "lanes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


@dataclass(kw_only=True)
class TrainEvalConfig:
    """The held-out evaluation of a training run (dflash-train train's --eval-* options). Only which shards
    are held out decides the trajectory; when and how much is evaluated a resumed run may change."""

    shards: int = cli_field(0, name="eval_shards")
    """Hold out the last N shards of the cache (highest batch ids) for evaluation; never trained on."""
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
