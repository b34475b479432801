"""The proxy target's training settings (tools/testbed/train_target.py's flags) and the --smoke ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shards.common.cli_options import cli_field, config_error
from tools.testbed.corpus import CORPUS_FILE
from tools.testbed.proxy_config import PROXY_TARGET_DIR


@dataclass(kw_only=True)
class TrainTargetConfig:
    """One training run of the proxy target: data, schedule, evaluation, device."""

    out_dir: str = cli_field(flag="--out", path="dir")
    """Directory to write the checkpoint, metrics.json and README.md into; must be empty or new."""
    corpus: str = cli_field(str(CORPUS_FILE), path="existing_file")
    """The corpus file (checked against tools/testbed/corpus.py CORPUS_SHA256)."""
    tokenizer_from: str = cli_field(str(PROXY_TARGET_DIR), path="existing_dir")
    """Directory holding the tokenizer files to ship with the checkpoint (trained by tools.testbed.tokenizer)."""
    seed: int = 0
    """Seed of the initial weights and of the batch order."""
    epochs: float = 6.0
    """Passes over the train split; the steps they take are the plan (see --max-steps, --time-limit)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps. Default: the steps of --epochs."""
    time_limit: float = 480.0
    """Seconds of training (data preparation and the final evaluation come on top, ~1 min on a GPU);
    the learning-rate schedule ends there if the steps have not ended it first."""
    batch_tokens: int = 32768
    """Tokens per batch, padding included (whole chats, right-padded to the longest)."""
    max_seq_len: int = 2048
    """Longer chats are cut to this many tokens (counted in metrics.json)."""
    lr: float = 2e-3
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr * min_lr_ratio."""
    warmup_steps: int = 50
    """Linear warmup from 0 to lr over this many steps."""
    weight_decay: float = 0.1
    """AdamW weight decay of the matrices (norms, A_log and dt_bias are not decayed)."""
    grad_clip: float = 1.0
    """Clip the gradients' global norm to this."""
    loss_on: Literal["all", "assistant"] = "all"
    """Train on every next token, or on the reply tokens only."""
    log_every: int = 10
    """Steps between progress lines (each one host sync)."""
    eval_every: int = 100
    """Steps between held-out evaluations during training; 0 = only the final one."""
    num_reply_prompts: int = 64
    """Held-out prompts whose greedy replies measure repetitiveness (spread evenly over the split)."""
    max_new_tokens: int = 256
    """Longest greedy reply."""
    max_train_chats: int | None = None
    """Train on the first N chats of the train split only. Default: all."""
    max_heldout_chats: int | None = None
    """Evaluate on the first N chats of the held-out split only. Default: all."""
    device: str = "auto"
    """cuda, cpu or auto (cuda when there is one)."""
    allow_slow_kernels: bool = False
    """On CUDA, train even when fla-core is not importable (HF's torch fallback: far slower)."""

    def __post_init__(self) -> None:
        for name in ("batch_tokens", "max_seq_len", "log_every", "num_reply_prompts", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise config_error(self, name, "must be at least 1")
        if self.max_seq_len > self.batch_tokens:
            raise config_error(self, "max_seq_len", f"must be at most --batch-tokens {self.batch_tokens}")
        if not (self.epochs > 0 and self.time_limit > 0 and self.lr > 0):
            raise ValueError(
                f"--epochs, --time-limit and --lr must be positive, got {self.epochs}, {self.time_limit}, {self.lr}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise config_error(self, "min_lr_ratio", "must be in [0, 1]")
        if self.device not in ("auto", "cuda", "cpu"):
            raise config_error(self, "device", "must be cuda, cpu or auto")


# --smoke: the settings a CI run uses (a few CPU steps on a few chats), for options left at their default.
SMOKE = dict(
    device="cpu",
    max_steps=3,
    batch_tokens=1024,
    max_seq_len=512,
    warmup_steps=1,
    log_every=1,
    eval_every=0,
    max_train_chats=8,
    max_heldout_chats=4,
    num_reply_prompts=2,
    max_new_tokens=8,
)
