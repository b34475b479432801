"""The rows of the acceptance table: one numerics choice each, declared as data.

A row says only what differs from the baseline in how its drafters are made: dflash-extract options (how
the cache is made: storage, FP8 compute, compact caches) and dflash-train train options (how the drafter
trains: sliding layers, DFlash 2 and its objective choice; later FP8 training, window reuse). The table's
own options come first and a row's replace them flag by flag (the baseline row is the table's options
alone). Data, steps, seeds, block size and evaluation belong to the table and are the same for every row,
so a difference between two rows is the row's doing. The issue that adds a numerics choice adds an entry to ROWS.

A value in braces names a table setting ("{sliding_window}"), filled in from the run's TableConfig: a
window, say, has to fit the lengths of the data at hand. "{pca_rank_N}" is 1/N of the target's taps'
width (5 taps x its hidden size; Plan.settings), so that the compact-cache rows keep their fraction on
any target.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Row:
    """One numerics choice: a row of the table."""

    name: str
    """Key of the row: --rows selects it, its results are stored under it."""
    what: str
    """What the row changes, in one line (the table's notes)."""
    extract_options: Mapping[str, str | None] = field(default_factory=dict)
    """dflash-extract flags and their values, over the table's own (rows with equal options share caches);
    None: a flag that takes no value."""
    train_options: Mapping[str, str | None] = field(default_factory=dict)
    """dflash-train train flags and their values, over the table's own; None: a flag that takes no value."""
    needs_cuda: bool = False
    """Runs only on CUDA; elsewhere the row is reported as skipped, never run on a stand-in path."""
    versus: str | None = None
    """The row this one is compared with, when not the baseline (the row that differs from it by this choice alone)."""

    def extract_settings(self, settings: Mapping[str, Any]) -> dict[str, str | None]:
        return _filled(self.extract_options, settings)

    def train_settings(self, settings: Mapping[str, Any]) -> dict[str, str | None]:
        return _filled(self.train_options, settings)

    def describe(self, settings: Mapping[str, Any]) -> str:
        return self.what.format(**settings)


def _filled(options: Mapping[str, str | None], settings: Mapping[str, Any]) -> dict[str, str | None]:
    return {flag: None if value is None else value.format(**settings) for flag, value in options.items()}


def words(options: Mapping[str, str | None]) -> list[str]:
    """Command-line words of {flag: value}: `--flag value`, or `--flag` alone for None."""
    return [word for flag, value in options.items() for word in ((flag,) if value is None else (flag, value))]


PCA_FRACTIONS = (8, 16, 32)  # the compact-cache rows' ranks: 1/N of the taps' width (issue 30)
# The DFlash 2 rows' selector losses where the gold token is outside the top-K (dflash-train --selector-gold).
SELECTOR_GOLD = {
    "drop": "its slot gets no selector loss (the strict top-K, as SpecForge and NeMo)",
    "swap": "it replaces the weakest candidate (as speculators)",
}

ROWS: tuple[Row, ...] = (
    Row(
        name="bf16-storage",
        what="the baseline: hidden states stored in bf16, the target in bf16, 5 full-attention drafter layers",
    ),
    Row(
        name="fp8-storage",
        what="hidden states stored as fp8 e4m3 with a per-token-per-tap scale (half the bytes)",
        extract_options={"--storage": "fp8"},
    ),
    Row(
        name="fp8-compute",
        what="the target's linear layers on FP8 e4m3 matmuls during extraction (bf16 storage)",
        extract_options={"--compute": "fp8"},
        needs_cuda=True,
    ),
    Row(
        name="sliding-layers",
        what="drafter layers 1-4 sliding-window ({sliding_window} tokens), layer 5 full (the published "
        "Qwen3.6-27B layout) instead of 5 full layers",
        train_options={"--layer-types": "sliding,sliding,sliding,sliding,full", "--sliding-window": "{sliding_window}"},
    ),
    *(
        Row(
            name=f"pca-{n}{'' if normalize == 'per-tap' else '-raw'}",
            what=f"fp8 codes of the taps' top principal directions, 1/{n} of the taps' width (K*H/{n} codes; "
            + ("each tap scaled by 1/rms first)" if normalize == "per-tap" else "no scaling before the projection)"),
            extract_options={"--storage": "fp8", "--pca-rank": f"{{pca_rank_{n}}}", "--pca-normalize": normalize},
        )
        for normalize in ("per-tap", "none")
        for n in PCA_FRACTIONS
    ),
    # FP8 drafter training (issue 32): the proxy target's hidden size (256) and vocabulary (4096) are
    # multiples of 16, so the head's GEMMs run FP8 too; a linear that is not stays bf16 (train/drafter/fp8.py).
    Row(
        name="fp8-train",
        what="the drafter trained on FP8 matmuls: its linears and the frozen LM head's two GEMMs in the loss "
        "(torchao float8 training: e4m3 forward, e5m2 gradients, tensorwise scales; dflash-train --fp8 "
        "linears+head), bf16 cache",
        train_options={"--fp8": "linears+head"},
        needs_cuda=True,
    ),
    # DFlash 2 (issue 29) in the published layout, every layer sliding: sliding-all is DFlash 1 in that
    # layout, so dflash2 against it is the architecture alone; dflash2-swap against dflash2 the objective's
    # one open choice (gold token outside the top-K: slot dropped, or swapped into the candidates).
    Row(
        name="sliding-all",
        what="all 5 drafter layers sliding-window ({sliding_window} tokens): the DFlash 2 rows' layout in DFlash 1",
        train_options={"--layer-types": ",".join(["sliding"] * 5), "--sliding-window": "{sliding_window}"},
    ),
    # Long context (issue 31): sliding-all's drafter, its training samples kept whole. The table's held-out
    # caches are the same for every row (--heldout-token-budget keeps long held-out samples whole there too),
    # so against sliding-all, which cuts training samples at --token-budget, this is long training data alone.
    Row(
        name="long-context",
        what="sliding-all trained on long samples kept whole: training samples of up to {max_seq_len} tokens run "
        "through the target as one sequence, stored as pieces (dflash-extract --max-seq-len {max_seq_len} "
        "--piece-context {sliding_window}), instead of cut at {token_budget} tokens",
        extract_options={"--max-seq-len": "{max_seq_len}", "--piece-context": "{sliding_window}"},
        train_options={"--layer-types": ",".join(["sliding"] * 5), "--sliding-window": "{sliding_window}"},
        versus="sliding-all",
    ),
    *(
        Row(
            name="dflash2" if gold == "drop" else f"dflash2-{gold}",
            what=f"a DFlash 2 drafter (block convolutions, candidate selector) in the published layout (5 sliding "
            f"layers, window {{sliding_window}} tokens); a gold token outside the top-K: {meaning} (--selector-gold "
            f"{gold})",
            train_options={"--arch": "dflash2", "--sliding-window": "{sliding_window}", "--selector-gold": gold},
        )
        for gold, meaning in SELECTOR_GOLD.items()
    ),
    # FP8 training of a DFlash 2 drafter (dflash-train's --fp8 auto keeps DFlash 2 in bf16 until this row
    # has judged it): against dflash2-swap, the same drafter trained in bf16.
    Row(
        name="dflash2-fp8-train",
        what="dflash2-swap trained on FP8 matmuls: its linears and the frozen LM head's two GEMMs, whose logits "
        "the selector also reads (dflash-train --fp8 linears+head)",
        train_options={
            "--arch": "dflash2",
            "--sliding-window": "{sliding_window}",
            "--selector-gold": "swap",
            "--fp8": "linears+head",
        },
        needs_cuda=True,
        versus="dflash2-swap",
    ),
)
BASELINE = ROWS[0].name  # the row every other one is compared with


def select_rows(names: Sequence[str], rows: Sequence[Row] = ROWS) -> list[Row]:
    """The rows named (all when none), in table order; an unknown name is refused, listing the known ones."""
    known = {row.name: row for row in rows}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"--rows {','.join(unknown)}: no such row; the rows are {', '.join(known)}")
    return [row for row in rows if not names or row.name in names]
