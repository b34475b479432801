"""dflash-data: conversations in, the token dataset dflash-extract reads out (a thin click layer).

    dflash-data regenerate --server URL --model NAME --data chats.jsonl --out regen.jsonl
    dflash-data prepare --target DIR --data regen.jsonl --out data.parquet
"""

from __future__ import annotations

import logging

import click

from .rows import DataError

_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}
_NUM_FAILURES_SHOWN = 20


@click.group(context_settings=_CONTEXT)
def main() -> None:
    """Turn chat datasets into DFlash training data with the target's own chat template and replies.

    \b
    Input conversations: OpenAI messages ({"messages": [{"role", "content",
    "reasoning_content", "tool_calls"}]}) or ShareGPT ({"conversations": [{"from", "value"}]}),
    as JSON Lines, JSON or Parquet; a file, a directory or a glob.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)


@main.command(context_settings=_CONTEXT)
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False), help="Target checkpoint directory: config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja.")
@click.option("--data", required=True, help="Conversations: .jsonl / .json / .parquet file, directory or glob.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Parquet file to write (id, input_ids, loss_mask), plus OUT.summary.json.")
@click.option("--thinking", type=click.Choice(["on", "off"]), default="on", show_default=True, help="Render as served with thinking on (reasoning kept where the template keeps it) or off (reasoning removed). Must match how the target will be served.")
@click.option("--max-length", type=int, default=None, help="Tokens per sample at most (default: no limit).")
@click.option("--long-seqs", type=click.Choice(["truncate", "skip", "error"]), default="truncate", show_default=True, help="Samples past --max-length: cut, drop (listed in the summary) or refuse.")
@click.option("--skip-bad-rows", is_flag=True, help="Write the good rows and list the bad ones in the summary, instead of refusing.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out file.")
def prepare(thinking: str, **options) -> None:
    """Render conversations with the target's chat template and mask what the model generates.

    The loss mask is 1 on exactly the tokens the model writes in assistant turns (reasoning,
    content, tool calls and the end-of-turn token), computed on the final rendering, so templates
    that rewrite earlier turns (Qwen3.5 drops earlier reasoning) are handled.
    """
    from .chat import ChatTemplateError
    from .prepare import PrepareConfig, prepare_dataset

    try:
        cfg = PrepareConfig(thinking=thinking == "on", **options)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    try:
        summary = prepare_dataset(cfg)
    except (DataError, ChatTemplateError, FileExistsError, OSError) as e:
        raise click.ClickException(str(e)) from e
    for item in summary.skipped[:_NUM_FAILURES_SHOWN]:
        click.echo(f"skipped {item['row']}: {item['reason']}", err=True)
    click.echo(f"done: {summary.line()} (summary in {cfg.out}.summary.json)")


@main.command(context_settings=_CONTEXT)
@click.option("--server", required=True, help="OpenAI-compatible API base URL, e.g. http://localhost:8000/v1 (vllm serve / SGLang).")
@click.option("--model", required=True, help="Model name as the server serves it.")
@click.option("--data", required=True, help="Conversations: .jsonl / .json / .parquet file, directory or glob.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="JSON Lines file to write; re-running the same command resumes it.")
@click.option("--temperature", default=0.0, show_default=True, help="Sampling temperature; 0 = greedy.")
@click.option("--max-tokens", default=4096, show_default=True, help="Generated tokens per reply at most.")
@click.option("--thinking", type=click.Choice(["on", "off"]), default="on", show_default=True, help="enable_thinking in the server's chat template; reasoning is kept in reasoning_content.")
@click.option("--seed", type=int, default=None, help="Sampling seed sent with every request.")
@click.option("--concurrency", default=32, show_default=True, help="Conversations in flight at once.")
@click.option("--request-timeout", "request_timeout_s", default=600.0, show_default=True, help="Seconds one request may take before it is retried.")
@click.option("--max-retries", default=5, show_default=True, help="Retries per request after timeouts, HTTP 5xx / 429 and connection errors.")
@click.option("--retry-backoff", "retry_backoff_s", default=2.0, show_default=True, help="Seconds before the first retry, doubled for each further one (at most 60).")
@click.option("--api-key", default="EMPTY", show_default=True, help="Bearer token for servers started with an API key.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar with conversations/s, generated tokens/s and ETA.")
def regenerate(thinking: str, **options) -> None:
    """Replace assistant turns with the target's own replies from an OpenAI-compatible server.

    Turn by turn, each with the conversation so far (earlier turns already replaced) as context.
    Resumable: finished conversations are kept by id, a partial last line of a killed run is
    removed. Conversations that still fail after retries are listed and left out; re-run the same
    command to retry them.
    """
    from .regenerate import RegenerateConfig, regenerate_dataset

    try:
        cfg = RegenerateConfig(thinking=thinking == "on", **options)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    try:
        summary = regenerate_dataset(cfg)
    except (DataError, ValueError, ConnectionError, FileExistsError, OSError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"done: {summary.line()}")
    if summary.failures:
        for failure in summary.failures[:_NUM_FAILURES_SHOWN]:
            click.echo(f"failed {failure.sample_id!r} ({failure.where}): {failure.reason}", err=True)
        if len(summary.failures) > _NUM_FAILURES_SHOWN:
            click.echo(f"... and {len(summary.failures) - _NUM_FAILURES_SHOWN} more", err=True)
        raise click.ClickException(
            f"{len(summary.failures)} conversations failed and are not in {cfg.out}; re-run the same command to retry them"
        )


if __name__ == "__main__":
    main()
