"""The acceptance table from one call: data, then row by row and seed by seed a drafter and its figures.

Resumable at every level: the data and the caches are reused or resumed (tools/testbed/table/data.py,
dflash-extract), a (row, seed) whose stored result has this run's fingerprint is skipped, a training run
cut half way resumes from its last checkpoint. After each result the table of what is done so far is
written (WORK/table.md and WORK/table.json), so a run cut by a time limit leaves its table too.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shards.common.progress import format_duration
from tools.testbed.table.config import TableConfig
from tools.testbed.table.data import make_dataset
from tools.testbed.table.report import build_table, markdown
from tools.testbed.table.rows import BASELINE, ROWS, Row, select_rows
from tools.testbed.table.steps import Plan, make_caches, train_and_evaluate
from tools.testbed.table.store import WorkDir

log = logging.getLogger("tools.testbed.table")

SKIPPED_NO_CUDA = "skipped: needs CUDA"


@dataclass
class TableRun:
    """What one call did and found: the table's JSON, its Markdown, and which (row, seed) it computed."""

    table: dict
    markdown: str
    computed: list[tuple[str, int]] = field(default_factory=list)
    reused: list[tuple[str, int]] = field(default_factory=list)


class _Clock:
    """Elapsed time, and an ETA from the mean time of the (row, seed) units computed so far in this call."""

    def __init__(self, num_units: int):
        self.start = time.monotonic()
        self.num_units, self.num_done, self.unit_seconds = num_units, 0, 0.0

    def unit_done(self, seconds: float) -> None:
        self.num_done += 1
        self.unit_seconds += seconds

    def line(self, what: str) -> str:
        left = self.num_units - self.num_done
        eta = format_duration(self.unit_seconds / self.num_done * left) if self.num_done else "?"
        elapsed = format_duration(time.monotonic() - self.start)
        return f"table: {what} | elapsed {elapsed} | ETA {eta} ({left} of {self.num_units} drafters to go)"


def device_type(device: str) -> str:
    """cpu or cuda, as --device resolves it (auto: cuda when there is one)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def run_table(cfg: TableConfig, rows: Sequence[Row] = ROWS, command: str = "a library call") -> TableRun:
    """Everything the table command does; raises UserError (and ValueError) naming the flag or file.
    `command` is how the run was started, for the table's caption."""
    selected = select_rows(cfg.rows, rows)
    device = device_type(cfg.device)
    work = WorkDir.open(cfg.work)
    with work.lock():
        runnable = [row for row in selected if device == "cuda" or not row.needs_cuda]
        clock = _Clock(len(runnable) * len(cfg.seeds))
        dataset = make_dataset(cfg, work, lambda what: log.info(clock.line(what)))
        plan = Plan(cfg, dataset, device)
        done: dict[str, list[dict]] = {row.name: [] for row in selected}
        run = TableRun({}, "")
        for row in selected:
            if row not in runnable:
                log.info("table: %s %s", row.name, SKIPPED_NO_CUDA)
                continue
            caches = None
            for seed in cfg.seeds:
                record = work.load_result(row.name, seed)
                fingerprint = plan.fingerprint(row, seed)
                if record is not None and record.get("fingerprint") == fingerprint:
                    done[row.name].append(record)
                    run.reused.append((row.name, seed))
                    clock.num_units -= 1
                    continue
                if record is not None:
                    log.info(
                        "table: %s seed %d: its settings changed since its stored result: computed again",
                        row.name,
                        seed,
                    )
                started = time.monotonic()
                if caches is None:
                    log.info(clock.line(f"{row.name}: extracting its caches"))
                    caches = make_caches(plan, work, row)
                log.info(clock.line(f"{row.name} seed {seed}: training {cfg.steps} steps, then evaluating"))
                record = train_and_evaluate(plan, work, row, seed, caches)
                work.save_result(row.name, seed, record)
                done[row.name].append(record)
                run.computed.append((row.name, seed))
                clock.unit_done(time.monotonic() - started)
                _write_table(run, cfg, work, selected, done, device, command)
        _write_table(run, cfg, work, selected, done, device, command)
        log.info(clock.line(f"done: {len(run.computed)} drafters trained, {len(run.reused)} reused"))
    return run


def _write_table(
    run: TableRun, cfg: TableConfig, work: WorkDir, rows: list[Row], done: dict, device: str, command: str
) -> None:
    entries = []
    for row in rows:
        results = sorted(done[row.name], key=lambda r: r["seed"])
        if row.needs_cuda and device != "cuda":
            status = SKIPPED_NO_CUDA
        else:
            status = "done" if len(results) == len(cfg.seeds) else f"{len(results)} of {len(cfg.seeds)} seeds"
        entries.append({"name": row.name, "what": row.describe(vars(cfg)), "status": status, "results": results})
    baseline = BASELINE if any(r.name == BASELINE for r in rows) else rows[0].name
    table = build_table(entries, baseline)
    table["run"] = _provenance(cfg, device, command)
    run.table, run.markdown = table, markdown(table, _caption(table["run"]))
    work.write_text("table.json", _json(table))
    work.write_text("table.md", run.markdown)


def _provenance(cfg: TableConfig, device: str, command: str) -> dict:
    machine = torch.cuda.get_device_name(0) if device == "cuda" else f"CPU, {_cpu_count()} cores"
    return {
        "target": str(Path(cfg.target).resolve()),
        "prompts": str(Path(cfg.prompts).resolve()),
        "machine": machine,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "command": command,
        "config": {k: v for k, v in vars(cfg).items()},
    }


def _caption(run: dict) -> str:
    cfg = run["config"]
    return (
        f"Target {Path(run['target']).name}; {cfg['steps']} steps per drafter, seeds "
        f"{','.join(str(s) for s in cfg['seeds'])}; {run['machine']}, torch {run['torch']}, {run['date']}; "
        f"command: `{run['command']}`"
    )


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def _json(table: dict) -> str:
    return json.dumps(table, indent=2, sort_keys=True) + "\n"
