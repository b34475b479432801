"""dflash-train: a thin click layer over run_training, export_drafter and evaluate_drafter.

dflash-train train --cache C --out D [...]      (also `dflash-train --cache C --out D`)
dflash-train export CKPT OUT                     checkpoint (or run dir: its newest) -> DFlashDraftModel dir
dflash-train eval --drafter DIR --cache C ...    held-out acceptance length, slot accuracy, tree acceptance
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from shards.common.cli_options import CONTEXT_SETTINGS, build_config, config_options, gpus_option, relaunch_if_asked
from shards.common.diskfull import refusing_when_full
from shards.common.errors import user_errors
from shards.common.logs import setup_logging
from shards.common.progress import format_figure, plural
from shards.common.terminal import echo
from train.config import TrainConfig
from train.eval.config import EvalConfig

if TYPE_CHECKING:  # the eval stack imports torch and the drafter: only when a command runs
    from train.eval.speculative import PromptRendererFactory, VerifierFactory

log = logging.getLogger("train")


@dataclass(frozen=True, kw_only=True)
class EntryPoint:
    """What the console script hands the commands, as click's context object: `main(obj=EntryPoint(...))`."""

    verifier_factory: VerifierFactory | None = None
    """Builds the target as a speculative-decoding verifier for `eval --target`. train/ never imports
    extract/, so only the `dflash-train` console script (tools/cli/dflash_train.py, which may import
    both) gives one; `python -m train.cli` runs without, and `eval --target` is then refused, naming
    the console script."""
    prompt_renderer: PromptRendererFactory | None = None
    """Renders conversation rows of `eval --prompts` with the target's chat template in the mode evaluated
    (--thinking, --template-kwarg): extract's renderer, which again only the console script may import."""


class _DefaultToTrain(click.Group):
    """`dflash-train --cache ...` means `dflash-train train --cache ...`; a first word that is neither an
    option nor a command is a mistyped command (refused with suggestions), never train's argument."""

    def parse_args(self, ctx, args):
        if args and args[0].startswith("-") and args[0] not in ("-h", "--help"):
            args = ["train", *args]
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx, args):
        name = args[0] if args else None
        if name is not None and self.get_command(ctx, name) is None:
            close = difflib.get_close_matches(name, list(self.commands), n=3)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            ctx.fail(f"No such command {name!r}.{hint} Commands: {', '.join(sorted(self.commands))}")
        return super().resolve_command(ctx, args)


@click.group(cls=_DefaultToTrain, context_settings=CONTEXT_SETTINGS)
def main() -> None:
    """Train, export and evaluate DFlash drafters from a dflash-extract hidden-state cache."""


@main.command(context_settings=CONTEXT_SETTINGS)
@config_options(TrainConfig)
@gpus_option
@user_errors(ValueError)  # config/cache mismatches, bad shards (ShardError), resume refusals, non-finite loss
def train(gpus: str | None, **options) -> None:
    """Train a DFlash drafter on a hidden-state cache.

    \b
    Examples:
      dflash-train train --cache cache --out runs/a --gpus all --eval-shards 4
      dflash-train train --cache cache --out runs/a --gpus all --resume
    Writes OUT/metrics.jsonl (one JSON record per log), OUT/run.json (config, git sha, versions, argv)
    and OUT/step-NNNNNNNN/ checkpoints; export one with `dflash-train export`.
    """
    setup_logging(other_ranks_level=logging.WARNING)
    if relaunch_if_asked("train.cli", gpus, options["device"]):
        return
    cfg = build_config(TrainConfig, options)
    from train.loop import run_training  # heavy imports after argument checks

    # metrics.jsonl, run.json, eval.json, TensorBoard: a checkpoint's own full disk names the checkpoint
    with refusing_when_full(cfg.out_dir, "the checkpoints written are intact: free space and re-run with --resume"):
        summary = run_training(cfg)
    main_rank = os.environ.get("RANK", "0") == "0"
    if summary.already_complete:
        if main_rank:
            echo(
                f"run {cfg.out_dir} is already complete: step {summary.steps} of {summary.steps}, checkpoint "
                f"{summary.last_checkpoint}; nothing to train (export it with `dflash-train export "
                f"{cfg.out_dir} DIR`, or train longer in a new --out)"
            )
        return
    if summary.stopped:
        if main_rank:
            echo(
                f"stopped by {summary.stop_signal} after step {summary.steps}: checkpoint {summary.last_checkpoint}; "
                "run the same command with --resume to continue",
                err=True,
            )
        else:  # each rank says it stopped cleanly, at the step every rank agreed on
            echo(
                f"rank {os.environ.get('RANK')}: stopped by {summary.stop_signal} after step {summary.steps}", err=True
            )
        # 128 + the signal (SIGINT 2, SIGTERM 15): the job did not finish, and nothing was lost
        sys.exit(130 if summary.stop_signal == "SIGINT" else 143)
    if main_rank:
        echo(summary.report())
        if summary.eval is not None:
            echo(summary.eval.table())
        if summary.eval_before is not None and summary.eval is not None:
            before, after = summary.eval_before, summary.eval
            start = "initial (--init-from)" if cfg.drafter.init_from else "untrained"
            echo(
                f"acceptance length on held-out shards (decoding walk): {format_figure(before.acceptance_length, '.3f')} "
                f"{start} -> {format_figure(after.acceptance_length, '.3f')} after {plural(summary.steps, 'step')}; "
                f"held-out loss {format_figure(before.heldout_loss, '.4f')} -> {format_figure(after.heldout_loss, '.4f')}"
            )


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option(
    "--overwrite", is_flag=True, help="Replace an earlier export in OUT (any other non-empty OUT is refused)."
)
@user_errors(ValueError, OSError)  # a damaged or missing checkpoint (CheckpointError), an OUT that is not ours
def export(checkpoint: str, out: str, overwrite: bool) -> None:
    """Export CHECKPOINT (a step-NNNNNNNN dir, or a run dir: its newest) to OUT as a DFlashDraftModel,
    and print the vLLM and SGLang commands that serve it on the block it was trained on."""
    setup_logging(other_ranks_level=logging.WARNING)
    from train.checkpoint.export import export_checkpoint
    from train.checkpoint.serving import serve_commands
    from train.drafter.config import DrafterConfig

    ckpt = export_checkpoint(checkpoint, out, overwrite)
    echo(f"exported {ckpt.path} (step {ckpt.step}) -> {out}")
    for line in serve_commands(DrafterConfig(**ckpt.state["drafter"]), out, ckpt.state.get("target_name")):
        echo(line)


