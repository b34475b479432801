"""The table itself: per row, mean and spread over seeds of each figure, and which differences from the
baseline row are within the spread; as JSON (table.json) and Markdown (table.md, for BENCHMARKS.md).

Spread of a row = max - min over its seeds (std is given too). A row's difference from the baseline is
"within the spread" when |mean - baseline mean| is at most the larger of the two rows' spreads: a
difference smaller than the seeds' own scatter is no difference. Cache bytes per token has no seed
scatter; it is compared as a ratio. The figures with a spread are `seeded_figures`: the decoding walk, real
decoding greedy and (with the table's --eval-temperature > 0) at that temperature, and the held-out loss.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    key: str  # in each result's "figures"
    title: str  # the table's column
    digits: int


BYTES = Figure("bytes_per_token", "cache bytes/token", 1)


def seeded_figures(eval_temperature: float) -> tuple[Figure, ...]:
    """The figures with a seed spread, in column order: real decoding at T beside the greedy one when T > 0."""
    sampled = (Figure("sampled_acceptance", f"real decoding acceptance (T={eval_temperature:g})", 3),)
    return (
        Figure("walk_acceptance", "decoding-walk acceptance", 3),
        Figure("real_acceptance", "real decoding acceptance (greedy)", 3),
        *(sampled if eval_temperature > 0 else ()),
        Figure("heldout_loss", "held-out loss", 4),
    )


def spread_stats(values: list[float]) -> dict:
    """n, mean, std (n-1; 0 for one value), min, max and spread (max - min)."""
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "spread": max(values) - min(values),
    }


def compare(row: dict, base: dict) -> dict:
    """The difference of two rows' means and whether it lies within the larger of their spreads."""
    delta = row["mean"] - base["mean"]
    spread = max(row["spread"], base["spread"])
    return {"delta": delta, "spread": spread, "within_spread": abs(delta) <= spread}


def build_table(rows: list[dict], baseline: str, figures: tuple[Figure, ...]) -> dict:
    """rows: [{"name", "what", "status", "results": [result records]}] -> the table's JSON body, with the
    statistics of `figures` (seeded_figures) and of the bytes per token."""
    out = []
    stats_of = {}
    for row in rows:
        entry = {k: row[k] for k in ("name", "what", "status")}
        entry["seeds"] = sorted(r["seed"] for r in row["results"])
        if row["results"]:
            entry["stats"] = {
                f.key: spread_stats([r["figures"][f.key] for r in row["results"]]) for f in (*figures, BYTES)
            }
            entry["real_lossless"] = all(r["figures"]["real_lossless"] for r in row["results"])
            stats_of[row["name"]] = entry["stats"]
        out.append(entry)
    base = stats_of.get(baseline)
    for entry in out:
        if base is None or entry["name"] == baseline or "stats" not in entry:
            continue
        entry["vs_baseline"] = {f.key: compare(entry["stats"][f.key], base[f.key]) for f in figures}
        entry["vs_baseline"]["bytes_ratio"] = entry["stats"][BYTES.key]["mean"] / base[BYTES.key]["mean"]
    return {"baseline": baseline, "figures": [f.key for f in figures], "rows": out}


def markdown(table: dict, caption: str, figures: tuple[Figure, ...]) -> str:
    """The table as Markdown: a caption, one line per row, then the comparisons with the baseline."""
    head = ["row", *(f.title for f in figures), BYTES.title, "seeds"]
    lines = [caption, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry in table["rows"]:
        name = entry["name"] + (" (baseline)" if entry["name"] == table["baseline"] else "")
        if "stats" not in entry:
            lines.append(f"| {name} | {entry['status']} |" + " |" * (len(head) - 2))
            continue
        cells = [_cell(entry["stats"][f.key], f.digits) for f in figures]
        cells.append(f"{entry['stats'][BYTES.key]['mean']:.{BYTES.digits}f}")
        cells.append(",".join(str(s) for s in entry["seeds"]) + ("" if entry["status"] == "done" else " (partial)"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Each figure: mean over seeds [min, max]. " + _rule(table["baseline"]), ""]
    lines += [f"- {entry['name']}: {_versus(entry, figures)}" for entry in table["rows"] if "vs_baseline" in entry]
    lines += ["", "Rows:", ""] + [f"- {entry['name']}: {entry['what']}" for entry in table["rows"]]
    lossy = [entry["name"] for entry in table["rows"] if entry.get("real_lossless") is False]
    if lossy:
        lines += ["", f"WARNING: real decoding gave other tokens than plain greedy decoding in {', '.join(lossy)}"]
    return "\n".join(lines) + "\n"


def _cell(stats: dict, digits: int) -> str:
    return f"{stats['mean']:.{digits}f} [{stats['min']:.{digits}f}, {stats['max']:.{digits}f}]"


def _rule(baseline: str) -> str:
    return (
        f"Against {baseline} (a difference of means no larger than the wider of the two rows' spreads, "
        "max - min over seeds, is within the spread: no difference):"
    )


def _versus(entry: dict, figures: tuple[Figure, ...]) -> str:
    parts = []
    for f in figures:
        c = entry["vs_baseline"][f.key]
        verdict = "within the spread" if c["within_spread"] else "beyond the spread"
        parts.append(f"{f.title} {c['delta']:+.{f.digits}f} ({verdict} {c['spread']:.{f.digits}f})")
    ratio = entry["vs_baseline"]["bytes_ratio"]
    parts.append(f"{BYTES.title} x{ratio:.2f}" if math.isfinite(ratio) else f"{BYTES.title} n/a")
    return "; ".join(parts)
