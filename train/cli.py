"""dflash-train: a thin click layer over run_training, export_drafter and evaluate_drafter.

  dflash-train train --cache C --out D [...]      (also `dflash-train --cache C --out D`)
  dflash-train export CKPT OUT                     checkpoint (or run dir: its newest) -> DFlashDraftModel dir
  dflash-train eval --drafter DIR --cache C ...    held-out acceptance length, slot accuracy, tree acceptance
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import click

from shards.cli_options import CONTEXT_SETTINGS, INT_LIST, build_config, config_options, gpus_option, relaunch_if_asked

from .train_config import TrainConfig

log = logging.getLogger("train")


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s" if rank == "0" else f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING, format=fmt, datefmt="%H:%M:%S")


class _DefaultToTrain(click.Group):
    """`dflash-train --cache ...` means `dflash-train train --cache ...`."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["train", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_DefaultToTrain, context_settings=CONTEXT_SETTINGS)
def main() -> None:
    """Train, export and evaluate DFlash drafters from a dflash-extract hidden-state cache."""


@main.command(context_settings=CONTEXT_SETTINGS)
@config_options(TrainConfig)
@gpus_option
def train(gpus: str | None, **options) -> None:
    """Train a DFlash drafter on a hidden-state cache.

    \b
    Examples:
      dflash-train train --cache cache --out runs/a --gpus all --eval-shards 4
      dflash-train train --cache cache --out runs/a --gpus all --resume
    Writes OUT/metrics.jsonl (one JSON record per log), OUT/run.json (config, git sha, versions, argv)
    and OUT/step-NNNNNNNN/ checkpoints; export one with `dflash-train export`.
    """
    _setup_logging()
    if relaunch_if_asked("train.cli", gpus):
        return
    cfg = build_config(TrainConfig, options)
    from .loop import run_training  # heavy imports after argument checks

    try:
        summary = run_training(cfg)
    except ValueError as e:  # config/cache mismatches, bad shards (ShardError), resume refusals
        raise click.ClickException(str(e)) from e
    except RuntimeError as e:
        from .metrics import NonFiniteError

        if isinstance(e, NonFiniteError):
            raise click.ClickException(str(e)) from e
        raise
    if os.environ.get("RANK", "0") == "0":
        rec = summary.last_record or {}
        click.echo(f"done: {summary.steps} steps, {summary.tokens_seen} tokens, final loss "
                   f"{rec.get('loss/total', float('nan')):.4f}, {len(summary.skipped_shards)} shards skipped; "
                   f"checkpoint {summary.last_checkpoint}")
        if summary.eval is not None:
            click.echo(summary.eval.table())
        if summary.eval_before is not None and summary.eval is not None:
            click.echo(f"acceptance length on held-out shards: {summary.eval_before.acceptance_length:.3f} untrained "
                       f"-> {summary.eval.acceptance_length:.3f} after {summary.steps} steps")


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
def export(checkpoint: str, out: str) -> None:
    """Export CHECKPOINT (a step-NNNNNNNN dir, or a run dir: its newest) to OUT as a DFlashDraftModel."""
    _setup_logging()
    from .checkpoint import latest_checkpoint, list_checkpoints
    from .export import export_drafter

    path = Path(checkpoint)
    ckpt = next((c for c in list_checkpoints(path.parent) if c.path.resolve() == path.resolve()), None)
    if ckpt is None:
        ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise click.ClickException(f"{checkpoint}: not a valid checkpoint (step-NNNNNNNN with train_state.json, "
                                   "model.safetensors, optimizer.pt) nor a run directory holding one")
    model, cfg = _model_from_checkpoint(ckpt)
    export_drafter(model, cfg, out)
    click.echo(f"exported {ckpt.path} (step {ckpt.step}) -> {out}")


def _model_from_checkpoint(ckpt):
    from safetensors.torch import load_file

    from .checkpoint import MODEL_FILE
    from .drafter_config import DrafterConfig
    from .model import DFlashDrafter

    cfg = DrafterConfig(**ckpt.state["drafter"])
    model = DFlashDrafter(cfg)
    model.load_state_dict(load_file(str(ckpt.path / MODEL_FILE)), strict=True)
    return model, cfg


