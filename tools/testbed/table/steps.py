"""One row and seed of the table through the real CLIs: the row's caches, a drafter, its figures.

    dflash-extract  the training and the held-out prompts' data, with the table's options and the row's over
                    them (WORK/caches/<digest>/train and heldout; rows with equal options share them); the
                    held-out cache never in pieces, in batches of --heldout-token-budget when given, so a
                    long-context row is walked on the same whole samples as the others
    dflash-train train   --max-steps steps on the training cache, the seed, the table's and the row's options;
                    --resume, so a run cut by a time limit continues from its last checkpoint
    dflash-train eval    the decoding walk on the held-out cache (acceptance, held-out loss) and real greedy
                    speculative decoding with the target in the loop on the held-out prompts; then, with
                    --eval-temperature T > 0, real decoding of the same prompts at T (rejection sampling,
                    seeded with the training seed: each seed's drafter meets its own draws)

Figures of a result: walk_acceptance, real_acceptance (tokens per target forward, mean over responses),
sampled_acceptance (the same at T; None when T = 0), walk_acceptance@BUCKET and real_acceptance@BUCKET
(per context bucket of the anchor's position, eval's --context-buckets; NaN or None where no step was),
heldout_loss (random-anchor blocks of the held-out cache), bytes_per_token (the training cache's own
figure, as `dflash-shards info` prints it) and real_lossless (greedy real decoding gave plain greedy's tokens).

Each result carries the fingerprint of everything it depends on (`result_identity`): the data's content,
the cache options, the training and evaluation options, the seed and the device; nothing else.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from extract.cli import main as extract_cli
from extract.config import ExtractConfig
from extract.target.config import TargetConfig
from shards.inspect import summarize_cache
from tools.cli.dflash_train import entry_point
from tools.testbed.table.clis import run_cli
from tools.testbed.table.config import TableConfig
from tools.testbed.table.data import Dataset
from tools.testbed.table.rows import PCA_FRACTIONS, Row, words
from tools.testbed.table.store import WorkDir, digest
from train.cli import main as train_cli

PIECE_FLAGS = ("--max-seq-len", "--piece-context", "--piece-label-reach")  # dflash-extract's long-sample pieces
EXTRACT_DTYPE = "bfloat16"  # the target runs in bf16, as for a real target (and as FP8 compute needs)
# Bumped when a result's figures change meaning: older results are then recomputed. 2: sampled_acceptance and
# the table's --block-size (results of 1 have no T > 0 figure). 3: real decoding ends each reply at the
# target's stop tokens, as serving does (results of 2 decoded past them to --max-new-tokens).
RESULT_VERSION = 3


@dataclass(frozen=True)
class Caches:
    train: Path
    heldout: Path


class Plan:
    """The options and fingerprints of one table run: the same for every row but where a row says otherwise."""

    def __init__(self, cfg: TableConfig, dataset: Dataset, device_type: str):
        self.cfg, self.dataset, self.device_type = cfg, dataset, device_type
        target = TargetConfig.from_dir(cfg.target)
        taps_width = ExtractConfig.num_taps * target.hidden_size  # the table extracts dflash-extract's default taps
        # What a row's "{name}" values are filled from: the table's settings and the projected rows' ranks.
        self.settings = {**vars(cfg), **{f"pca_rank_{n}": str(taps_width // n) for n in PCA_FRACTIONS}}
        mask = cfg.mask_token_id
        self.mask_token_id = target.vocab_size - 1 if mask is None else mask

    def extract_options(self, row: Row) -> dict[str, str | None]:
        """dflash-extract's options that decide the cache: the table's, then the row's over them."""
        table = {
            "--storage": "bf16",
            "--compute": "dense",
            "--dtype": EXTRACT_DTYPE,
            "--token-budget": str(self.cfg.token_budget),
            "--max-seqs": str(self.cfg.max_seqs),
            "--mask-token-id": str(self.mask_token_id),
        }
        return {**table, **row.extract_settings(self.settings)}

    def heldout_extract_options(self, row: Row) -> dict[str, str | None]:
        """The held-out cache's: the row's, its samples never pieced (whole in a batch of
        --heldout-token-budget tokens when given), so a long-context row is walked on the others' samples."""
        options = {k: v for k, v in self.extract_options(row).items() if k not in PIECE_FLAGS}
        if self.cfg.heldout_token_budget is not None:
            options["--token-budget"] = str(self.cfg.heldout_token_budget)
        return options

    def train_options(self, row: Row, seed: int) -> dict[str, str | None]:
        """dflash-train train's options that decide the drafter: the table's, then the row's over them. The
        table trains in bf16 (--fp8 off, not the default auto) so that every row but the fp8-train ones is
        judged against the same bf16 baseline on any GPU."""
        table = {
            "--fp8": "off",
            "--max-steps": str(self.cfg.steps),
            "--lr": f"{self.cfg.lr:g}",
            "--seed": str(seed),
            "--block-size": str(self.cfg.block_size),
        }
        return {**table, **row.train_settings(self.settings)}

    def eval_options(self) -> dict[str, str | None]:
        """dflash-train eval's options of the walk and greedy real decoding (the anchors' seed: eval's default)."""
        options = {"--holdout-frac": "1", "--budgets": "", "--max-new-tokens": str(self.cfg.max_new_tokens)}
        return {**options, **self._buckets()}

    def _buckets(self) -> dict[str, str | None]:
        edges = self.cfg.context_buckets
        return {"--context-buckets": ",".join(map(str, edges))} if edges else {}

    def sampled_eval_options(self, seed: int) -> dict[str, str | None] | None:
        """dflash-train eval's options of real decoding at --eval-temperature, drawn with the training seed;
        None when the table has no T > 0 column."""
        if self.cfg.eval_temperature == 0:
            return None
        return {
            "--temperature": f"{self.cfg.eval_temperature:g}",
            "--seed": str(seed),
            "--max-new-tokens": str(self.cfg.max_new_tokens),
            **self._buckets(),
        }

    def cache_identity(self, row: Row) -> dict:
        identity = {"data": self.dataset.identity, "extract": self.extract_options(row), "device": self.device_type}
        heldout = self.heldout_extract_options(row)
        return identity if heldout == identity["extract"] else {**identity, "heldout_extract": heldout}

    def result_identity(self, row: Row, seed: int) -> dict:
        return {
            "version": RESULT_VERSION,
            "cache": self.cache_identity(row),
            "train": self.train_options(row, seed),
            "eval": self.eval_options(),
            "eval_sampled": self.sampled_eval_options(seed),
        }

    def fingerprint(self, row: Row, seed: int) -> str:
        return digest(self.result_identity(row, seed))


