"""dflash-data prepare: conversations -> the token dataset dflash-extract reads (id, input_ids, loss_mask).

Every conversation is rendered with the target's own chat template (chat.py); the output is one
Parquet file with small row groups, plus OUT.summary.json: samples, tokens, supervised fraction,
truncated and skipped samples with their reasons. Bad rows (no messages, unknown roles, no assistant
turn, a template that refuses the conversation) are all listed and nothing is written, unless
`skip_bad_rows`, which writes the rest and lists every skipped row in the summary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, get_args

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from extract.chats.conversations import (
    PREPARE_SUMMARY_SUFFIX,
    holds_conversations,
    iter_conversations,
)
from extract.chats.template import ChatRenderer, ChatTemplateError, load_tokenizer
from extract.dataset.files import data_would_read
from extract.dataset.index import LONG_SEQ_POLICIES, LongSeqPolicy, Sample
from extract.dataset.rows import DataError
from extract.target.config import TargetConfig
from shards.common.chat_mode import MODE_COLUMN, chat_mode, describe_mode, mode_text, parse_template_kwargs, row_mode
from shards.common.cli_options import cli_field, config_error
from shards.common.diskfull import refusing_when_full
from shards.common.durable import atomic_write_text, check_writable
from shards.common.json_input import parse_json, read_json_object
from shards.common.owned import Dir, OwnershipError
from shards.common.progress import plural

logger = logging.getLogger(__name__)

Thinking = Literal["on", "off"]  # enable_thinking in the chat template
_NUM_ERRORS_SHOWN = 20


@dataclass(kw_only=True)
class PrepareConfig:
    """One dflash-data prepare run: conversations -> token dataset."""

    target: str = cli_field(path="existing_dir")
    """Target checkpoint directory: config.json, tokenizer.json, tokenizer_config.json,
    chat_template.jinja."""
    data: str
    """Conversations: .jsonl / .json / .parquet file, directory or glob."""
    out: str = cli_field(path="file")
    """Parquet file to write (id, input_ids, loss_mask), plus OUT.summary.json."""
    thinking: Thinking = "on"
    """Render as served with thinking on (reasoning kept where the template keeps it) or off
    (reasoning removed). Must match how the target will be served."""
    template_kwargs: list[str] = cli_field(flag="--template-kwarg", repeat=True, default_factory=list)
    """Another chat-template keyword of the serving mode, KEY=VALUE (JSON scalar, else text), repeatable:
    e.g. --template-kwarg reasoning_effort=high. Default: none."""
    max_length: int | None = None
    """Tokens per sample at most. Default: no limit."""
    long_seqs: LongSeqPolicy = "truncate"
    """Samples past --max-length: cut (truncate), drop and list in the summary (skip) or refuse (error)."""
    skip_bad_rows: bool = False
    """Write the good rows and list the bad ones in the summary, instead of refusing."""
    overwrite: bool = False
    """Replace an existing --out file."""

    def __post_init__(self) -> None:
        if self.max_length is not None and self.max_length <= 0:
            raise config_error(self, "max_length", "must be positive")
        if self.long_seqs not in LONG_SEQ_POLICIES:
            raise config_error(self, "long_seqs", f"must be one of {LONG_SEQ_POLICIES}")
        if self.thinking not in get_args(Thinking):
            raise config_error(self, "thinking", f"must be one of {get_args(Thinking)}")
        if not self.out.endswith(".parquet"):
            raise config_error(self, "out", "must be a .parquet file")
        self.template_kwargs = list(self.template_kwargs or ())  # click passes a tuple
        parse_template_kwargs(self.template_kwargs)

    @property
    def chat_template_kwargs(self) -> dict[str, Any]:
        """--template-kwarg as the template's keywords."""
        return parse_template_kwargs(self.template_kwargs)


