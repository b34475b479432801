"""Settings of one acceptance-table run (flags map 1:1 to fields, as in every CLI here).

The defaults size the run for a small trained target on one GPU (the proxy target of issue 27 on an
H200 in about ten minutes); the reduced CPU run of docs/GUIDE.md gives smaller sizes by flag. Settings
that decide a figure (data, steps, seeds, evaluation) are part of each result's fingerprint
(tools/testbed/table/steps.py: Plan.result_identity); paths, the server's batch and kernel permissions are not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from shards.common.cli_options import at_least, cli_field, config_error
from train.drafter.config import DrafterConfig


@dataclass(kw_only=True)
class TableConfig:
    """One run of the acceptance table: prompts x target -> data -> per row and seed a drafter and its figures."""

    target: str = cli_field(path="existing_dir")
    """Target checkpoint directory (config.json, safetensors, tokenizer and chat template), as dflash-extract takes it."""
    prompts: str = cli_field(path="existing_file")
    """JSON Lines, one prompt a line: {"prompt": "text"} or a chat {"messages": [...]} as dflash-data regenerate
    reads it; an "id" is kept (default: the line number). The target answers each one."""
    work: str = cli_field(path="dir")
    """Work directory: data, caches, runs, a result JSON per row and seed, table.md and table.json. The same
    command again continues where the last run stopped; results of changed settings are recomputed."""
    rows: list[str] = field(default_factory=list)
    """Rows to run, comma-separated (bf16-storage, fp8-storage, fp8-compute, sliding-layers, pca-8 / -16 / -32 and
    their -raw twins, sliding-all, dflash2, dflash2-swap, fp8-train, dflash2-fp8-train, long-context). Default:
    all."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Training seeds, the same for every row; at least 3 (each figure is a mean and a spread over them)."""
    num_prompts: int = 0
    """Prompts read from --prompts, in file order; 0 = all of them."""
    heldout_prompts: int = 32
    """Of those, prompts held out (a fixed random choice): their greedy replies make the held-out cache of the
    decoding walk and they are the prompts of real decoding; no drafter trains on them."""
    max_tokens: int = 128
    """Tokens per reply at most (dflash-data regenerate --max-tokens)."""
    train_temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    """A reply per training prompt at each temperature (0 = greedy), all trained on; held-out replies are greedy."""
    sample_seed: int = 0
    """dflash-data regenerate --seed of the sampled replies."""
    thinking: Literal["on", "off"] = "off"
    """Chat template's enable_thinking when replying and preparing (as the target will be served)."""
    server_device: str = "cpu"
    """Where the tiny OpenAI-compatible server runs the target while it answers: cpu (in float32) or cuda (in
    bfloat16, on the fast kernels; the replies differ slightly, so the data are another set)."""
    concurrency: int = 64
    """Replies generated at once (regenerate --concurrency, and the server's batch)."""
    token_budget: int = 4096
    """Tokens per packed batch and shard (dflash-extract --token-budget)."""
    max_seqs: int = 64
    """Most sequences per packed batch (dflash-extract --max-seqs)."""
    mask_token_id: int | None = None
    """The drafters' MASK token id. Default: the target's last vocabulary row (vocab_size - 1)."""
    steps: int = 200
    """Optimizer steps per drafter (one shard per step)."""
    lr: float = 3e-3
    """Peak learning rate (small drafters learn at 3e-3, as the demo's does; the 27B recipe is 6e-4)."""
    block_size: int = DrafterConfig.block_size
    """Tokens per draft block of every row's drafters (dflash-train --block-size): rows are compared at one
    block size, so a DFlash 2 row meets DFlash 1 rows of its own (the published DFlash 2 drafter uses 8)."""
    heldout_token_budget: int | None = None
    """Tokens per packed batch of the held-out caches (dflash-extract --token-budget of the held-out split):
    at least the longest held-out sample, so every row's drafters are walked over whole long samples (the
    long-context comparison) rather than samples cut at --token-budget. Default: --token-budget."""
    max_seq_len: int = 8192
    """The long-context row's dflash-extract --max-seq-len: training samples up to this long run through the
    target whole and are stored as pieces (the other rows cut them at --token-budget)."""
    context_buckets: list[int] = field(default_factory=list)
    """dflash-train eval --context-buckets of every drafter (lower edges in tokens, from 0); given, the table
    also reports acceptance per bucket (decoding walk and greedy real decoding). Default: eval's buckets, no
    bucket columns."""
    sliding_window: int = 64
    """Window of the sliding rows' sliding layers (sliding-layers, sliding-all, the DFlash 2 rows), in tokens:
    keep it below the data's lengths."""
    max_new_tokens: int | None = None
    """Tokens generated per held-out prompt by real speculative decoding (and by plain greedy decoding).
    Default: --max-tokens, the held-out replies' length, so both real-decoding columns and the decoding walk
    cover the same span of each reply."""
    eval_temperature: float = 0.7
    """Temperature of the second real-decoding column (dflash-train eval --target --temperature: rejection
    sampling, seeded with the drafter's training seed), beside the greedy one; 0 = no such column."""
    device: str = "auto"
    """Where extraction, training and evaluation run: auto (cuda when there is one), cpu or cuda."""
    data_only: bool = False
    """Make the data (prompts -> replies -> token rows in WORK/data/) and stop: for a machine that has the
    openai client, before the rest runs from a copy of WORK where there is none."""
    allow_slow_kernels: bool = False
    """Let dflash-extract run the target's torch fallbacks on CUDA (no fla-core / causal-conv1d)."""

    def __post_init__(self) -> None:
        self.rows = [str(r) for r in self.rows or ()]  # the CLI passes None for an unset list
        at_least(self, 0, "num_prompts", "sample_seed")
        at_least(self, 1, "heldout_prompts", "max_tokens", "concurrency", "token_budget", "max_seqs")
        if self.max_new_tokens is None:
            self.max_new_tokens = self.max_tokens
        at_least(self, 1, "steps", "sliding_window", "max_new_tokens")
        at_least(self, 2, "block_size")  # an anchor plus at least one draft slot
        if not 0 <= self.eval_temperature < math.inf:
            raise config_error(self, "eval_temperature", "must be a finite temperature >= 0 (0 = no T > 0 column)")
        if len(set(self.seeds)) < 3 or len(set(self.seeds)) != len(self.seeds):
            raise config_error(self, "seeds", "give at least 3 different seeds: a spread needs them")
        if any(s < 0 for s in self.seeds):
            raise config_error(self, "seeds", "seeds are integers >= 0")
        if not self.train_temperatures or any(not (0 <= t < math.inf) for t in self.train_temperatures):
            raise config_error(self, "train_temperatures", "give one or more finite temperatures >= 0")
        if len(set(self.train_temperatures)) != len(self.train_temperatures):
            raise config_error(self, "train_temperatures", "each temperature once")
        if not self.lr > 0:
            raise config_error(self, "lr", "must be > 0")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise config_error(self, "mask_token_id", "must be a token id >= 0")
        self.context_buckets = [int(b) for b in self.context_buckets or ()]  # the CLI passes None for []
        edges = self.context_buckets
        if edges and (edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:]))):
            raise config_error(self, "context_buckets", "must start at 0 and increase, e.g. 0,512,2048")
        if self.heldout_token_budget is not None:
            at_least(self, 1, "heldout_token_budget")
        if self.max_seq_len < self.token_budget:
            raise config_error(self, "max_seq_len", f"must be >= --token-budget {self.token_budget}")
        if self.thinking not in ("on", "off"):
            raise config_error(self, "thinking", "must be on or off")
