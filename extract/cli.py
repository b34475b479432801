"""dflash-extract: a thin click layer over run_extract."""

from __future__ import annotations

import logging

import click

from extract.config import ExtractConfig
from shards.common.cli_options import CONTEXT_SETTINGS, build_config, config_options, gpus_option, relaunch_if_asked
from shards.common.diskfull import refusing_when_full
from shards.common.errors import user_errors
from shards.common.logs import setup_logging
from shards.common.terminal import echo

log = logging.getLogger("extract")


@click.command(context_settings=CONTEXT_SETTINGS)
@config_options(ExtractConfig)
@gpus_option
@user_errors(ValueError, OSError)  # the family (a pre-empted run: `stopped: ...`, exit 143), bad inputs, disk
def main(gpus: str | None, **options) -> None:
    """Run the frozen target over a dataset and write its hidden states as a DFlash training cache.

    \b
    The cache (see `dflash-shards info OUT`) holds, per packed batch of --token-budget tokens, the
    target's hidden states at the tapped layers. Re-running the same command resumes: complete
    shards are kept, the rest are extracted. Examples:
      dflash-extract --target Qwen3.5-27B --data chats.parquet --out cache --mask-token-id 248070 --gpus all
      torchrun --nnodes 2 --nproc-per-node 8 ... -m extract.cli --target ... --out /shared/cache
    Disk: taps x hidden x 2 bytes per token in bf16 (5 x 5120: 51 KB), half with --storage fp8.
    """
    setup_logging()
    if relaunch_if_asked("extract.cli", gpus, options["device"]):
        return
    cfg = build_config(ExtractConfig, options)
    from extract.runner import run_extract  # heavy imports after argument checks

    with refusing_when_full(cfg.out_dir, "the complete shards are kept: free space and re-run the same command"):
        summary = run_extract(cfg)
    if summary.rank == 0:  # the job's summary (every rank's counts); the other ranks' are in their logs
        echo(summary.report())


if __name__ == "__main__":
    main()