@dataclass
class PrepareSummary:
    out: str
    num_samples: int = 0  # written
    num_tokens: int = 0
    num_supervised: int = 0
    num_truncated: int = 0  # cut to max_length (still written)
    num_reasoning_dropped: int = 0  # assistant turns whose reasoning was removed (thinking off)
    skipped: list[dict] = dataclasses.field(default_factory=list)  # {"row": where, "reason": ...}
    samples_per_mode: dict[str, int] = dataclasses.field(default_factory=dict)  # described mode -> samples written

    def count_mode(self, text: str) -> None:
        name = describe_mode(json.loads(text))
        self.samples_per_mode[name] = self.samples_per_mode.get(name, 0) + 1

    @property
    def supervised_fraction(self) -> float:
        return self.num_supervised / self.num_tokens if self.num_tokens else 0.0

    def line(self) -> str:
        return (
            f"{plural(self.num_samples, 'sample')}, {plural(self.num_tokens, 'token')}, "
            f"{100 * self.supervised_fraction:.1f}% supervised, "
            f"{self.num_truncated} truncated, {len(self.skipped)} skipped"
            + (
                f", reasoning removed from {self.num_reasoning_dropped} turns (thinking off)"
                if self.num_reasoning_dropped
                else ""
            )
            + (
                " in modes " + "; ".join(f"{name}: {n}" for name, n in self.samples_per_mode.items())
                if len(self.samples_per_mode) > 1
                else ""
            )
            + f" -> {self.out}"
        )


_ROW_GROUP = 256  # rows per Parquet row group: dflash-extract decodes one whole group per sample it loads
_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        (MODE_COLUMN, pa.string()),  # the mode each row was rendered in (shards/common/chat_mode.py)
    ]
)
_OLDER_NAMES = _SCHEMA.names[:3]  # outputs of runs before each row recorded its mode


def _table(samples: list[tuple[Sample, str]]) -> pa.Table:
    return pa.table(
        {
            "id": pa.array([s.sample_id for s, _ in samples], type=pa.string()),
            "input_ids": pa.array([s.input_ids for s, _ in samples], type=pa.list_(pa.int32())),
            "loss_mask": pa.array([s.loss_mask for s, _ in samples], type=pa.list_(pa.uint8())),
            MODE_COLUMN: pa.array([m for _, m in samples], type=pa.string()),
        },
        schema=_SCHEMA,
    )


class _Renderers:
    """One ChatRenderer per mode the rows are rendered in: the flags' mode, and any a row states."""

    def __init__(self, cfg: PrepareConfig, vocab_size: int):
        self.target, self.vocab_size = cfg.target, vocab_size
        self.default = chat_mode(cfg.thinking, cfg.chat_template_kwargs)
        self._made = {mode_text(self.default): self._make(self.default)}

    def _make(self, mode: dict[str, Any]) -> ChatRenderer:
        return ChatRenderer(
            self.target,
            thinking=mode["thinking"] == "on",
            vocab_size=self.vocab_size,
            template_kwargs=mode["template_kwargs"],
        )

    def for_row(self, conv) -> tuple[ChatRenderer, str]:
        """The renderer of the conversation's mode and that mode's text; DataError naming the row."""
        try:
            mode = row_mode(conv.extra, self.default, conv.where)
        except ValueError as e:
            raise DataError(str(e)) from e
        key = mode_text(mode)
        if key not in self._made:
            try:
                self._made[key] = self._make(mode)
            except ChatTemplateError as e:  # a keyword the template never reads, as with --template-kwarg
                raise DataError(f"{conv.where}: chat_template_kwargs: {e}") from e
        return self._made[key], key


