"""dflash-extract: a thin click layer over run_extract."""

from __future__ import annotations

import logging
import os
import sys

import click

from .config import ExtractConfig

log = logging.getLogger("extract")


def _taps(ctx, param, value: str | None) -> list[int] | None:
    if not value:
        return None
    try:
        return [int(v) for v in value.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated layer numbers, got {value!r}") from None


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False), help="HF checkpoint directory of the Qwen3.5-style target (config.json + *.safetensors).")
@click.option("--data", required=True, help="Parquet or JSON Lines file, directory or glob; rows hold input_ids, optional loss_mask (0/1) and id.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Cache directory to create, or to resume when it exists.")
@click.option("--taps", "tap_layer_ids", callback=_taps, help="Target layers to store, e.g. 1,16,31,46,61 (tap j = output of layer j). Default: DFlash's spread for --num-taps.")
@click.option("--num-taps", default=5, show_default=True, help="Number of taps when --taps is not given: round(1 + i*(N-4)/(L-1)).")
@click.option("--storage", "storage_dtype", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True, help="Hidden-state storage: bf16, or fp8 e4m3 with a per-token-per-tap scale (half the disk).")
@click.option("--target-topk", default=0, show_default=True, help="Also store the target's top-K next tokens and log-probs per position (for KL training); 0 = off.")
@click.option("--token-budget", default=49152, show_default=True, help="Tokens per packed batch and shard, real plus padding.")
@click.option("--max-seqs", default=128, show_default=True, help="Most sequences per packed batch.")
@click.option("--long-seqs", type=click.Choice(["truncate", "skip", "error"]), default="truncate", show_default=True, help="Samples longer than the token budget: cut, drop (counted) or refuse.")
@click.option("--pad-token-id", default=0, show_default=True, help="Token id written on padding positions.")
@click.option("--mask-token-id", type=int, default=None, help="The drafter's MASK token id, recorded in the cache (248070 for Qwen3.5).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True, help="Dtype the target runs in.")
@click.option("--device", default="auto", show_default=True, help="auto = cuda:LOCAL_RANK when CUDA exists, else cpu.")
@click.option("--gpus", default=None, help="Start one process per GPU under torchrun: a number or 'all'. Omit when you launch torchrun yourself.")
@click.option("--allow-slow-kernels", is_flag=True, help="Permit torch fallbacks on CUDA when fla-core / causal-conv1d are missing (much slower).")
@click.option("--overwrite", is_flag=True, help="Delete an existing cache at --out and start over.")
@click.option("--fast-resume", is_flag=True, help="On resume, check existing shards' headers only instead of their checksums.")
@click.option("--progress-interval", "progress_interval_s", default=10.0, show_default=True, help="Seconds between progress lines.")
def main(gpus: str | None, fast_resume: bool, **options) -> None:
    """Run the frozen target over a dataset and write its hidden states as a DFlash training cache.

    \b
    The cache (see `dflash-shards info OUT`) holds, per packed batch of --token-budget tokens, the
    target's hidden states at the tapped layers. Re-running the same command resumes: complete
    shards are kept, the rest are extracted. Examples:
      dflash-extract --target Qwen3.5-27B --data chats.parquet --out cache --mask-token-id 248070 --gpus all
      torchrun --nnodes 2 --nproc-per-node 8 ... -m extract.cli --target ... --out /shared/cache
    Disk: taps x hidden x 2 bytes per token in bf16 (5 x 5120: 51 KB), half with --storage fp8.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if gpus is not None and "LOCAL_RANK" not in os.environ:
        _launch_torchrun(gpus)
        return
    from .runner import CacheMismatchError, run_extract  # heavy imports after argument checks

    try:
        cfg = ExtractConfig(full_resume_check=not fast_resume, **options)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    try:
        summary = run_extract(cfg)
    except (CacheMismatchError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(summary.report())


def _launch_torchrun(gpus: str) -> None:
    from shards.runtime import relaunch_under_torchrun

    try:
        relaunch_under_torchrun("extract.cli", gpus, sys.argv[1:])
    except ValueError as e:
        raise click.UsageError(str(e)) from e


if __name__ == "__main__":
    main()
