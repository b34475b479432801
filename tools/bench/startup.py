"""Start-up of extraction and training, cold then warm, as whole processes at 27B width.

Each stage runs twice as a fresh process on one new, empty compile cache (shards/common/compile_cache.py):
cold (every graph compiled, every Triton kernel built and tuned) then warm (the same command again,
loading what the first one kept). Each process records its phases (shards/common/startup.py); this
prints them side by side with the goals of issue 32 on a warm run:
    extraction   first batch <= 20 s after the weights (bench_extract --startup-only, --configs as given)
    training     first step <= 30 s after the process started (bench_train, graphs mode, one step)
The processes: `python -m tools.bench.extract ... --startup-only` and `python -m tools.bench.train ...`,
each with --compile-cache; their JSON and logs stay in --work.

    python -m tools.bench.startup --out bench_startup.json --work /tmp/startup
    python -m tools.bench.startup --out bench_startup.json --work /tmp/startup --stages train --tiny
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import click

from shards.common.owned import Dir

log = logging.getLogger("bench_startup")

STAGES = ("extract", "train")
RUNS = ("cold", "warm")
GOALS = {"extract": ("first_batch_s", 20.0), "train": ("since_process_start_s", 30.0)}  # warm-run goals


def stage_command(stage: str, out_json: Path, work: Path, cache: Path, configs: str, tiny: bool) -> list[str]:
    """The benchmark process of `stage`, recording its start-up into `out_json`."""
    if stage == "extract":
        sized = ["--tiny", "--num-samples", "800"] if tiny else ["--num-samples", "200"]
        args = ["--cache-dir", str(work / "extract_cache"), "--hf-layers", "0", "--configs", configs]
        args += ["--timed-batches", "1", "--startup-only", *sized]
    else:
        sized = ["--device", "cpu", "--sizes", "tiny", "--modes", "eager"] if tiny else ["--sizes", "27b"]
        args = [*sized, *([] if tiny else ["--modes", "graphs"]), "--steps", "1"]
    return [sys.executable, "-m", f"tools.bench.{stage}", "--out", str(out_json), *args, "--compile-cache", str(cache)]


def run_stage(stage: str, run: str, work: Path, cache: Path, configs: str, tiny: bool) -> dict:
    """One whole process; returns its start-up record (refusing a process that failed, naming its log)."""
    out_json, log_path = work / f"{stage}_{run}.json", work / f"{stage}_{run}.log"
    command = stage_command(stage, out_json, work, cache, configs, tiny)
    log.info("%s %s: %s", stage, run, " ".join(command))
    started = time.perf_counter()
    with open(log_path, "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    wall_s = time.perf_counter() - started
    if code != 0:
        raise click.ClickException(f"{stage} {run} exited with {code}; its output: {log_path}")
    result = json.loads(out_json.read_text())
    startup = result["startup"] if stage == "extract" else result["results"][0]["startup"]
    return {**startup, "process_wall_s": round(wall_s, 3)}


def table(records: dict[str, dict[str, dict]]) -> str:
    """Phases as rows, cold and warm per stage as columns; the goal line per stage."""
    lines = []
    for stage, runs in records.items():
        phases = [p for p in dict.fromkeys(k for r in runs.values() for k in r) if p.endswith(("_s", "_graphs"))]
        lines.append(f"{stage:<28} {'cold':>9} {'warm':>9}")
        for phase in phases:
            cells = [runs.get(run, {}).get(phase) for run in RUNS]
            lines.append(f"  {phase:<26} " + " ".join(f"{c:>9.1f}" if c is not None else f"{'-':>9}" for c in cells))
        counts = [runs.get(run, {}).get("compile_counts") or {} for run in RUNS]
        lines.append(
            "  graphs / FX cache hit, miss, bypass: "
            + "; ".join(
                f"{run} {c.get('graphs', '-')} / {c.get('fxgraph_cache_hit', '-')}, {c.get('fxgraph_cache_miss', '-')}, "
                f"{c.get('fxgraph_cache_bypass', '-')}"
                for run, c in zip(RUNS, counts)
            )
        )
        key, limit = GOALS[stage]
        warm = runs.get("warm", {}).get(key)
        verdict = "-" if warm is None else ("met" if warm <= limit else "NOT met")
        lines.append(f"  goal: warm {key} <= {limit:.0f} s: {verdict}\n")
    return "\n".join(lines)


@click.command()
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="JSON results file.")
@click.option(
    "--work",
    required=True,
    type=click.Path(file_okay=False),
    help="A new directory for the compile cache, the benchmarks' JSON, logs and extraction cache.",
)
@click.option("--stages", default=",".join(STAGES), show_default=True, help="Comma-separated: extract, train.")
@click.option(
    "--extract-configs",
    default="fp8_write_fp8",
    show_default=True,
    help="bench_extract's --configs (the first counts).",
)
@click.option("--tiny", is_flag=True, help="CPU smoke run on tiny shapes (checks the script, measures nothing useful).")
def main(out_path: str, work: str, stages: str, extract_configs: str, tiny: bool) -> None:
    """Start-up per phase of extraction and training, cold then warm, as whole processes."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    chosen = [s.strip() for s in stages.split(",") if s.strip()]
    if not chosen or set(chosen) - set(STAGES):
        raise click.BadParameter(f"{stages!r}: choose from {', '.join(STAGES)}", param_hint="--stages")
    root = Path(work)
    if root.exists() and any(root.iterdir()):  # cold means an empty cache: never reuse, never delete
        raise click.BadParameter(f"{work} is not empty: name a new directory", param_hint="--work")
    with Dir.open(root, create=True) as d:
        d.child("compile", create=True).close()
    cache = root / "compile"
    records: dict[str, dict[str, dict]] = {}
    for stage in chosen:
        records[stage] = {}
        for run in RUNS:
            records[stage][run] = run_stage(stage, run, root, cache, extract_configs, tiny)
            Path(out_path).write_text(json.dumps({"compile_cache": str(cache), "stages": records}, indent=2))
    click.echo(table(records))


if __name__ == "__main__":
    main()