def _encoded(
    cfg: PrepareConfig, renderers: _Renderers, summary: PrepareSummary, errors: list[str]
) -> Iterator[tuple[Sample, str]]:
    """Every good conversation as a Sample and its mode's text; bad rows go to `errors`, counts to `summary`."""
    for conv in iter_conversations(cfg.data, errors):
        try:
            renderer, mode = renderers.for_row(conv)
            ids, mask, dropped = renderer.encode(conv)
        except DataError as e:
            errors.append(str(e))
            continue
        _check_ids(ids, renderer, conv.where)
        if cfg.max_length is not None and len(ids) > cfg.max_length:
            reason = f"{len(ids)} tokens, more than max_length {cfg.max_length}"
            if cfg.long_seqs == "error":
                raise DataError(
                    f"{conv.where}: sample {conv.sample_id!r} has {reason}; use --long-seqs truncate or skip"
                )
            if cfg.long_seqs == "skip":
                summary.skipped.append({"row": conv.where, "id": conv.sample_id, "reason": reason})
                continue
            ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
            summary.num_truncated += 1
        summary.num_reasoning_dropped += dropped
        summary.num_samples += 1
        summary.num_tokens += len(ids)
        summary.num_supervised += int(mask.sum())
        summary.count_mode(mode)
        yield Sample(conv.sample_id, ids, mask), mode


def _check_ids(ids: np.ndarray, renderer: ChatRenderer, where: str) -> None:
    """The ids written fit the model's vocabulary (ChatRenderer checked the tokenizer up front; this
    is what dflash-extract would refuse later, naming the prepared file rather than the chat)."""
    vocab_size = renderer.vocab_size
    if vocab_size is None or not len(ids):
        return
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if len(bad):
        i = int(bad[0])
        token = renderer.tokenizer.convert_ids_to_tokens(int(ids[i]))
        raise DataError(
            f"{where}: token {i} of the rendering has id {int(ids[i])} ({token!r}), outside the model's vocab_size "
            f"{vocab_size}: the tokenizer of {renderer.target_dir} does not fit its config.json"
        )


# How to write the good rows when some are bad: dflash-data prepare's flag, or (from dflash-extract,
# which has no such flag) a separate prepare run.
SKIP_BAD_ROWS_HINT = "pass --skip-bad-rows to write the other rows (the skipped ones are listed in the summary)"
EXTRACT_SKIP_HINT = "run `dflash-data prepare --skip-bad-rows` on them and pass its output as --data"


def prepare_dataset(cfg: PrepareConfig, skip_hint: str = SKIP_BAD_ROWS_HINT) -> PrepareSummary:
    """Render, mask and write every conversation; DataError listing bad rows (see the module doc)."""
    out = Path(cfg.out)
    _check_out(cfg, out)
    renderers = _Renderers(cfg, TargetConfig.from_dir(cfg.target).vocab_size)
    summary = PrepareSummary(out=str(out))
    errors: list[str] = []

    def write_rows(f: BinaryIO) -> None:
        # Streamed, ROW_GROUP rows at a time: memory stays flat however large the dataset.
        with pq.ParquetWriter(f, _SCHEMA) as writer:
            pending: list[tuple[Sample, str]] = []
            for sample in _encoded(cfg, renderers, summary, errors):
                pending.append(sample)
                if len(pending) == _ROW_GROUP:
                    writer.write_table(_table(pending))
                    pending = []
            if pending:
                writer.write_table(_table(pending))
        if errors and not cfg.skip_bad_rows:
            shown = "\n  ".join(errors[:_NUM_ERRORS_SHOWN])
            more = f"\n  ... and {len(errors) - _NUM_ERRORS_SHOWN} more" if len(errors) > _NUM_ERRORS_SHOWN else ""
            raise DataError(f"{len(errors)} bad rows, nothing written:\n  {shown}{more}\nfix them, or {skip_hint}")
        if not summary.num_samples:
            raise DataError(f"{cfg.data}: no conversation could be prepared")
        if not summary.num_supervised:  # a drafter learns nothing from it: refused, as dflash-extract would
            cut = f" (--max-length {cfg.max_length} cut every reply away: raise it)" if cfg.max_length else ""
            raise DataError(f"{cfg.data}: no token of the {summary.num_samples} samples is supervised{cut}")

    # pyarrow writes into our own temporary (created exclusively, never through a link); a refused or
    # failed run leaves nothing, and OUT appears only complete.
    with Dir.open(out.parent, create=True) as d:
        d.write_atomic(out.name, write_rows)
    summary.skipped.extend({"row": e.split(": ", 1)[0], "reason": e.split(": ", 1)[-1]} for e in errors)
    record = {
        **dataclasses.asdict(summary),
        "supervised_fraction": summary.supervised_fraction,
        "config": dataclasses.asdict(cfg),
    }
    atomic_write_text(_summary_path(out), json.dumps(record, indent=2))
    return summary  # the caller reports it: `dflash-data prepare` in one line, dflash-extract in its log