@main.command(name="eval", context_settings=CONTEXT_SETTINGS)
@click.option("--drafter", required=True, type=click.Path(exists=True, file_okay=False), help="Exported drafter (config.json + model.safetensors) or a training checkpoint step-NNNNNNNN/.")
@click.option("--cache", required=True, type=click.Path(exists=True, file_okay=False), help="Hidden-state cache holding the held-out shards.")
@click.option("--shards", type=INT_LIST, help="Held-out batch ids, e.g. 40,41,42.")
@click.option("--eval-shards", type=int, default=None, help="The last N shards of the cache (as dflash-train --eval-shards).")
@click.option("--holdout-frac", type=float, default=None, help="The last ceil(F x shards) shards of the cache.")
@click.option("--num-blocks", type=int, default=None, help="Blocks per shard (fixed-seed anchors). Default: as training.")
@click.option("--budgets", default="16,32,64", show_default=True, type=INT_LIST, help="DDTree node budgets.")
@click.option("--seed", default=0, show_default=True, help="Seed of the per-shard anchor sampling.")
@click.option("--device", default="auto", show_default=True, help="auto = cuda when available, else cpu.")
@click.option("--out", "out_json", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON here.")
def eval_cmd(drafter, cache, shards, eval_shards, holdout_frac, num_blocks, budgets, seed, device, out_json) -> None:
    """Evaluate a drafter on held-out shards: acceptance length (+1 bonus), slot accuracy, tree acceptance."""
    _setup_logging()
    chosen = [x is not None for x in (shards, eval_shards, holdout_frac)]
    if sum(chosen) != 1:
        raise click.UsageError("give exactly one of --shards, --eval-shards, --holdout-frac")
    import torch

    from shards import ShardReader, load_target_head

    from .blocks import default_num_blocks
    from .evaluate import evaluate_drafter
    from .model import TargetHead

    reader = ShardReader(cache)
    all_ids = reader.batch_ids()
    if shards is not None:
        missing = sorted(set(shards) - set(all_ids))
        if missing:
            raise click.UsageError(f"--shards {missing} not in cache {cache}")
        ids = shards
    else:
        n = eval_shards if eval_shards is not None else math.ceil(holdout_frac * len(all_ids))
        if not 1 <= n <= len(all_ids):
            raise click.UsageError(f"held-out shard count {n} outside [1, {len(all_ids)}] for cache {cache}")
        ids = all_ids[-n:]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, cfg = _load_any_drafter(Path(drafter), dtype, dev)
    cc = reader.config
    problems = []
    if list(cfg.tap_layer_ids) != list(cc.tap_layer_ids):
        problems.append(f"taps: drafter {cfg.tap_layer_ids}, cache {cc.tap_layer_ids}")
    if (cfg.hidden_size, cfg.vocab_size) != (cc.target.hidden_size, cc.target.vocab_size):
        problems.append(f"hidden/vocab: drafter {cfg.hidden_size}/{cfg.vocab_size}, "
                        f"cache {cc.target.hidden_size}/{cc.target.vocab_size}")
    if problems:
        raise click.ClickException(f"drafter {drafter} does not fit cache {cache}: {'; '.join(problems)}")
    head_t = load_target_head(cache)
    head = TargetHead(head_t["embed_tokens"].to(dev, dtype), head_t["lm_head"].to(dev, dtype))
    result = evaluate_drafter(model, head, cache, ids, num_blocks=num_blocks or default_num_blocks(cc.token_budget, cfg.block_size),
                              seed=seed, device=dev, attention="flex" if dev.type == "cuda" else "sdpa",
                              budgets=budgets)
    click.echo(result.table())
    if out_json:
        Path(out_json).write_text(json.dumps(result.to_dict(), indent=1) + "\n")


def _load_any_drafter(path: Path, dtype, device):
    from .checkpoint import STATE_FILE, list_checkpoints
    from .export import load_exported_drafter

    if (path / STATE_FILE).is_file():
        ckpt = next((c for c in list_checkpoints(path.parent) if c.path.resolve() == path.resolve()), None)
        if ckpt is None:
            raise click.ClickException(f"{path}: incomplete checkpoint")
        model, cfg = _model_from_checkpoint(ckpt)
        return model.to(device, dtype), cfg
    return load_exported_drafter(path, dtype=dtype, device=device)


if __name__ == "__main__":
    main()
