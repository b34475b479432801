"""The one logging set-up of the four CLIs (shards/common/logs.py): a single process and a job's rank 0
log `HH:MM:SS LEVEL logger: message` at INFO; another torchrun rank prefixes `[rank N]` and logs at
the level its CLI asks (dflash-train: warnings only; the others: INFO)."""

from __future__ import annotations

import contextlib
import logging
import re

import pytest

from shards.common.logs import setup_logging


@contextlib.contextmanager
def bare_root():
    """The root logger without pytest's handlers (setup_logging, like basicConfig, leaves a configured
    one alone), as a CLI process starts; restored afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = []
    try:
        yield root
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers = handlers
        root.setLevel(level)


def _line(root: logging.Logger) -> str:
    record = logging.LogRecord("extract.runner", logging.INFO, __file__, 1, "batch %d/%d", (3, 10), None)
    (handler,) = root.handlers
    return handler.format(record)


@pytest.mark.parametrize(
    "rank, other_ranks_level, prefix, level",
    [
        (None, logging.WARNING, "", logging.INFO),  # started alone
        ("0", logging.WARNING, "", logging.INFO),  # a job's rank 0 reads as a single process
        ("1", logging.INFO, "[rank 1] ", logging.INFO),  # dflash-extract, -data, -shards
        ("3", logging.WARNING, "[rank 3] ", logging.WARNING),  # dflash-train
    ],
)
def test_ranks_other_than_0_are_prefixed(monkeypatch, rank, other_ranks_level, prefix, level):
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    with bare_root() as root:
        setup_logging(other_ranks_level=other_ranks_level)
        found_level, line = root.level, _line(root)
    assert found_level == level
    assert re.fullmatch(rf"\d\d:\d\d:\d\d {re.escape(prefix)}INFO extract.runner: batch 3/10", line), line


def test_a_message_that_names_its_rank_is_not_tagged_twice(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with bare_root() as root:
        setup_logging()
        (handler,) = root.handlers
        args = ("extract.runner", logging.INFO, __file__, 1)
        own = handler.format(logging.LogRecord(*args, "[rank 1] batch %d/%d", (3, 10), None))
        other = handler.format(logging.LogRecord(*args, "[rank 2] batch %d/%d", (3, 10), None))
    assert re.fullmatch(r"\d\d:\d\d:\d\d INFO extract.runner: \[rank 1\] batch 3/10", own), own
    assert re.fullmatch(r"\d\d:\d\d:\d\d \[rank 1\] INFO extract.runner: \[rank 2\] batch 3/10", other), other


@pytest.mark.parametrize("rank", ["0", "2"])
def test_a_logged_id_carrying_escape_sequences_is_shown_escaped(monkeypatch, rank):
    monkeypatch.setenv("RANK", rank)
    sample_id = "doc\x1b]0;owned\x07\x1b[2J\u202e"
    record = logging.LogRecord("extract.runner", logging.WARNING, __file__, 1, "skipped %s", (sample_id,), None)
    with bare_root() as root:
        setup_logging()
        (handler,) = root.handlers
        line = handler.format(record)
    assert line.endswith("skipped doc\\x1b]0;owned\\x07\\x1b[2J\\u202e"), line
