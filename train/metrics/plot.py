"""A picture of a training run: loss terms, learning rate, tokens/s and held-out acceptance vs step.

Input is OUT/metrics.jsonl: one record per log step (`step`, `loss/total`, `opt/lr`, ...) and event
records (`"event": "eval"` with `eval/...` keys, `"event": "schedule"` with the learning-rate schedule's
parameters, `"event": "skipped_shard"`). The learning-rate panel draws the schedule's lr at every step
(the step reads it from the same function, train/optim.py), the logged values as dots on it; a run
written before the schedule was recorded gets the logged values alone. A resumed run appends to
the same file from its checkpoint's step, so steps after that checkpoint can appear twice (the killed
run's and the resumed run's): when a record's step is not past the last one kept, everything kept
from that step on is dropped, and the later run wins (records and evaluations alike).

plot_run() draws with matplotlib's Agg backend (no display needed) and returns the plotted series as
read back from the figure's lines, so a caller (and the tests) can check what was drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shards.common.durable import atomic_write
from shards.common.json_input import iter_json_lines
from shards.common.owned import Dir, check_output_file
from shards.common.schema import typed
from train.metrics import METRICS_FILE
from train.optim import WarmupCosine

PLOT_FILE = "run.png"
_SOFTWARE = "dflash-train plot"  # PNG metadata: marks the files this command may overwrite
_LOSS_TERMS = ("loss/total", "loss/ce", "loss/kl", "loss/cap")
_ACCEPTANCE = "eval/acceptance_length"


@dataclass
class RunMetrics:
    records: list[dict[str, Any]] = field(default_factory=list)  # step records, ascending step
    evals: list[dict[str, Any]] = field(default_factory=list)  # eval events, ascending step
    schedule: dict[str, Any] | None = None  # the latest schedule event; None for runs that wrote none

    def series(self, key: str, evals: bool = False) -> tuple[list[int], list[float]]:
        rows = [r for r in (self.evals if evals else self.records) if _is_number(r.get(key))]
        return [int(r["step"]) for r in rows], [float(r[key]) for r in rows]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_run_metrics(run_dir: str | Path) -> RunMetrics:
    """Step records and eval events of a run, a resumed run's duplicates resolved (the later run wins)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a dflash-train run directory (--out)?")
    out = RunMetrics()
    for number, rec in iter_json_lines(path, partial_last_line=True):
        if not isinstance(rec, dict) or "step" not in rec:
            continue
        where = f"{path}, line {number}"
        step = typed(int, rec["step"], where, "step")
        event = typed(str | None, rec.get("event"), where, "event")
        if event is None:
            if out.records and out.records[-1]["step"] >= step:  # a resume: the later run wins from here
                out.records = [r for r in out.records if r["step"] < step]
                out.evals = [e for e in out.evals if e["step"] < step]
            out.records.append(rec)
        elif event == "eval":
            out.evals = [e for e in out.evals if e["step"] != step]
            out.evals.append(rec)
        elif event == "schedule" and _is_schedule(rec):
            out.schedule = rec
    out.evals.sort(key=lambda e: e["step"])
    return out