@main.command(name="eval", context_settings=CONTEXT_SETTINGS)
@config_options(EvalConfig)
@click.option(
    "--out",
    "out_json",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the results as JSON here (acceptance_length, acceptance_length_pooled, batch_ids, ...). Default: the table on stdout only.",
)
@click.pass_obj
@user_errors(ValueError, FileNotFoundError)  # bad settings or drafter, a cache or file that is not there
def eval_cmd(entry: EntryPoint | None, out_json, **options) -> None:
    """Evaluate a drafter on held-out shards by walking them as greedy speculative decoding does.

    \b
    Reports the acceptance length (tokens per target forward, mean over responses; and pooled), the
    histogram of accepted drafts per step, per-slot acceptance, DDTree acceptance along the same walk,
    the held-out loss, and the random-anchor chain length as a diagnostic. Examples:
      dflash-train eval --drafter drafter/ --cache cache --eval-shards 8 --out eval.json
      dflash-train eval --drafter runs/a --cache cache --eval-shards 8 --dtype float32
      dflash-train eval --drafter drafter/ --target T --prompts p.jsonl --temperature 0.6 --top-p 0.95
    """
    setup_logging(other_ranks_level=logging.WARNING)
    cfg = build_config(EvalConfig, options)
    from shards.common.owned import check_output_file
    from train.outputs import is_eval_record, write_eval_json

    if out_json:  # before any work: never a user's file, never a missing directory
        check_output_file(out_json, "--out", is_eval_record, "dflash-train eval")
    from train.eval.run import run_eval  # heavy imports after argument checks

    entry = entry or EntryPoint()
    result = run_eval(cfg, verifier_factory=entry.verifier_factory, prompt_renderer=entry.prompt_renderer)
    echo(result.table())
    if out_json:
        write_eval_json(out_json, result.to_dict())


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("run", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--out", "out_png", type=click.Path(dir_okay=False), default=None, help="PNG to write. Default: RUN/run.png."
)
@user_errors(OSError, ValueError, RuntimeError)  # an unreadable run, no metrics yet, matplotlib missing
def plot(run: str, out_png: str | None) -> None:
    """Draw RUN's loss terms, learning rate, tokens/s and held-out acceptance against steps (a PNG).

    \b
    Reads RUN/metrics.jsonl (a resumed run's repeated steps: the later run wins). Needs matplotlib
    (pip install -e '.[plot]'). Open the PNG with any image viewer, e.g. `xdg-open RUN/run.png`.
    """
    from train.metrics.plot import PLOT_FILE, plot_run, read_run_metrics

    out = Path(out_png) if out_png else Path(run) / PLOT_FILE
    drawn = plot_run(run, out)
    metrics = read_run_metrics(run)
    evals = len(metrics.evals)
    echo(
        f"wrote {out}: {len(drawn)} curves over steps {metrics.records[0]['step']}..{metrics.records[-1]['step']}"
        f" ({len(metrics.records)} log records, {evals} evaluation{'s' if evals != 1 else ''})"
    )


if __name__ == "__main__":
    main()
