"""What dflash-train prints: start-up figures, step lines with every term that is on, data wait, MFU,
the held-out figures after an evaluation, and a final summary naming every output."""

from __future__ import annotations

import json
import logging

import pytest
from click.testing import CliRunner

import train.loop
from tests.helpers.train import read_records, tiny_cache, tiny_cli_args
from train.cli import main
from train.config import TrainConfig
from train.drafter.config import DrafterOptions
from train.drafter.model import count_parameters
from train.metrics.flops import drafter_step_flops
from train.resolve import resolve_run


def test_console_lines_carry_every_figure(tmp_path, caplog, monkeypatch):
    peak = 1e12
    monkeypatch.setattr(train.loop, "peak_flops", lambda device, dtype: (peak, "a test peak"))
    cache = tiny_cache(tmp_path / "cache", num_batches=4, target_topk=4)
    out = tmp_path / "run"
    args = tiny_cli_args(
        cache,
        out,
        "--max-steps",
        "4",
        "--eval-shards",
        "1",
        "--eval-every",
        "2",
        "--kl-lambda",
        "0.5",
        "--cap-lambda",
        "0.25",
        "--log-every",
        "2",
    )
    with caplog.at_level(logging.INFO):
        res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    messages = [r.getMessage() for r in caplog.records]

    cfg = TrainConfig(
        cache=str(cache), out_dir=str(out), num_blocks=8, block_size=4, drafter=DrafterOptions(num_layers=1)
    )
    run = resolve_run(cfg)
    flops = drafter_step_flops(run.drafter, run.cache_config.token_budget, run.num_blocks)
    assert any(f"drafter: {count_parameters(run.drafter):,} parameters" in m for m in messages), messages
    assert any(m.startswith(f"FLOPs per step: {flops:.4g}") and "MFU against 1 TFLOP/s" in m for m in messages)
    assert any("; 1 rank;" in m for m in messages)

    lines = [m for m in messages if m.startswith("step ")]
    records = read_records(out)
    assert [int(m.split()[1].split("/")[0]) for m in lines] == [r["step"] for r in records] == [1, 2, 4]
    for line, rec in zip(lines, records):
        for figure in (
            f"loss {rec['loss/total']:.4f}",
            f"ce {rec['loss/ce']:.4f}",
            f"kl {rec['loss/kl']:.4f}",
            f"cap {rec['loss/cap']:.4f}",
            f"data wait {100 * rec['perf/data_wait_frac']:.0f}%",
            f"MFU {100 * rec['perf/mfu']:.1f}%",
        ):
            assert figure in line, (figure, line)
    # MFU from the record's own figures: FLOPs of its steps over the interval (tokens / tokens per second).
    prev = records[1]
    rec = records[2]
    interval_s = (rec["data/tokens_seen"] - prev["data/tokens_seen"]) / rec["perf/tokens_per_s"]
    assert abs(rec["perf/mfu"] - flops * (rec["step"] - prev["step"]) / interval_s / peak) < 1e-6 * rec["perf/mfu"]
    # The evaluation at step 2 comes after step 2's line: its figures ride on the next line (step 4), in
    # words and short: acceptance and held-out loss of the eval record; the rest stays in metrics.jsonl.
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("event") == "eval"]
    at_2 = next(r for r in evals if r["step"] == 2)
    held_out = lines[2].split(" | ")[-1]
    assert held_out == (
        f"held-out @ step 2: accept len {at_2['eval/acceptance_length']:.3f}, loss {at_2['eval/heldout_loss']:.4f}"
    ), lines[2]
    assert "eval/" not in lines[2] and "_" not in held_out
    assert "held-out" not in lines[1]

    assert "done in " in res.output and ": 4 steps, " in res.output and "tok/s over the whole run" in res.output
    for output in (out / "step-00000004", out / "metrics.jsonl", out / "run.json", out / "eval.json"):
        assert str(output) in res.output, (output, res.output)
    assert f"dflash-train plot {out}" in res.output


def test_off_terms_and_no_peak_are_not_printed(tmp_path, caplog):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    with caplog.at_level(logging.INFO):
        res = CliRunner().invoke(
            main, tiny_cli_args(cache, tmp_path / "run", "--max-steps", "1"), catch_exceptions=False
        )
    assert res.exit_code == 0, res.output
    messages = [r.getMessage() for r in caplog.records]
    line = next(m for m in messages if m.startswith("step 1/"))
    assert " kl " not in line and " cap " not in line and "MFU" not in line and "data wait" in line
    assert any("no MFU figure: no peak known for cpu" in m for m in messages)


def test_evaluation_time_stays_out_of_the_step_rates(tmp_path, monkeypatch, caplog):
    # Every evaluation takes 1000 s of a fake clock; the steps take 0.01 s per clock read. Before the fix
    # the evaluation before step 1 read as "4 tok/s ... ETA 27h" on the first step line.
    import time

    clock = [0.0]

    def tick():
        clock[0] += 0.01
        return clock[0]

    real_eval = train.loop.evaluate_drafter

    def slow_eval(*args, **kwargs):
        clock[0] += 1000.0
        return real_eval(*args, **kwargs)

    monkeypatch.setattr(time, "monotonic", tick)
    monkeypatch.setattr(train.loop, "evaluate_drafter", slow_eval)
    cache = tiny_cache(tmp_path / "cache", num_batches=4)
    out = tmp_path / "run"
    caplog.set_level(logging.INFO)
    args = tiny_cli_args(cache, out, "--max-steps", "4", "--eval-shards", "1", "--eval-every", "2", "--log-every", "1")
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    records = read_records(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[0]["perf/eta_s"] < 100, records[0]  # the one-off evaluation is not a step's cost
    for prev, rec in zip(records, records[1:]):
        interval_s = (rec["data/tokens_seen"] - prev["data/tokens_seen"]) / rec["perf/tokens_per_s"]
        assert interval_s < 100, (rec["step"], interval_s)  # the step-2 evaluation is not in step 3's rate
    # Nor in the ETA (before: 1000 s of evaluation per 2 steps made it jump), but said apart.
    assert records[2]["perf/eta_s"] < 100 and records[2]["perf/eval_s"] == pytest.approx(2000, abs=10), records[2]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 3/4")]
    assert len(lines) == 1 and "(steps; evaluations took 33m" in lines[0], lines
    evals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eval at step 2 (16m4")]
    assert len(evals) == 1, "each evaluation says how long it took"
