"""The user-error family (shards/common/errors.py) through each of the four CLIs (dflash-extract,
dflash-data, dflash-train, dflash-shards), by click's CliRunner:

  1. Every member keeps the standard base it had before joining, so code catching ValueError or
     RuntimeError still catches it.
  2. A member raised by a command's library call is `Error: <message>`, exit 1, no traceback; a clean
     stop (Stopped) is `stopped: <message>`, exit 143; in every command of every CLI.
  3. Real refusals, one per CLI, arrive the same way (no library call replaced).
  4. An exception neither in the family nor listed by the command stays a traceback: a bug to see,
     not a user error to word (dflash-train train re-raised such a RuntimeError before the family).
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from extract.cache_dir import CacheMismatchError
from extract.chats.cli import main as data_cli
from extract.chats.template import ChatTemplateError
from extract.cli import main as extract_cli
from extract.dataset.rows import DataError
from extract.runner import ExtractionStopped
from extract.target.checkpoint import MissingTensorError
from extract.target.fp8.quantization import UnsupportedQuantizationError
from extract.writer import NonFiniteHiddenError
from shards import CacheFormatError, ShardError
from shards.common.errors import Stopped, UserError
from shards.common.lock import DirectoryLock, DirectoryLockedError
from tests.helpers.extract import cli_args
from tools.cli.dflash_shards import main as shards_cli
from train.checkpoint.store import CheckpointError
from train.cli import main as train_cli
from train.metrics.logger import NonFiniteError


@pytest.mark.parametrize(
    "member, standard",
    [
        (CacheFormatError, ValueError),
        (ShardError, ValueError),
        (DirectoryLockedError, ValueError),
        (CacheMismatchError, ValueError),
        (DataError, ValueError),
        (ChatTemplateError, ValueError),
        (MissingTensorError, KeyError),
        (MissingTensorError, ValueError),
        (UnsupportedQuantizationError, ValueError),
        (CheckpointError, ValueError),
        (NonFiniteHiddenError, RuntimeError),
        (NonFiniteError, RuntimeError),
        (ExtractionStopped, RuntimeError),
    ],
)
def test_members_keep_their_standard_base(member, standard):
    assert issubclass(member, UserError) and issubclass(member, standard)
    assert issubclass(ExtractionStopped, Stopped)


class _Preempted(Stopped):
    """A clean stop raised where each command's library call is."""


def _raising(error):
    def call(*args, **kwargs):
        raise error

    return call


# (CLI, arguments given a tmp dir and the tiny target, the library call the command makes, a member it raises)
COMMANDS = {
    "dflash-extract": (
        extract_cli,
        lambda tmp, target: cli_args(target, tmp / "data.jsonl", tmp / "cache"),
        "extract.runner.run_extract",
        CacheMismatchError("cache c: its dataset fingerprint differs; use a new --out"),
    ),
    "dflash-data prepare": (
        data_cli,
        lambda tmp, target: ["prepare", "--target", str(target), "--data", "x.jsonl", "--out", str(tmp / "o.parquet")],
        "extract.chats.cli.prepare_dataset",
        DataError("x.jsonl, line 3: messages is not a list"),
    ),
    "dflash-data regenerate": (
        data_cli,
        lambda tmp, target: (
            ["regenerate", "--server", "http://localhost:9/v1", "--model", "m", "--data", "x.jsonl"]
            + ["--out", str(tmp / "o.jsonl")]
        ),
        "extract.chats.regenerate.regenerate_dataset",
        ChatTemplateError("the chat template failed on conversation 'a': unknown role"),
    ),
    "dflash-train train": (
        train_cli,
        lambda tmp, target: ["train", "--cache", str(tmp), "--out", str(tmp / "run")],
        "train.loop.run_training",
        NonFiniteError("step 3: loss is nan; lower --lr or check the cache"),
    ),
    "dflash-train export": (
        train_cli,
        lambda tmp, target: ["export", str(tmp), str(tmp / "exported")],
        "train.checkpoint.export.export_checkpoint",
        CheckpointError("step-00000002/model.safetensors: checksum mismatch"),
    ),
    "dflash-train eval": (
        train_cli,
        lambda tmp, target: ["eval", "--drafter", str(tmp), "--cache", str(tmp), "--eval-shards", "1"],
        "train.eval.run.run_eval",
        ShardError(__file__, "bad checksum"),
    ),
    "dflash-train plot": (
        train_cli,
        lambda tmp, target: ["plot", str(tmp)],
        "train.metrics.plot.plot_run",
        CheckpointError("run.json unreadable"),
    ),
    "dflash-shards info": (
        shards_cli,
        lambda tmp, target: ["info", str(tmp)],
        "tools.cli.dflash_shards.summarize_cache",
        CacheFormatError("cache.json: format version 9, this dflash-shards reads 2"),
    ),
    "dflash-shards show": (
        shards_cli,
        lambda tmp, target: ["show", str(tmp), "doc-1"],
        "tools.cli.dflash_shards.find_sample",
        ShardError(__file__, "header is not JSON"),
    ),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_cli_maps_the_family_to_its_exit_code(command, target, tmp_path, monkeypatch):
    cli, args, call, member = COMMANDS[command]
    monkeypatch.setattr(call, _raising(member))
    result = CliRunner().invoke(cli, args(tmp_path, target))
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), f"raw traceback: {result.exception!r}"
    assert result.output.strip().splitlines()[-1] == f"Error: {member}", result.output

    monkeypatch.setattr(call, _raising(_Preempted("by SIGTERM after batch 3: re-run the same command to resume")))
    result = CliRunner().invoke(cli, args(tmp_path, target))
    assert result.exit_code == 143, result.output
    assert isinstance(result.exception, SystemExit), f"raw traceback: {result.exception!r}"
    assert "stopped: by SIGTERM after batch 3: re-run the same command to resume" in result.output
    assert "Error:" not in result.output, result.output


def test_real_refusals_arrive_as_one_line_and_exit_1(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()

    def refused(cli, args):
        result = CliRunner().invoke(cli, [str(a) for a in args])
        assert result.exit_code == 1, result.output
        assert isinstance(result.exception, SystemExit), f"raw traceback: {result.exception!r}"
        assert "Traceback" not in result.output
        return result.output

    # dflash-shards: not a cache (CacheFormatError); a cache a job holds (DirectoryLockedError).
    assert f"Error: {empty}/cache.json: not found" in refused(shards_cli, ["info", empty])
    lock = DirectoryLock(empty, "test job")
    lock.acquire()
    try:
        assert "test job" in refused(shards_cli, ["verify", empty, "--quarantine"])
    finally:
        lock.release()
    # dflash-train: nothing to export (CheckpointError), nothing to train on (CacheFormatError).
    assert f"Error: {empty}: not a valid checkpoint" in refused(train_cli, ["export", empty, tmp_path / "out"])
    assert f"{empty}/cache.json: not found" in refused(train_cli, ["train", "--cache", empty, "--out", tmp_path / "r"])


def test_an_error_outside_the_family_stays_a_traceback(tmp_path, monkeypatch):
    monkeypatch.setattr("train.loop.run_training", _raising(RuntimeError("an internal bug")))
    result = CliRunner().invoke(train_cli, ["train", "--cache", str(tmp_path), "--out", str(tmp_path / "run")])
    assert isinstance(result.exception, RuntimeError) and "an internal bug" in str(result.exception)
    assert "Error: an internal bug" not in result.output