def make_caches(plan: Plan, work: WorkDir, row: Row) -> Caches:
    """The row's training and held-out caches: extracted, or resumed / checked by dflash-extract itself."""
    folder = work.subdir("caches", digest(plan.cache_identity(row))[:16])
    device = ["--device", plan.cfg.device, "--progress-interval", "10"]
    device += ["--allow-slow-kernels"] if plan.cfg.allow_slow_kernels else []
    for split, data in (("train", plan.dataset.train), ("heldout", plan.dataset.heldout)):
        args = ["--target", plan.cfg.target, "--data", str(data), "--out", str(folder / split)]
        options = plan.extract_options(row) if split == "train" else plan.heldout_extract_options(row)
        if split == "heldout" and "--pca-rank" in options:
            args += ["--pca-from", str(folder / "train")]  # the codes the drafters trained on read
        run_cli(
            "dflash-extract",
            extract_cli,
            [*args, *words(options), *device],
            work.log(f"extract-{folder.name}-{split}"),
        )
    return Caches(folder / "train", folder / "heldout")


def train_and_evaluate(plan: Plan, work: WorkDir, row: Row, seed: int, caches: Caches) -> dict:
    """Train the (row, seed) drafter, evaluate it, and return its result record (not yet stored)."""
    fingerprint = plan.fingerprint(row, seed)
    folder = work.subdir("runs", row.name, fingerprint[:16])
    summary = summarize_cache(caches.train)
    # --max-steps decides the run's length; the epochs only have to reach it.
    epochs = math.ceil(plan.cfg.steps / summary["num_shards"])
    cadence = ["--epochs", str(epochs), "--log-every", str(max(1, plan.cfg.steps // 10))]
    cadence += ["--checkpoint-every", str(max(1, plan.cfg.steps // 4)), "--resume", "--device", plan.cfg.device]
    args = ["train", "--cache", str(caches.train), "--out", str(folder / "run"), *cadence]
    started = time.monotonic()
    run_cli(
        "dflash-train",
        train_cli,
        [*args, *words(plan.train_options(row, seed))],
        work.log(f"{row.name}-seed{seed}-train"),
    )
    trained = time.monotonic()
    label, heldout = f"{row.name}-seed{seed}", ["--prompts", str(plan.dataset.heldout)]
    inputs = ["--cache", str(caches.heldout), *heldout]
    greedy = _evaluate(plan, work, folder, inputs, plan.eval_options(), label, "eval")
    sampled_options = plan.sampled_eval_options(seed)
    sampled = sampled_options and _evaluate(plan, work, folder, heldout, sampled_options, label, "eval-sampled")
    figures = _figures(greedy, sampled, summary)
    return {
        "row": row.name,
        "seed": seed,
        "fingerprint": fingerprint,
        "identity": plan.result_identity(row, seed),
        "figures": figures,
        "seconds": {"train": round(trained - started, 1), "eval": round(time.monotonic() - trained, 1)},
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _evaluate(plan: Plan, work: WorkDir, folder: Path, inputs: list[str], options: dict, label: str, kind: str) -> dict:
    """dflash-train eval of FOLDER/run's drafter with the target in the loop: its JSON report (FOLDER/KIND.json;
    the whole output in WORK/logs/LABEL-KIND.log)."""
    out = folder / f"{kind}.json"
    args = ["eval", "--drafter", str(folder / "run"), "--target", plan.cfg.target, *inputs, "--device", plan.cfg.device]
    run_cli(
        "dflash-train",
        train_cli,
        [*args, "--out", str(out), *words(options)],
        work.log(f"{label}-{kind}"),
        entry_point(),
    )
    return json.loads(out.read_text())


def _figures(greedy: dict, sampled: dict | None, train_cache: dict) -> dict:
    decoding = greedy["speculative_decoding"]
    # Per context bucket of the anchor's position (NaN where no step was anchored): walk and greedy decoding.
    buckets = {
        f"{figure}@{label}": value
        for figure, by_context in (("walk_acceptance", greedy), ("real_acceptance", decoding))
        for label, value in by_context["acceptance_by_context"].items()
    }
    return {
        **buckets,
        "walk_acceptance": greedy["acceptance_length"],
        "real_acceptance": decoding["acceptance_length"],
        "sampled_acceptance": None if sampled is None else sampled["speculative_decoding"]["acceptance_length"],
        "heldout_loss": greedy["heldout_loss"],
        "bytes_per_token": train_cache["bytes_per_token"],
        "real_lossless": decoding["identical_to_greedy"] == decoding["num_prompts"],
    }
