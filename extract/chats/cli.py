"""dflash-data: conversations in, the token dataset dflash-extract reads out (a thin click layer).

Options come from PrepareConfig and RegenerateConfig (shards.common.cli_options: one flag per field, the
field's docstring is its --help).

    dflash-data regenerate --server URL --model NAME --data chats.jsonl --out regen.jsonl
    dflash-data prepare --target DIR --data regen.jsonl --out data.parquet
"""

from __future__ import annotations

import logging

import click

from extract.chats.prepare import PrepareConfig, prepare_dataset
from extract.chats.regenerate import RegenerateConfig
from shards.common.cli_options import CONTEXT_SETTINGS, build_config, config_options
from shards.common.diskfull import refusing_when_full
from shards.common.errors import user_errors
from shards.common.logs import setup_logging
from shards.common.terminal import echo

_NUM_FAILURES_SHOWN = 20


@click.group(context_settings=CONTEXT_SETTINGS)
def main() -> None:
    """Turn chat datasets into DFlash training data with the target's own chat template and replies.

    \b
    Input conversations: OpenAI messages ({"messages": [{"role", "content",
    "reasoning_content", "tool_calls"}]}) or ShareGPT ({"conversations": [{"from", "value"}]}),
    as JSON Lines, JSON or Parquet; a file, a directory or a glob.
    """
    setup_logging()
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)


@main.command(context_settings=CONTEXT_SETTINGS)
@config_options(PrepareConfig)
@user_errors(OSError)  # the family (DataError, ChatTemplateError), an unreadable input, an existing --out
def prepare(**options) -> None:
    """Render conversations with the target's chat template and mask what the model generates.

    The loss mask is 1 on exactly the tokens the model writes in assistant turns (reasoning,
    content, tool calls and the end-of-turn token), computed on the final rendering, so templates
    that rewrite earlier turns (Qwen3.5 drops earlier reasoning) are handled.
    """
    cfg = build_config(PrepareConfig, options)
    with refusing_when_full(cfg.out, "nothing was written (the output appears complete or not at all): free space"):
        summary = prepare_dataset(cfg)
    for item in summary.skipped[:_NUM_FAILURES_SHOWN]:
        echo(f"skipped {item['row']}: {item['reason']}", err=True)
    echo(f"done: {summary.line()} (summary in {cfg.out}.summary.json)")


@main.command(context_settings=CONTEXT_SETTINGS)
@config_options(RegenerateConfig)
@user_errors(ValueError, OSError)  # the family, bad settings or rows, an unreachable server (ConnectionError)
def regenerate(**options) -> None:
    """Replace assistant turns with the target's own replies from an OpenAI-compatible server.

    Turn by turn, each with the conversation so far (earlier turns already replaced) as context.
    Resumable: finished conversations are kept by id, a partial last line of a killed run is
    removed. Conversations that still fail after retries are listed and left out; re-run the same
    command to retry them.
    """
    from extract.chats.regenerate import regenerate_dataset

    cfg = build_config(RegenerateConfig, options)
    kept = "the conversations written are kept: free space and re-run the same command to do the rest"
    with refusing_when_full(cfg.out, kept):
        summary = regenerate_dataset(cfg)
    echo(f"done: {summary.line()}")
    if summary.failures:
        for failure in summary.failures[:_NUM_FAILURES_SHOWN]:
            echo(f"failed {failure.sample_id!r} ({failure.where}): {failure.reason}", err=True)
        if len(summary.failures) > _NUM_FAILURES_SHOWN:
            echo(f"... and {len(summary.failures) - _NUM_FAILURES_SHOWN} more", err=True)
        raise click.ClickException(
            f"{len(summary.failures)} conversations failed and are not in {cfg.out}; re-run the same command to retry them"
        )


if __name__ == "__main__":
    main()
