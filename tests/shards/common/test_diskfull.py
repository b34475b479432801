"""A full disk anywhere a CLI writes is one line naming the path and the space free (shards.common.diskfull).

Checkpoints (sync and async) and exports: tests/train/checkpoint/; shards: tests/extract/test_extract_faults.py.
Here the other outputs, each through its CLI with the write failing as its library fails on a full disk
(measured on a 2 MB tmpfs: pyarrow and Python's files raise OSError(ENOSPC)):
  dflash-data prepare's Parquet output, dflash-train's metrics.jsonl, dflash-shards index's manifest;
and the last resort, a command whose write no boundary names (dflash-train plot's image), and a quota.
"""

from __future__ import annotations

import errno
import io
import os

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from extract.chats.cli import main as data_cli
from shards.manifest import MANIFEST_FILE
from tests.helpers.chats import CHAIN, chat_target, write_rows
from tests.helpers.faults import one_error_line
from tests.helpers.train import tiny_cache, tiny_cli_args
from tools.cli.dflash_shards import main as shards_cli
from train.cli import main as train_cli


def no_space(code: int = errno.ENOSPC) -> OSError:
    return OSError(code, os.strerror(code))


def test_prepare_output(tmp_path_factory, tmp_path, monkeypatch):
    target = chat_target(tmp_path_factory)
    data = write_rows(tmp_path / "chats.jsonl", [{"id": f"c{i}", "messages": CHAIN} for i in range(3)])
    out = tmp_path / "out.parquet"

    def full(self, table, *args, **kwargs):
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", full)
    args = ["prepare", "--target", str(target), "--data", str(data), "--out", str(out)]
    line = one_error_line(CliRunner().invoke(data_cli, args))
    assert line.startswith(f"Error: writing {out} failed: No space left on device (") and " free there); " in line
    assert "nothing was written" in line and not list(tmp_path.glob("*out.parquet*")), line


class _FillsAfter(io.TextIOWrapper):
    """metrics.jsonl whose writes fail once `budget` characters were written, as a file on a disk that fills."""

    budget = 1500

    def write(self, text: str) -> int:
        _FillsAfter.budget -= len(text)
        if _FillsAfter.budget < 0:
            raise no_space()
        return super().write(text)


def test_training_metrics(tmp_path, monkeypatch):
    from shards.common.owned import Dir

    real_open_append = Dir.open_append

    def opening(self, name):
        f = real_open_append(self, name)
        if name == "metrics.jsonl":
            return _FillsAfter(f.detach(), line_buffering=True)
        return f

    monkeypatch.setattr(Dir, "open_append", opening)
    cache, run = tiny_cache(tmp_path / "cache", num_batches=4), tmp_path / "run"
    line = one_error_line(
        CliRunner().invoke(train_cli, tiny_cli_args(cache, run, "--max-steps", "8", "--log-every", "1"))
    )
    assert line.startswith(f"Error: writing {run} failed: No space left on device (") and " free there); " in line
    assert "the checkpoints written are intact: free space and re-run with --resume" in line, line


def test_index_manifest(tmp_path, monkeypatch):
    import shards.manifest as manifest

    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    before = (cache / MANIFEST_FILE).read_bytes()

    def full(path, data):
        raise no_space()

    monkeypatch.setattr(manifest, "atomic_write_bytes", full)
    line = one_error_line(CliRunner().invoke(shards_cli, ["index", str(cache)]))
    assert line.startswith(f"Error: writing {cache} failed: No space left on device (") and " free there); " in line
    assert (cache / MANIFEST_FILE).read_bytes() == before


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_write_no_boundary_names_is_still_one_line(tmp_path, monkeypatch, code):
    """dflash-train plot writes its image with no boundary of its own: user_errors still makes the failure
    one line, naming the file the error names and the space free there; a quota says quota."""
    import train.metrics.plot as plot

    cache, run = tiny_cache(tmp_path / "cache", num_batches=4), tmp_path / "run"
    assert CliRunner().invoke(train_cli, tiny_cli_args(cache, run, "--max-steps", "2")).exit_code == 0
    image = tmp_path / "loss.png"

    def full(path, write, *args, **kwargs):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(plot, "atomic_write", full)
    line = one_error_line(CliRunner().invoke(train_cli, ["plot", str(run), "--out", str(image)]))
    assert line.startswith(f"Error: writing {image} failed: {os.strerror(code)} (") and " free there); " in line
    assert line.endswith("free space (or choose another output directory) and run the same command again"), line
