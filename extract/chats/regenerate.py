"""dflash-data regenerate: replace the assistant turns of conversations with the target's own replies.

A DFlash drafter learns what its target says, so the training text should be the target's output.
This client sends each conversation, turn by turn, to an OpenAI-compatible server (vLLM, SGLang,
tools/fixtures/tiny_server.py): for every assistant turn it asks for a reply given the conversation so far
(earlier turns already replaced) and puts the reply in its place; a conversation that ends with a
user or tool message also gets a final reply. Tool results stay as they were (tools are not run).
Greedy by default; thinking on or off through `chat_template_kwargs: {enable_thinking}`; the
reasoning the server returns (`reasoning_content`, or `reasoning`) is kept in `reasoning_content`.

Output: JSON Lines of {"id", "messages", "tools"?}, the input format of `dflash-data prepare`,
written in input order, one line per finished conversation, plus OUT.regenerate.json recording the
settings. Resumable: a re-run of the same command keeps the conversations already in OUT (by id),
removes a partial last line left by a killed run, and does the rest, so nothing is lost or
duplicated; other settings are refused, naming each. Requests that time out or fail with 5xx / 429
/ connection errors are retried with exponential backoff; a conversation that still fails is
listed in the summary (id, row, reason) and left out of OUT, so the next run retries it. So is one
whose answer is no chat completion (an HTML page, no choices, cut JSON) or holds tool-call arguments
that are not a JSON object (never rewritten: the drafter would learn parameters the model never
wrote). Token figures count only replies whose usage the server reported; the rest are unknown.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args
from urllib.parse import urlsplit

from extract.chats.conversations import FINISH_REASON, Conversation, iter_conversations
from extract.chats.conversations import REGENERATE_META_SUFFIX as META_SUFFIX
from extract.chats.prepare import Thinking, check_output_file
from extract.chats.wire import Retryable, completion, completion_tokens, excerpt, model_ids, reply_message, wire_message
from extract.dataset.rows import DataError
from shards.common.chat_mode import THINKING_KEY, parse_template_kwargs
from shards.common.cli_options import cli_field, config_error
from shards.common.durable import atomic_write_bytes, atomic_write_text
from shards.common.json_input import InputFileError, parse_json, read_json
from shards.common.owned import Dir
from shards.common.progress import ProgressLog, format_duration

logger = logging.getLogger(__name__)

# In every line of OUT: the sha256 of the input conversation it answers, so a resume redoes edited ones.
SOURCE_KEY = "regenerated_from_sha256"
MODE_KEY = "chat_template_kwargs"  # each row's serving mode, as the server's chat template took it
_META_KEYS = ("model", "temperature", "max_tokens", "thinking", "seed")  # settings a resume must share
TEMPLATE_KWARGS_KEY = "template_kwargs"  # one more, absent from the records of runs before --template-kwarg
_MAX_BACKOFF_S = 60.0
_NO_KEY = "EMPTY"  # --api-key's default: what the OpenAI client needs to send when the server wants none


@dataclass(kw_only=True)
class RegenerateConfig:
    """One dflash-data regenerate run: conversations x server -> conversations with the target's replies."""

    server: str
    """OpenAI-compatible API base URL, e.g. http://localhost:8000/v1 (vllm serve, SGLang)."""
    model: str
    """Model name as the server serves it."""
    data: str
    """Conversations: .jsonl / .json / .parquet file, directory or glob."""
    out: str = cli_field(path="file")
    """JSON Lines file to write; re-running the same command resumes it."""
    temperature: float = 0.0
    """Sampling temperature; 0 = greedy."""
    max_tokens: int = 4096
    """Generated tokens per reply at most."""
    thinking: Thinking = "on"
    """enable_thinking in the server's chat template; the reasoning is kept in reasoning_content."""
    template_kwargs: list[str] = cli_field(flag="--template-kwarg", repeat=True, default_factory=list)
    """Another chat-template keyword of the serving mode, KEY=VALUE (JSON scalar, else text), repeatable:
    e.g. --template-kwarg reasoning_effort=high. Default: none."""
    seed: int | None = None
    """Sampling seed sent with every request. Default: none sent."""
    concurrency: int = 32
    """Conversations in flight at once."""
    request_timeout_s: float = cli_field(600.0, flag="--request-timeout")
    """Seconds one request may take before it is retried."""
    max_retries: int = 5
    """Retries per request after timeouts, HTTP 5xx / 429 and connection errors."""
    retry_backoff_s: float = cli_field(2.0, flag="--retry-backoff")
    """Seconds before the first retry, doubled for each further one (at most 60)."""
    api_key: str = cli_field(_NO_KEY, envvar="OPENAI_API_KEY")
    """Bearer token, for servers started with an API key (vLLM and SGLang ignore it otherwise). Prefer setting
    OPENAI_API_KEY (the OpenAI client's convention) to the flag: a flag's value shows in `ps` and stays in the
    shell history. Never logged nor recorded, and blanked out of what the server answers."""
    progress: bool = True
    """Progress with conversations/s, generated tokens/s and ETA: a bar on a terminal, plain lines in a log."""

    def __post_init__(self) -> None:
        for name in ("max_tokens", "concurrency", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise config_error(self, name, "must be positive")
        for name in ("temperature", "max_retries", "retry_backoff_s"):
            if getattr(self, name) < 0:
                raise config_error(self, name, "must be >= 0")
        for name in ("temperature", "request_timeout_s", "retry_backoff_s"):
            if not math.isfinite(getattr(self, name)):
                raise config_error(self, name, "must be a finite number")
        if self.thinking not in get_args(Thinking):
            raise config_error(self, "thinking", f"must be one of {get_args(Thinking)}")
        if urlsplit(self.server).scheme not in ("http", "https"):
            raise config_error(self, "server", "must be an http(s) URL, e.g. http://localhost:8000/v1")
        if not self.out.endswith(".jsonl"):
            raise config_error(self, "out", "must be a .jsonl file")
        self.template_kwargs = list(self.template_kwargs or ())  # click passes a tuple
        parse_template_kwargs(self.template_kwargs)

    @property
    def chat_template_kwargs(self) -> dict[str, Any]:
        """--template-kwarg as the template's keywords."""
        return parse_template_kwargs(self.template_kwargs)

    @property
    def server_template_kwargs(self) -> dict[str, Any]:
        """What every request sends as chat_template_kwargs, and every row written records: the mode."""
        return {THINKING_KEY: self.thinking == "on", **self.chat_template_kwargs}

    @property
    def base_url(self) -> str:
        """The server URL with /v1 appended when it has no path (vLLM and SGLang serve under /v1)."""
        url = self.server.rstrip("/")
        return url + "/v1" if urlsplit(url).path in ("", "/") else url


@dataclass
class Failure:
    sample_id: str
    where: str  # file and row of the conversation
    reason: str


@dataclass
class RegenerateSummary:
    out: str
    num_input: int = 0  # conversations in --data
    num_kept: int = 0  # already in OUT from an earlier run
    num_written: int = 0  # finished in this run
    num_replies: int = 0  # replies generated in this run
    num_truncated_replies: int = 0  # replies that hit max_tokens (finish_reason "length")
    num_retries: int = 0
    generated_tokens: int = 0  # summed over the replies whose usage the server reported
    num_replies_without_usage: int = 0  # no usage, or a completion_tokens that is not a count: unknown
    seconds: float = 0.0  # from the server's first answer to the last reply (start-up not counted)
    torn_bytes_removed: int = 0  # partial last line of a killed run, removed at start
    failures: list[Failure] = dataclasses.field(default_factory=list)

    def gen_rate(self, seconds: float) -> str:
        """Generated tokens/s over `seconds`; unknown when no reply came with usage (a 0 would be a claim)."""
        if self.num_replies and self.num_replies_without_usage == self.num_replies:
            return "gen tok/s unknown"
        return f"{self.generated_tokens / seconds if seconds else 0.0:,.0f} gen tok/s"

    def tokens(self) -> str:
        """The generated-token figures, saying how many replies they leave out for want of usage."""
        unknown = self.num_replies_without_usage
        if self.num_replies and unknown == self.num_replies:
            return "tokens unknown: the server reported no valid usage"
        text = f"{self.generated_tokens} tokens, {self.gen_rate(self.seconds)}"
        if unknown:
            text += f" (counted over {self.num_replies - unknown} replies; {unknown} came without valid usage)"
        return text

    def line(self) -> str:
        return (
            f"{self.num_written} conversations regenerated ({self.num_replies} replies, {self.tokens()}, "
            f"{self.num_truncated_replies} cut at max_tokens, {self.num_retries} retries), "
            f"{self.num_kept} kept from an earlier run, {len(self.failures)} failed -> {self.out}"
        )


def _read_done(out: Path) -> tuple[dict[str, str | None], int]:
    """The conversations already in OUT, id -> the sha256 of the input they were made from (None for
    lines of older versions); a partial last line (no newline: the run was killed mid-write) is cut
    off. Returns (done, bytes removed)."""
    if not out.exists():
        return {}, 0
    with Dir.open(out.parent) as d:
        raw = d.read_bytes(out.name)
        cut = 0
        if raw and not raw.endswith(b"\n"):
            keep = raw.rfind(b"\n") + 1
            cut = len(raw) - keep
            fd = d.open_own(out.name, os.O_WRONLY)
            try:
                os.ftruncate(fd, keep)
            finally:
                os.close(fd)
            raw = raw[:keep]
            logger.warning("%s: removed a partial last line (%d bytes) left by an interrupted run", out, cut)
    done = {}
    for number, line in enumerate(raw.splitlines(), 1):
        try:
            row = parse_json(line, str(out))
            done[str(row["id"])] = row.get(SOURCE_KEY)
        except (InputFileError, KeyError, TypeError, AttributeError) as e:
            raise DataError(f"{out}, line {number}: not a regenerated conversation ({e}); the file was edited") from e
    return done, cut


def source_sha256(conv: Conversation) -> str:
    """What the replies of a regenerated line depend on: every turn but the assistant's (those are
    replaced; only where they stand counts) and the tools. Other fields of the row do not count."""
    turns = [m if m["role"] != "assistant" else "assistant" for m in conv.messages]
    blob = json.dumps([turns, conv.tools], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _drop_lines(out: Path, ids: set[str]) -> None:
    """Rewrite OUT (ours) without the lines of `ids`, in one atomic step."""
    kept = [
        line for line in out.read_bytes().splitlines(keepends=True) if str(parse_json(line, str(out))["id"]) not in ids
    ]
    atomic_write_bytes(out, b"".join(kept))


def _meta_path(out: Path) -> Path:
    return Path(str(out) + META_SUFFIX)


def _check_meta(cfg: RegenerateConfig, out: Path) -> None:
    """Refuse an OUT this program did not start, or one made with other settings."""
    meta_path = _meta_path(out)
    if not out.exists():
        if meta_path.exists() and _read_meta(meta_path) is None:
            raise FileExistsError(
                f"{meta_path} exists and is not a record of dflash-data regenerate; choose another --out"
            )
        return
    if not meta_path.exists():
        raise FileExistsError(
            f"{out} exists and was not written by dflash-data regenerate (no {meta_path.name}); choose another --out"
        )
    recorded = _read_meta(meta_path)
    if recorded is None:
        raise FileExistsError(f"{meta_path} is not a record of dflash-data regenerate; choose another --out")
    ours = _meta(cfg)
    recorded = {TEMPLATE_KWARGS_KEY: {}, **recorded}  # a run before --template-kwarg used none
    diffs = [
        f"{k}: {recorded.get(k)!r} in {meta_path.name}, {ours[k]!r} now"
        for k in (*_META_KEYS, TEMPLATE_KWARGS_KEY)
        if recorded.get(k) != ours[k]
    ]
    if diffs:
        raise ValueError(
            f"{out} was made with other settings ({'; '.join(diffs)}); use the same settings to resume, or another --out"
        )


def _read_meta(meta_path: Path) -> dict | None:
    """The settings a regenerate run recorded, None when the file is not such a record."""
    try:
        record = read_json(meta_path)
    except (OSError, InputFileError):
        return None
    return record if isinstance(record, dict) and all(k in record for k in _META_KEYS) else None


def _meta(cfg: RegenerateConfig) -> dict[str, Any]:
    return {**{key: getattr(cfg, key) for key in _META_KEYS}, TEMPLATE_KWARGS_KEY: cfg.chat_template_kwargs}


def _start_out(cfg: RegenerateConfig, out: Path) -> None:
    """A new OUT and its settings record, once the server has answered (a refused first run leaves
    nothing behind that would block the corrected command)."""
    if out.exists():
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(_meta_path(out), json.dumps(_meta(cfg), indent=2) + "\n")
    with Dir.open(out.parent) as d:
        os.close(d.create(out.name))


class _Client:
    def __init__(self, cfg: RegenerateConfig, summary: RegenerateSummary):
        from openai import AsyncOpenAI

        self.cfg = cfg
        self.summary = summary
        self._warned_usage = False
        # Retries are ours (max_retries=0 here): counted, reported, and with the configured backoff.
        self.api = AsyncOpenAI(base_url=cfg.base_url, api_key=cfg.api_key, max_retries=0, timeout=cfg.request_timeout_s)

    def without_key(self, text: str) -> str:
        """Server text as we show it: some gateways echo the key they refused in their HTTP 401 answer."""
        key = self.cfg.api_key
        return text.replace(key, "<api key>") if key and key != _NO_KEY else text

    async def check_server(self) -> None:
        try:
            await self._check_server()
        except (ConnectionError, ValueError) as e:
            raise type(e)(self.without_key(str(e))) from None  # the chain holds the server's own words

    async def _check_server(self) -> None:
        import openai

        try:
            raw = await self.api.models.with_raw_response.list()
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            raise ConnectionError(
                f"no OpenAI-compatible server answers at {self.cfg.base_url} ({e}); start it, or fix --server"
            ) from e
        except openai.APIStatusError as e:
            raise ConnectionError(
                f"{self.cfg.base_url}/models answered HTTP {e.status_code}: {e.message}; is --server an OpenAI-compatible API?"
            ) from e
        models = model_ids(raw.content)
        if models is None:
            raise ConnectionError(
                f"{self.cfg.base_url}/models answered HTTP 200 with no model list ({excerpt(raw.content)}); "
                "is --server an OpenAI-compatible API?"
            )
        if models and self.cfg.model not in models:
            raise ValueError(f"--model {self.cfg.model!r} is not served at {self.cfg.base_url}; it serves {models}")

    async def reply(self, context: list[dict[str, Any]], tools: list[dict] | None) -> dict[str, Any]:
        import openai

        cfg = self.cfg
        request: dict[str, Any] = dict(
            model=cfg.model,
            messages=[wire_message(m) for m in context],
            temperature=cfg.temperature,
            max_tokens=cfg.max_tokens,
            extra_body={"chat_template_kwargs": cfg.server_template_kwargs},
        )
        if tools:
            request["tools"] = tools
        if cfg.seed is not None:
            request["seed"] = cfg.seed
        for attempt in range(cfg.max_retries + 1):
            try:
                # Raw: the body is checked here, so an answer that is no chat completion fails its
                # conversation with a reason instead of crashing the run.
                raw = await self.api.chat.completions.with_raw_response.create(**request)
                break
            except (
                openai.APITimeoutError,
                openai.APIConnectionError,
                openai.InternalServerError,
                openai.RateLimitError,
            ) as e:
                if attempt == cfg.max_retries:
                    raise Retryable(f"{type(e).__name__} after {attempt + 1} attempts: {e}") from e
                self.summary.num_retries += 1
                await asyncio.sleep(min(cfg.retry_backoff_s * 2**attempt, _MAX_BACKOFF_S))
            except openai.APIStatusError as e:  # other 4xx: the request itself is wrong, retrying cannot help
                raise Retryable(f"HTTP {e.status_code}: {e.message}") from e
        choice, usage = completion(raw.content)
        message = reply_message(choice["message"], raw.content)
        self._count(choice.get("finish_reason"), usage)
        if choice.get("finish_reason") == "length":  # cut at max_tokens: its end-of-turn token was never generated
            message[FINISH_REASON] = "length"
        return message

    def _count(self, finish_reason: Any, usage: Any) -> None:
        """One reply in the summary; a usage that is no count of tokens is unknown, said once in the log."""
        summary = self.summary
        summary.num_replies += 1
        summary.num_truncated_replies += finish_reason == "length"
        tokens = completion_tokens(usage)
        if tokens is None:
            summary.num_replies_without_usage += 1
            if usage is not None and not self._warned_usage:
                self._warned_usage = True
                logger.warning(
                    "%s reported usage %s: completion_tokens is not a count; such replies count as unknown",
                    self.cfg.base_url,
                    json.dumps(usage)[:200],
                )
        else:
            summary.generated_tokens += tokens

    async def regenerate(self, conv: Conversation) -> dict[str, Any]:
        new: list[dict[str, Any]] = []
        for m in conv.messages:
            new.append(await self.reply(new, conv.tools) if m["role"] == "assistant" else m)
        if new[-1]["role"] in ("user", "tool"):
            new.append(await self.reply(new, conv.tools))
        row = {**Conversation(conv.sample_id, new, conv.tools).to_row(), **conv.extra}
        return {**row, MODE_KEY: self.cfg.server_template_kwargs, SOURCE_KEY: source_sha256(conv)}


async def _run(cfg: RegenerateConfig, todo: list[Conversation], summary: RegenerateSummary, out: Path) -> None:
    client = _Client(cfg, summary)
    await client.check_server()
    _start_out(cfg, out)
    started = time.monotonic()  # the rates count generation, as the progress lines do, not the start-up
    window = 4 * cfg.concurrency  # finished conversations wait at most this far ahead of the next to write
    state = {"next_index": 0, "written": 0, "done": 0}
    results: dict[int, dict | None] = {}
    cond = asyncio.Condition()
    # A bar on a terminal, plain lines (at most one per 10 s, and the last) in a log file.
    # No ETA before one conversation per concurrent request has finished (ProgressLog: eta_after_units).
    progress = (
        ProgressLog(logger, None, len(todo), desc="regenerate", unit="conv", eta_after_units=cfg.concurrency)
        if cfg.progress
        else None
    )
    with Dir.open(out.parent) as d:
        f = d.open_append(out.name)  # never through a link planted as OUT
    with f:

        def flush_in_order() -> None:
            while state["written"] in results:
                row = results.pop(state["written"])
                if row is not None:
                    f.write(
                        json.dumps(row, ensure_ascii=False) + "\n"
                    )  # one write per line: a kill tears at most the last
                    f.flush()
                    summary.num_written += 1
                state["written"] += 1

        async def worker() -> None:
            while state["next_index"] < len(todo):
                i = state["next_index"]
                state["next_index"] += 1
                async with cond:
                    await cond.wait_for(lambda i=i: i < state["written"] + window)
                conv = todo[i]
                try:
                    row = await client.regenerate(conv)
                except Retryable as e:
                    summary.failures.append(Failure(conv.sample_id, conv.where, client.without_key(str(e))))
                    row = None
                async with cond:
                    results[i] = row
                    flush_in_order()
                    cond.notify_all()
                state["done"] += 1
                if progress is not None:
                    done, elapsed = state["done"], max(progress.elapsed(), 1e-9)
                    tokens_s, failed = summary.gen_rate(elapsed), f"{len(summary.failures)} failed"
                    eta = f"ETA {format_duration(progress.eta(done))}"
                    progress.report(
                        {},
                        f"regenerate: {done}/{len(todo)} conversations | {done / elapsed:.2f} conv/s | {tokens_s} | "
                        f"{failed} | {eta}",
                        force=done == len(todo),
                        done_units=done,
                        postfix=f"{tokens_s}, {failed}, {eta}",
                    )

        try:
            await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, max(len(todo), 1)))))
        finally:
            summary.seconds = time.monotonic() - started
            if progress is not None:
                progress.close()
            f.flush()
            os.fsync(f.fileno())
            await client.api.close()


