"""dflash-shards on crafted caches (issue 26, classes 2 and 3): one line naming the file, never a
traceback, never a hang, and no terminal control from the cache reaches the terminal.

  cache.json nested 200,000 deep, a shard header nested as deep: RecursionError tracebacks before;
  cache.json a FIFO: refused at once (reading it waited forever for a writer);
  a shard header whose sample id carries escape sequences, or one past MAX_SAMPLE_ID_BYTES: the reader
  refuses what its writer never writes, naming the shard, the id shown escaped and cut short;
  a cache directory whose name carries escape sequences: the error message shows them escaped.
"""

from __future__ import annotations

import json
import os
import signal
import struct

import pytest
from click.testing import CliRunner

from shards import shard_path
from shards.sample_ids import MAX_SAMPLE_ID_BYTES
from tools.cli.dflash_shards import main as shards_cli
from tools.fixtures.synthetic_cache import write_synthetic_cache

RETITLE_AND_CLEAR = "\x1b]0;owned\x07\x1b[2J"  # sets the terminal's title, then clears the screen


@pytest.fixture
def cache(tmp_path):
    write_synthetic_cache(tmp_path / "cache", num_batches=3, token_budget=128, max_seqs=4, plan=True)
    return tmp_path / "cache"


def invoke(*args):
    return CliRunner().invoke(shards_cli, [str(a) for a in args])


def refused(result) -> bool:
    """Exit 1 with a message, not an exception escaping the command."""
    return result.exit_code == 1 and (result.exception is None or isinstance(result.exception, SystemExit))


def rewrite_header(path, edit) -> None:
    """Replace a shard's JSON header by edit(header) (a dict, or the new header text itself)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    new = edit(json.loads(data[8 : 8 + n]))
    blob = (new if isinstance(new, str) else json.dumps(new)).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n :])


def with_first_id(sample_id: str):
    def edit(header):
        samples = json.loads(header["__metadata__"]["samples"])
        samples[0][0] = sample_id
        header["__metadata__"]["samples"] = json.dumps(samples)
        return header

    return edit


@pytest.mark.parametrize("command", ["info", "ls", "verify"])
def test_a_cache_json_nested_200000_deep_is_refused_naming_it(cache, command):
    (cache / "cache.json").write_text("[" * 200_000 + "]" * 200_000)
    result = invoke(command, cache)
    assert refused(result), result.output
    assert f"{cache / 'cache.json'}: JSON nested more than" in result.output, result.output


def test_a_shard_header_nested_200000_deep_is_named_by_verify(cache):
    rewrite_header(shard_path(cache, 1), lambda header: "[" * 200_000 + "]" * 200_000)
    result = invoke("verify", cache)
    assert refused(result), result.output
    assert f"{shard_path(cache, 1)}: header: JSON nested more than" in result.output, result.output


def test_a_fifo_in_place_of_cache_json_is_refused_not_waited_on(cache):
    (cache / "cache.json").unlink()
    os.mkfifo(cache / "cache.json")

    def waited(*_):
        raise AssertionError("dflash-shards info waited on the FIFO")

    previous = signal.signal(signal.SIGALRM, waited)
    signal.alarm(20)
    try:
        result = invoke("info", cache)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert refused(result), result.output
    assert f"{cache / 'cache.json'}: a FIFO (named pipe), not a regular file" in result.output, result.output


@pytest.mark.parametrize(
    "sample_id, reason",
    [
        (f"doc{RETITLE_AND_CLEAR}", r"holds the control character '\x1b' at character 3"),
        ("d" * (MAX_SAMPLE_ID_BYTES + 1), f"is {MAX_SAMPLE_ID_BYTES + 1} bytes long (UTF-8), more than the"),
    ],
    ids=["escape sequences", "one byte too long"],
)
def test_a_shard_whose_id_its_writer_refuses_is_refused_by_its_reader(cache, sample_id, reason):
    rewrite_header(shard_path(cache, 1), with_first_id(sample_id))
    for command in ("verify", "ls", "index"):
        result = invoke(command, cache)
        assert "\x1b" not in result.output and "\x07" not in result.output, repr(result.output)
        if command != "ls":  # ls lists it as BAD and goes on
            assert refused(result), result.output
        assert str(shard_path(cache, 1).name) in result.output and reason in result.output, result.output
        assert sample_id not in result.output  # escaped, or cut short
        assert "d" * 41 not in result.output  # cut short: a 65 MB id once filled the screen


def test_an_error_message_shows_a_directory_name_escaped(tmp_path):
    odd = tmp_path / f"cache{RETITLE_AND_CLEAR}"
    odd.mkdir()
    result = invoke("info", odd)
    assert refused(result), result.output
    assert "\x1b" not in result.output and "\x07" not in result.output, repr(result.output)
    assert "cache\\x1b]0;owned\\x07\\x1b[2J" in result.output, result.output