def _summary_path(out: Path) -> Path:
    return Path(f"{out}{PREPARE_SUMMARY_SUFFIX}")


def serving_mode(data: str, prepared: dict | None) -> dict[str, Any] | None:
    """The mode (shards.common.chat_mode) the token rows of `data` were rendered in: the on-the-fly
    preparation's, else the one `dflash-data prepare` recorded in DATA.summary.json; None = unknown
    (token rows from elsewhere, or an unreadable record: it is a description, never a refusal)."""
    if prepared is not None:
        return chat_mode(prepared["thinking"], prepared["template_kwargs"])
    try:
        config = read_json_object(_summary_path(Path(data))).get("config")
        return chat_mode(config["thinking"], parse_template_kwargs(config.get("template_kwargs") or []))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def file_mode_text(file: str) -> str | None:
    """The mode (as mode_text) of a token file's rows that state none: the one `dflash-data prepare`
    recorded beside it, None = unknown. dflash-extract's scan takes it (scan_dataset's file_mode)."""
    mode = serving_mode(file, None)
    return mode_text(mode) if mode is not None else None


def _read_summary(d: Dir, out: Path) -> dict | None:
    """The summary a prepare run wrote beside OUT (in `d`), None when there is none of ours."""
    try:
        summary = parse_json(d.read_bytes(_summary_path(out).name), str(_summary_path(out)))
    except (OSError, ValueError):  # absent, not a regular file, not JSON
        return None
    return summary if isinstance(summary, dict) and "config" in summary and "num_samples" in summary else None


def _written_by_prepare(d: Dir, out: Path) -> bool:
    """OUT is a token dataset beside a summary that records a prepare run."""
    try:
        with os.fdopen(d.open_own(out.name, os.O_RDONLY), "rb") as f:
            names = pq.read_schema(f).names
    except Exception:  # not Parquet: pyarrow raises several types
        return False
    return _read_summary(d, out) is not None and names in (_SCHEMA.names, _OLDER_NAMES)


def check_output_file(out: Path, sidecar: Path, data: str) -> None:
    """Before any work: --out and its sidecar are not what --data reads, nor a link, FIFO or folder (the
    user's, never written through), and their directory is writable."""
    for path in (out, sidecar):
        if data_would_read(data, path):
            raise OwnershipError(
                f"--out {out}: {path} is --data {data} or would be read by it; choose an --out outside the data"
            )
    check_writable(out.parent, f"--out {out}")
    if out.parent.is_dir():
        with Dir.open(out.parent) as d:
            for path in (out, sidecar):
                d.refuse_other_than_file(path.name)


def _check_out(cfg: PrepareConfig, out: Path) -> None:
    """Replace only an output of ours, and only with --overwrite; never a summary we did not write."""
    check_output_file(out, _summary_path(out), cfg.data)
    if not out.parent.is_dir():
        return  # made by the run: nothing in it yet
    with Dir.open(out.parent) as d:
        if d.lstat(out.name) is not None:
            if not cfg.overwrite:
                raise OwnershipError(f"{out} exists; choose another --out or pass --overwrite")
            if not _written_by_prepare(d, out):
                raise OwnershipError(
                    f"--overwrite: {out} was not written by dflash-data prepare (no {_summary_path(out).name} of "
                    "ours beside it); nothing was replaced: choose another --out"
                )
        elif d.lstat(_summary_path(out).name) is not None and _read_summary(d, out) is None:
            raise OwnershipError(f"{_summary_path(out)} exists and is not a prepare summary; choose another --out")


