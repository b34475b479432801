"""`python -m tools.testbed.table`: the acceptance table from one command (a thin click layer over run_table).

    python -m tools.testbed.table --target DIR --prompts prompts.jsonl --work WORK [--rows ...] [--seeds 0,1,2]

Prints one progress line per step (what runs, elapsed, ETA) and, at the end, the table in Markdown;
writes WORK/table.md and WORK/table.json (after each drafter too). The pipeline's own output goes to
WORK/logs/. The same command again continues where a cut run stopped.
"""

from __future__ import annotations

import logging
import shlex
import sys

import click

from shards.common.cli_options import CONTEXT_SETTINGS, build_config, config_options
from shards.common.errors import user_errors
from shards.common.logs import DATE_FORMAT
from tools.testbed.table.config import TableConfig
from tools.testbed.table.store import PROGRAM


def _console_logging() -> None:
    """The table's own lines on stderr; the root logger gets a silent handler, so the pipeline's CLIs (run
    in this process) leave their logging set-up alone and log only into their files (clis.run_cli)."""
    table = logging.getLogger("tools.testbed.table")
    if not table.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", DATE_FORMAT))
        table.addHandler(handler)
    table.setLevel(logging.INFO)
    table.propagate = False
    if not logging.getLogger().handlers:
        logging.getLogger().addHandler(logging.NullHandler())


@click.command(context_settings=CONTEXT_SETTINGS)
@config_options(TableConfig)
@user_errors(ValueError, OSError)  # refused settings, a --work of other files, a failed pipeline command
def main(**options) -> None:
    """Train drafters for every numerics choice (row) on the same data, steps, block size and seeds, and
    tabulate their acceptance (decoding walk, real decoding greedy and at --eval-temperature), held-out loss
    and cache bytes per token.

    \b
    Data: the target answers --prompts through dflash-data regenerate (tiny server), dflash-data prepare,
    then dflash-extract per row. Rows: bf16-storage (baseline), fp8-storage, fp8-compute (CUDA only),
    sliding-layers, pca-8/16/32 (and -raw), sliding-all, dflash2, dflash2-swap, fp8-train (CUDA only),
    dflash2-fp8-train (CUDA only, against dflash2-swap), long-context (against sliding-all). Every row
    but the fp8-train ones trains in bf16 (--fp8 off). Each row is trained with
    every seed; the table gives mean [min, max] and says which differences from the baseline are within
    the seeds' spread.
    """
    _console_logging()
    cfg = build_config(TableConfig, options)
    from tools.testbed.table.run import run_table  # torch and the pipeline after the argument checks

    run = run_table(cfg, command=f"{PROGRAM} {shlex.join(sys.argv[1:])}")
    if run.markdown:  # --data-only makes no table
        click.echo(run.markdown)


if __name__ == "__main__":
    main()