def plot_run(run_dir: str | Path, out_path: str | Path | None = None) -> dict[str, tuple[list[float], list[float]]]:
    """Draw the run's curves into a PNG (default RUN/run.png); returns {panel/label: (steps, values)}."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("dflash-train plot needs matplotlib: pip install -e '.[plot]'") from None
    out_path = Path(out_path) if out_path is not None else Path(run_dir) / PLOT_FILE
    if out_path.suffix.lower() != ".png":
        raise ValueError(f"--out {out_path}: dflash-train plot writes PNG images; name the file *.png")
    check_output_file(out_path, "--out", _is_our_png, _SOFTWARE)
    metrics = read_run_metrics(run_dir)
    if not metrics.records:
        raise ValueError(f"{Path(run_dir) / METRICS_FILE} holds no step records yet: nothing to plot")

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    loss_ax, lr_ax, speed_ax, accept_ax = axes.flat
    for key in _LOSS_TERMS:
        steps, values = metrics.series(key)
        if key in ("loss/total", "loss/ce") or any(v != 0 for v in values):  # kl/cap only when switched on
            # The total wide and pale underneath: with ce its only term the two are equal, and a line of the
            # same width would hide it under ce's.
            style = dict(linewidth=4, alpha=0.35) if key == "loss/total" else dict(linewidth=1.5, linestyle="--")
            loss_ax.plot(steps, values, marker=".", label=key.split("/")[1], **style)
    steps, values = metrics.series("eval/heldout_loss", evals=True)
    if steps:
        loss_ax.plot(steps, values, "o--", label="held-out")
    loss_ax.set(title="loss (mean over each log interval)", ylabel="loss")
    _draw_lr(lr_ax, metrics)
    speed_ax.plot(*metrics.series("perf/tokens_per_s"), marker=".", label="tokens/s")
    speed_ax.set(title="context tokens per second (rank 0)", ylabel="tokens/s", xlabel="step")
    for key in sorted({k for e in metrics.evals for k in e if k.startswith(_ACCEPTANCE)}) or [_ACCEPTANCE]:
        steps, values = metrics.series(key, evals=True)
        if steps:
            accept_ax.plot(steps, values, "o-", label=key.split("/")[1])
    if not accept_ax.lines:
        accept_ax.text(
            0.5,
            0.5,
            "no held-out evaluation\n(train with --eval-shards N)",
            ha="center",
            va="center",
            transform=accept_ax.transAxes,
        )
    accept_ax.set(title="held-out acceptance length (tokens per target forward)", ylabel="tokens", xlabel="step")
    drawn: dict[str, tuple[list[float], list[float]]] = {}
    for name, ax in (("loss", loss_ax), ("lr", lr_ax), ("speed", speed_ax), ("acceptance", accept_ax)):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(loc="best", fontsize="small")
        for line in ax.lines:
            assert f"{name}/{line.get_label()}" not in drawn, f"{line.get_label()} drawn twice"
            drawn[f"{name}/{line.get_label()}"] = (
                [float(x) for x in line.get_xdata()],
                [float(y) for y in line.get_ydata()],
            )
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    # An atomic write of ours (.tmp-run.png.xxxxxxxx): a killed plot leaves a temporary the run
    # directory's check recognises and the next run removes.
    atomic_write(out_path, lambda f: fig.savefig(f, format="png", dpi=100, metadata={"Software": _SOFTWARE}))
    plt.close(fig)
    return drawn


def _draw_lr(ax, metrics: RunMetrics) -> None:
    """Every step's lr from the recorded schedule (the logged values as dots on it), else the logged ones."""
    logged = metrics.series("opt/lr")
    sched = metrics.schedule
    if sched is None or not metrics.records:
        ax.plot(*logged, marker=".", label="lr")
    else:
        schedule = WarmupCosine(
            peak_lr=sched["opt/peak_lr"],
            warmup_steps=sched["opt/warmup_steps"],
            total_steps=sched["opt/total_steps"],
            min_lr_ratio=sched["opt/min_lr_ratio"],
            device=torch.device("cpu"),
        )
        last = metrics.records[-1]["step"]
        ax.plot(range(1, last + 1), schedule.host_lrs(last), label="lr")
        ax.plot(*logged, "o", markersize=4, label="logged")
    ax.set(title="learning rate (each step's)", ylabel="lr")


def _is_schedule(rec: dict[str, Any]) -> bool:
    """A schedule record the plot can draw from (anything else is ignored: the logged lr is drawn alone)."""
    numbers = [rec.get(k) for k in ("opt/peak_lr", "opt/warmup_steps", "opt/total_steps", "opt/min_lr_ratio")]
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in numbers)


def _is_our_png(d: Dir, name: str) -> bool:
    """A PNG this command wrote (its metadata says so): the only file it overwrites."""
    head = d.read_bytes(name)[:4096]
    return head.startswith(b"\x89PNG") and _SOFTWARE.encode() in head