@contextmanager
def tokens_for_extraction(
    data: str, target: str, thinking: Thinking | None, template_kwargs: list[str] = ()
) -> Iterator[tuple[str, dict | None]]:
    """(token dataset path, how it was prepared) for dflash-extract's --data.

    Token rows: `data` itself and None. Conversations: prepared on the fly by `prepare_dataset` (the
    code of `dflash-data prepare`, with `thinking`, default on) into a temporary Parquet file that
    lives as long as the context, and a record of the preparation for cache.json (thinking mode, template
    keywords, sha256 of the chat template and of tokenizer.json, the summary's counts)."""
    if not holds_conversations(data):
        if thinking is not None or template_kwargs:
            given = f"--thinking {thinking}" if thinking is not None else f"--template-kwarg {template_kwargs[0]}"
            raise ValueError(
                f"{given}: --data {data} holds token rows (input_ids), not conversations; "
                "drop --thinking and --template-kwarg (they apply to conversations only)"
            )
        yield data, None
        return
    with tempfile.TemporaryDirectory(prefix="dflash-extract-prepared-") as tmp:
        out = str(Path(tmp) / "data.parquet")
        cfg = PrepareConfig(
            target=target, data=data, out=out, thinking=thinking or "on", template_kwargs=list(template_kwargs)
        )
        mode = chat_mode(cfg.thinking, cfg.chat_template_kwargs)
        logger.info(
            "--data %s holds conversations: rendering them with %s's chat template, %s",
            data,
            target,
            describe_mode(mode),
        )
        with refusing_when_full(tmp, "the conversations are prepared there first: free space, or set TMPDIR"):
            summary = prepare_dataset(cfg, EXTRACT_SKIP_HINT)
        logger.info("prepared %s", summary.line())
        template = load_tokenizer(target).chat_template
        record = {
            "from": "conversations",
            "thinking": cfg.thinking,
            "template_kwargs": mode["template_kwargs"],
            "chat_template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(),
            "tokenizer_sha256": _file_sha256(Path(target) / "tokenizer.json"),
            "num_samples": summary.num_samples,
            "num_supervised": summary.num_supervised,
            "num_reasoning_removed": summary.num_reasoning_dropped,
        }
        try:
            yield cfg.out, record
        except ValueError as e:  # DataError included
            if type(e) not in (ValueError, DataError) or cfg.out not in str(e):
                raise
            # The prepared file is a temporary the user never saw and that is gone once this returns.
            raise type(e)(_name_chat_rows(str(e), cfg.out, data)) from e


def _name_chat_rows(message: str, prepared: str, data: str) -> str:
    """`message` with each "PREPARED, row N" replaced by the file and row of the chat prepared into row
    N (found by its id), and any other mention of PREPARED by what it was prepared from."""
    located = re.compile(re.escape(prepared) + r", row (\d+)")
    rows = {int(n) for n in located.findall(message)}
    origin: dict[int, str] = {}
    if rows:
        ids = pq.read_table(prepared, columns=["id"]).column("id").to_pylist()
        wanted = {ids[r]: r for r in rows if r < len(ids)}
        for conv in iter_conversations(data, errors=[]):
            if conv.sample_id in wanted:
                origin[wanted[conv.sample_id]] = f"{conv.where} (id {conv.sample_id!r})"
    message = located.sub(lambda m: origin.get(int(m[1]), m[0]), message)
    return message.replace(prepared, f"the token rows prepared from {data}")


def _file_sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
