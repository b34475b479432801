"""What extraction prints while it runs: human sizes, a bar on a terminal, plain lines in a file, true
final figures, a rerun on a complete cache that says so."""

import fcntl
import json
import logging
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest
from click.testing import CliRunner

from extract.cli import main as extract_cli
from extract.runner import run_extract
from shards import ShardReader
from shards.common.progress import ProgressLog, format_bytes, plural
from shards.format import bytes_per_shard
from tests.helpers.extract import cli_args, extract_cfg
from tests.helpers.process import REPO, child_env


def test_format_bytes_picks_the_unit_by_magnitude():
    cases = {
        0: "0 B",
        649: "649 B",
        999: "999 B",
        1000: "1.00 KB",
        333_280: "333.3 KB",
        1_470_000: "1.47 MB",
        51_200_000_000: "51.20 GB",
        2.6e13: "26.00 TB",
    }
    for n, want in cases.items():
        assert format_bytes(n) == want, (n, format_bytes(n))
    assert plural(1, "rank") == "1 rank" and plural(2, "rank") == "2 ranks" and plural(0, "shard") == "0 shards"


def test_progress_log_plain_lines_without_a_bar(tmp_path, caplog):
    logger = logging.getLogger("test.progress")
    progress = ProgressLog(logger, open(tmp_path / "p.jsonl", "a"), 3, interval_s=1e9, bar=False)
    with caplog.at_level(logging.INFO, logger="test.progress"):
        for i in (1, 2, 3):
            progress.report({"i": i}, f"line {i}", force=i == 3, done_units=i)
    progress.close()
    # The first report is due (nothing was reported yet), the second is inside the interval, the last is forced.
    assert [r.getMessage() for r in caplog.records] == ["line 1", "line 3"]
    assert [json.loads(x)["i"] for x in (tmp_path / "p.jsonl").read_text().splitlines()] == [1, 3]


def test_extraction_lines_are_true_and_the_plan_is_printed_once(target, data, tmp_path, caplog):
    out = tmp_path / "cache"
    cfg = extract_cfg(target, data, out, progress_interval_s=1e9)
    with caplog.at_level(logging.INFO):
        summary = run_extract(cfg)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("packing plan" in m or m.startswith("plan:") for m in messages) == 1, messages
    reader = ShardReader(out)
    shard_bytes = sum(reader.info(b).path.stat().st_size for b in reader.batch_ids())
    n = len(reader.batch_ids())
    assert n >= 3
    # Interval 1e9 s: the first line and the final one. The final one counts every shard, all durable.
    lines = [m for m in messages if m.startswith("[rank 0] batch")]
    assert len(lines) == 2 and lines[-1].startswith(f"[rank 0] batch {n}/{n} ")
    assert f"| {format_bytes(shard_bytes)} written |" in lines[-1], (lines[-1], shard_bytes)
    records = [json.loads(x) for x in (out / "logs" / "extract-rank0.jsonl").read_text().splitlines()]
    assert records[-1]["shards_written"] == n and records[-1]["gb_written"] * 1e9 == pytest.approx(shard_bytes)
    # Start-up per phase, recorded once (after the second batch) and in the summary, the phases in order.
    (startup,) = [r for r in records if r.get("event") == "startup"]
    phases = ["weights_s", "first_batch_s", "second_batch_s", "since_process_start_s", "compile_counts"]
    assert list(summary.startup) == phases  # on CPU nothing compiles: no compile seconds, no graphs
    assert startup == {"rank": 0, "event": "startup", **summary.startup}
    assert all(summary.startup[k] >= 0 for k in phases[:3]) and summary.startup["since_process_start_s"] > sum(
        summary.startup[k] for k in phases[:3]
    )
    assert sum(m.startswith("start-up of rank 0's extraction: weights ") for m in messages) == 1, messages
    assert summary.bytes_written == shard_bytes and summary.complete
    cache_line = next(m for m in messages if m.startswith("cache: "))
    assert "1 rank" in cache_line and "1 ranks" not in cache_line and "0.00 GB" not in cache_line
    assert f"{n} shards of {format_bytes(bytes_per_shard(reader.config))} on 1 rank" in cache_line

    again = CliRunner().invoke(extract_cli, cli_args(target, data, out))
    assert again.exit_code == 0, again.output
    assert f"nothing to extract: all {n} shards" in again.output and f"cache {out} is complete" in again.output


def _cli_command(args):
    return [sys.executable, "-m", "extract.cli", *args], child_env(TERM="xterm")


@pytest.mark.slow
def test_redirected_output_has_plain_lines_and_no_terminal_codes(target, data, tmp_path):
    cmd, env = _cli_command(cli_args(target, data, tmp_path / "cache", "--progress-interval", "0"))
    proc = subprocess.run(cmd, capture_output=True, timeout=240, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    text = proc.stdout.decode() + proc.stderr.decode()
    assert "\x1b" not in text and "\r" not in text
    assert "[rank 0] batch 1/" in text and "done in " in text


@pytest.mark.slow
def test_a_terminal_gets_a_progress_bar(target, data, tmp_path):
    cmd, env = _cli_command(cli_args(target, data, tmp_path / "cache", "--progress-interval", "0"))
    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns of a real window
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=child, cwd=REPO, env=env)
    os.close(child)
    chunks = []
    try:
        while True:  # read while it runs: a full pty buffer would block the child
            try:
                chunk = os.read(parent, 65536)
            except OSError:  # EIO: the child closed its end, everything was read
                break
            if not chunk:
                break
            chunks.append(chunk)
        stdout, _ = proc.communicate(timeout=240)
    finally:
        os.close(parent)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    tty = b"".join(chunks).decode(errors="replace")
    assert "100%|" in tty and "batch/s" in tty, tty[-2000:]
    assert "[rank 0] batch" not in tty, "with a bar, the plain progress lines are not printed"
    assert "done in " in stdout.decode()