def regenerate_dataset(cfg: RegenerateConfig) -> RegenerateSummary:
    """Regenerate every conversation of cfg.data not yet in cfg.out; see the module docstring."""
    out = Path(cfg.out)
    check_output_file(out, _meta_path(out), cfg.data)
    _check_meta(cfg, out)
    convs = list(iter_conversations(cfg.data))
    if not convs:
        raise DataError(f"--data {cfg.data} holds no conversations")
    summary = RegenerateSummary(out=str(out), num_input=len(convs))
    done, summary.torn_bytes_removed = _read_done(out)
    unknown = set(done) - {c.sample_id for c in convs}
    if unknown:
        raise DataError(
            f"{out} holds ids that are not in {cfg.data} (e.g. {sorted(unknown)[:3]}); is it the output of another dataset?"
        )
    changed = {c.sample_id for c in convs if done.get(c.sample_id) not in (None, source_sha256(c))}
    if changed:  # edited in --data since their replies were made: those replies answer another prompt
        logger.warning(
            "%d conversations changed in %s since %s was written (e.g. %s): regenerating them",
            len(changed),
            cfg.data,
            out,
            sorted(changed)[:3],
        )
        _drop_lines(out, changed)
        done = {k: v for k, v in done.items() if k not in changed}
    todo = [c for c in convs if c.sample_id not in done]
    summary.num_kept = len(convs) - len(todo)
    logger.info(
        "regenerate: %d conversations, %d already in %s, %d to do", len(convs), summary.num_kept, out, len(todo)
    )
    if todo:
        asyncio.run(_run(cfg, todo, summary, out))
    return summary
