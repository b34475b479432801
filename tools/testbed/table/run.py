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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shards.common.progress import format_duration
from shards.common.provenance import provenance
from tools.testbed.table.config import TableConfig
from tools.testbed.table.data import make_dataset
from tools.testbed.table.report import build_table, markdown, seeded_figures
from tools.testbed.table.rows import BASELINE, ROWS, Row, select_rows
from tools.testbed.table.steps import Plan, make_caches, train_and_evaluate
from tools.testbed.table.store import WorkDir
from train.eval.walk import context_bucket_labels

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
        if cfg.data_only:
            log.info(
                "table: --data-only: the data are in %s; the same command without it does the rest",
                dataset.train.parent,
            )
            return TableRun({}, "")
        table = _Table(cfg, Plan(cfg, dataset, device), work, selected, command)
        for row in selected:
            if row in runnable:
                table.run_row(row, clock)
            else:
                log.info("table: %s %s", row.name, SKIPPED_NO_CUDA)
        table.write()
        log.info(clock.line(f"done: {len(table.run.computed)} drafters trained, {len(table.run.reused)} reused"))
    return table.run


class _Table:
    """The results of one call so far, row by row, and the table made of them."""

    def __init__(self, cfg: TableConfig, plan: Plan, work: WorkDir, rows: list[Row], command: str):
        self.cfg, self.plan, self.work, self.rows, self.command = cfg, plan, work, rows, command
        self.done: dict[str, list[dict]] = {row.name: [] for row in rows}
        self.run = TableRun({}, "")

    def run_row(self, row: Row, clock: _Clock) -> None:
        """Each seed of `row`: its stored result when the fingerprint matches, else trained and evaluated now."""
        caches = None
        for seed in self.cfg.seeds:
            record = self.work.load_result(row.name, seed)
            if record is not None and record.get("fingerprint") == self.plan.fingerprint(row, seed):
                self.done[row.name].append(record)
                self.run.reused.append((row.name, seed))
                clock.num_units -= 1
                continue
            if record is not None:
                log.info("table: %s seed %d: settings changed since its stored result: computed again", row.name, seed)
            started = time.monotonic()
            if caches is None:  # a row's caches only when one of its seeds needs computing
                log.info(clock.line(f"{row.name}: extracting its caches"))
                caches = make_caches(self.plan, self.work, row)
            log.info(clock.line(f"{row.name} seed {seed}: training {self.cfg.steps} steps, then evaluating"))
            record = train_and_evaluate(self.plan, self.work, row, seed, caches)
            self.work.save_result(row.name, seed, record)
            self.done[row.name].append(record)
            self.run.computed.append((row.name, seed))
            clock.unit_done(time.monotonic() - started)
            self.write()

    def write(self) -> None:
        """table.json and table.md of the results so far (also kept in self.run)."""
        device = self.plan.device_type
        entries = []
        for row in self.rows:
            results = sorted(self.done[row.name], key=lambda r: r["seed"])
            if row.needs_cuda and device != "cuda":
                status = SKIPPED_NO_CUDA
            else:
                status = (
                    "done" if len(results) == len(self.cfg.seeds) else f"{len(results)} of {len(self.cfg.seeds)} seeds"
                )
            entries.append(
                {
                    "name": row.name,
                    "what": row.describe(vars(self.cfg)),
                    "status": status,
                    "results": results,
                    "versus": row.versus,
                }
            )
        baseline = BASELINE if any(r.name == BASELINE for r in self.rows) else self.rows[0].name
        figures = seeded_figures(self.cfg.eval_temperature, context_bucket_labels(tuple(self.cfg.context_buckets)))
        table = build_table(entries, baseline, figures)
        table["run"] = _provenance(self.cfg, device, self.command)
        self.run.table, self.run.markdown = table, markdown(table, _caption(table["run"]), figures)
        self.work.write_text("table.json", json.dumps(table, indent=2, sort_keys=True) + "\n")
        self.work.write_text("table.md", self.run.markdown)


def _provenance(cfg: TableConfig, device: str, command: str) -> dict:
    machine = torch.cuda.get_device_name(0) if device == "cuda" else f"CPU, {_cpu_count()} cores"
    return {
        "target": str(Path(cfg.target).resolve()),
        "prompts": str(Path(cfg.prompts).resolve()),
        "machine": machine,
        "date": time.strftime("%Y-%m-%d"),
        "command": command,
        "config": dict(vars(cfg)),
        "provenance": provenance(),  # git sha, package versions, argv, as caches and checkpoints record
    }


def _caption(run: dict) -> str:
    cfg, made = run["config"], run["provenance"]
    sampled = (
        f"; real decoding also at T={cfg['eval_temperature']:g}, its draws seeded with the drafter's training seed "
        "(random: its spread includes the draws')"
        if cfg["eval_temperature"] > 0
        else ""
    )
    return (
        f"Target {Path(run['target']).name}; {cfg['steps']} steps per drafter, block size {cfg['block_size']}, seeds "
        f"{','.join(str(s) for s in cfg['seeds'])}{sampled}; {run['machine']}, torch {made['versions']['torch']}, "
        f"git {(made['git_sha'] or 'unknown')[:7]}{' with uncommitted changes' if made.get('git_dirty') else ''}, {run['date']}; command: `{run['command']}`"
    )


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
