"""dflash-train plot and --tensorboard: what is drawn and logged is what metrics.jsonl says."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from tests.helpers.train import read_records, tiny_cache, tiny_cli_args
from train.cli import main
from train.metrics.plot import plot_run, read_run_metrics
from train.optim import OptimConfig


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished tiny run with held-out evaluations and TensorBoard on."""
    tmp = tmp_path_factory.mktemp("plot")
    cache = tiny_cache(tmp / "cache", num_batches=4)
    out = tmp / "run"
    res = CliRunner().invoke(
        main,
        tiny_cli_args(cache, out, "--max-steps", "6", "--eval-shards", "1", "--eval-every", "3", "--tensorboard"),
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    return out


def _events(run_dir):
    return [
        r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("event") == "eval"
    ]


def test_plot_draws_the_records_of_metrics_jsonl(run, tmp_path):
    out = tmp_path / "run.png"
    drawn = plot_run(run, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = read_records(run)
    steps = [float(r["step"]) for r in records]
    for label, key in (
        ("loss/total", "loss/total"),
        ("loss/ce", "loss/ce"),
        ("lr/logged", "opt/lr"),
        ("speed/tokens/s", "perf/tokens_per_s"),
    ):
        assert drawn[label] == (steps, [r[key] for r in records]), label
    # The learning rate of every step as it ran (6 steps, warmup ceil(0.1 * 6) = 1, cosine to 0 at the
    # last), written out here by hand; the logged values lie on it.
    peak, warmup, total = OptimConfig.lr, 1, 6
    want = [
        peak * (s + 1) / warmup
        if s < warmup
        else peak * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - 1 - warmup)))
        for s in range(total)
    ]
    xs, ys = drawn["lr/lr"]
    assert xs == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and ys == pytest.approx(want, rel=1e-12, abs=1e-18)
    assert [ys[int(x) - 1] for x in drawn["lr/logged"][0]] == pytest.approx(drawn["lr/logged"][1], rel=1e-12)
    assert "loss/kl" not in drawn and "loss/cap" not in drawn, "terms that are off are not drawn"
    evals = _events(run)
    assert [e["step"] for e in evals] == [0, 3, 6], "before training, every 3 steps (6 is also the end)"
    last = {e["step"]: e for e in evals}
    want_x = [float(s) for s in sorted(last)]
    assert drawn["acceptance/acceptance_length"] == (want_x, [last[s]["eval/acceptance_length"] for s in sorted(last)])
    assert drawn["loss/held-out"] == (want_x, [last[s]["eval/heldout_loss"] for s in sorted(last)])


def test_a_run_logged_every_few_steps_gets_its_schedule_drawn_as_it_ran(tmp_path):
    """The demo's case: few log records (here steps 1, 4, 8), a warmup that peaks between them. The lr panel
    still shows the peak at the step it ran at and the decay after it, not a line through the log points."""
    cache = tiny_cache(tmp_path / "cache", num_batches=5)
    out = tmp_path / "run"
    flags = ["--max-steps", "8", "--log-every", "4", "--warmup-ratio", "0.25", "--lr", "3e-3"]
    res = CliRunner().invoke(main, tiny_cli_args(cache, out, *flags), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    drawn = plot_run(out)
    assert drawn["lr/logged"][0] == [1.0, 4.0, 8.0]
    xs, ys = drawn["lr/lr"]
    assert xs == [float(s) for s in range(1, 9)] and ys[1] == max(ys) == pytest.approx(3e-3)  # steps 1-2 warm up
    # the cosine starts at the peak (step 3) and falls to the floor at the last step
    assert ys[2] == ys[1] and all(a > b for a, b in zip(ys[2:], ys[3:])) and ys[-1] == 0.0
    assert 3e-3 not in drawn["lr/logged"][1], "the peak was never logged: only the schedule shows it"


def test_plot_cli_writes_run_png_and_refuses_a_foreign_file(run, tmp_path):
    res = CliRunner().invoke(main, ["plot", str(run)])
    assert res.exit_code == 0, res.output
    assert (run / "run.png").read_bytes()[:4] == b"\x89PNG" and f"wrote {run / 'run.png'}" in res.output
    again = CliRunner().invoke(main, ["plot", str(run)])  # its own PNG: replaced
    assert again.exit_code == 0, again.output
    mine = tmp_path / "photo.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\n not a plot of ours")
    refused = CliRunner().invoke(main, ["plot", str(run), "--out", str(mine)])
    assert refused.exit_code == 1 and "was not written by dflash-train plot" in refused.output
    assert mine.read_bytes() == b"\x89PNG\r\n\x1a\n not a plot of ours"


@pytest.mark.parametrize("case", ["a missing directory", "another image format"])
def test_plot_cli_refuses_an_out_it_cannot_write_as_asked(run, tmp_path, case):
    out = {"a missing directory": tmp_path / "nodir" / "x.png", "another image format": tmp_path / "x.jpg"}[case]
    refused = CliRunner().invoke(main, ["plot", str(run), "--out", str(out)])
    assert refused.exit_code == 1 and (refused.exception is None or isinstance(refused.exception, SystemExit))
    expected = f"directory {out.parent} does not exist" if case == "a missing directory" else "name the file *.png"
    assert expected in refused.output, refused.output
    assert list(tmp_path.iterdir()) == [], "no directory made, no file written"


def test_a_resumed_run_draws_the_later_records(tmp_path):
    def rec(step, loss):
        return json.dumps(
            {
                "step": step,
                "epoch": 0,
                "loss/total": loss,
                "loss/ce": loss,
                "loss/kl": 0.0,
                "loss/cap": 0.0,
                "opt/lr": 1e-3,
                "perf/tokens_per_s": 100.0,
            }
        )

    def ev(step, acc):
        return json.dumps({"event": "eval", "step": step, "eval/acceptance_length": acc})

    # A run logs steps 1-5 and evaluates at 4, is killed, and resumes from its checkpoint at step 2;
    # the resumed run logs 3-6 and evaluates at 4 again; the last line was cut by a kill.
    lines = [
        rec(1, 9.0),
        rec(2, 8.0),
        rec(3, 7.0),
        rec(4, 6.0),
        ev(4, 1.5),
        rec(5, 5.0),
        rec(3, 6.5),
        rec(4, 5.5),
        ev(4, 1.7),
        rec(5, 4.5),
        rec(6, 4.0),
        '{"step": 7, "loss/to',
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    metrics = read_run_metrics(tmp_path)
    assert metrics.series("loss/total") == ([1, 2, 3, 4, 5, 6], [9.0, 8.0, 6.5, 5.5, 4.5, 4.0])
    assert metrics.series("eval/acceptance_length", evals=True) == ([4], [1.7])
    drawn = plot_run(tmp_path)
    assert drawn["loss/total"] == ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [9.0, 8.0, 6.5, 5.5, 4.5, 4.0])
    assert drawn["acceptance/acceptance_length"] == ([4.0], [1.7])


def test_tensorboard_events_hold_the_logged_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    records = read_records(run)
    for key in ("loss/total", "loss/ce", "opt/lr", "opt/grad_norm", "perf/tokens_per_s", "perf/data_wait_frac"):
        assert key in tags, (key, sorted(tags))
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        want = [(r["step"], r[key]) for r in records]
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6, abs=1e-12), key
