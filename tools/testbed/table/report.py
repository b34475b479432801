"""The table itself: per row, mean and spread over seeds of each figure, and which differences from the
baseline row (or the row's own reference, Row.versus) are within the spread; as JSON (table.json) and
Markdown (table.md, for BENCHMARKS.md; per-bucket figures in a second table under the first).

Spread of a row = max - min over its seeds (std is given too). A row's difference from the baseline is
"within the spread" when |mean - baseline mean| is at most the larger of the two rows' spreads: a
difference smaller than the seeds' own scatter is no difference. Cache bytes per token has no seed
scatter; it is compared as a ratio. The figures with a spread are `seeded_figures`: the decoding walk, real
decoding greedy and (with the table's --eval-temperature > 0) at that temperature, and the held-out loss.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    key: str  # in each result's "figures"
    title: str  # the table's column
    digits: int


BYTES = Figure("bytes_per_token", "cache bytes/token", 1)


def seeded_figures(eval_temperature: float, bucket_labels: Sequence[str] = ()) -> tuple[Figure, ...]:
    """The figures with a seed spread, in column order: real decoding at T beside the greedy one when T > 0;
    then, per context bucket of the anchor's position (labels as eval prints them, e.g. "512-2K"), the
    walk's and greedy real decoding's acceptance (the table's second part)."""
    sampled = (Figure("sampled_acceptance", f"real decoding acceptance (T={eval_temperature:g})", 3),)
    buckets = [
        Figure(f"{key}@{label}", f"{what} {label}", 3)
        for label in bucket_labels
        for key, what in (("walk_acceptance", "walk"), ("real_acceptance", "greedy"))
    ]
    return (
        Figure("walk_acceptance", "decoding-walk acceptance", 3),
        Figure("real_acceptance", "real decoding acceptance (greedy)", 3),
        *(sampled if eval_temperature > 0 else ()),
        Figure("heldout_loss", "held-out loss", 4),
        *buckets,
    )


def is_bucket(figure: Figure) -> bool:
    return "@" in figure.key


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
    """rows: [{"name", "what", "status", "results": [result records], optional "versus": the row it is
    compared with instead of the baseline}] -> the table's JSON body, with the statistics of `figures`
    (seeded_figures) and of the bytes per token (None for a bucket where some seed had no step)."""
    out = []
    stats_of = {}
    for row in rows:
        entry = {k: row[k] for k in ("name", "what", "status")}
        entry["seeds"] = sorted(r["seed"] for r in row["results"])
        if row["results"]:
            entry["stats"] = {f.key: _stats(row["results"], f.key) for f in (*figures, BYTES)}
            entry["real_lossless"] = all(r["figures"]["real_lossless"] for r in row["results"])
            stats_of[row["name"]] = entry["stats"]
        out.append(entry)
    for entry in out:  # after every row's stats: a row's reference may come after it in the table
        other = row_reference(entry, rows, baseline)
        base = stats_of.get(other)
        if base is None or entry["name"] == other or "stats" not in entry:
            continue
        entry["versus"] = other
        entry["vs_baseline"] = {
            f.key: compare(entry["stats"][f.key], base[f.key])
            for f in figures
            if entry["stats"][f.key] is not None and base[f.key] is not None
        }
        entry["vs_baseline"]["bytes_ratio"] = entry["stats"][BYTES.key]["mean"] / base[BYTES.key]["mean"]
    return {"baseline": baseline, "figures": [f.key for f in figures], "rows": out}


def row_reference(entry: dict, rows: list[dict], baseline: str) -> str:
    """The row `entry` is compared with: its own `versus` when that row is in the table, else the baseline."""
    versus = next((row.get("versus") for row in rows if row["name"] == entry["name"]), None)
    return versus if versus is not None and any(row["name"] == versus for row in rows) else baseline


def _stats(results: list[dict], key: str) -> dict | None:
    values = [r["figures"].get(key, math.nan) for r in results]
    return None if any(v is None or math.isnan(v) for v in values) else spread_stats(values)


def markdown(table: dict, caption: str, figures: tuple[Figure, ...]) -> str:
    """The table as Markdown: a caption, one line per row, with context buckets a second table of the
    per-bucket acceptance, then the comparisons with the baseline (or a row's own reference)."""
    main = tuple(f for f in figures if not is_bucket(f))
    buckets = tuple(f for f in figures if is_bucket(f))
    lines = [caption, "", *_rows_table(table, main, with_bytes=True)]
    if buckets:
        lines += ["", "Acceptance per context bucket of the anchor's position (tokens):", ""]
        lines += _rows_table(table, buckets, with_bytes=False)
    lines += ["", "Each figure: mean over seeds [min, max]. " + _rule(table["baseline"]), ""]
    lines += [
        f"- {entry['name']}{_against(entry, table['baseline'])}: {_versus(entry, figures)}"
        for entry in table["rows"]
        if "vs_baseline" in entry
    ]
    lines += ["", "Rows:", ""] + [f"- {entry['name']}: {entry['what']}" for entry in table["rows"]]
    lossy = [entry["name"] for entry in table["rows"] if entry.get("real_lossless") is False]
    if lossy:
        lines += ["", f"WARNING: real decoding gave other tokens than plain greedy decoding in {', '.join(lossy)}"]
    return "\n".join(lines) + "\n"


def _rows_table(table: dict, figures: tuple[Figure, ...], with_bytes: bool) -> list[str]:
    head = ["row", *(f.title for f in figures), *([BYTES.title] if with_bytes else []), "seeds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry in table["rows"]:
        name = entry["name"] + (" (baseline)" if entry["name"] == table["baseline"] else "")
        if "stats" not in entry:
            lines.append(f"| {name} | {entry['status']} |" + " |" * (len(head) - 2))
            continue
        cells = [_cell(entry["stats"][f.key], f.digits) for f in figures]
        if with_bytes:
            cells.append(f"{entry['stats'][BYTES.key]['mean']:.{BYTES.digits}f}")
        cells.append(",".join(str(s) for s in entry["seeds"]) + ("" if entry["status"] == "done" else " (partial)"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _cell(stats: dict | None, digits: int) -> str:
    if stats is None:
        return "-"  # a context bucket where some seed's drafter had no step
    return f"{stats['mean']:.{digits}f} [{stats['min']:.{digits}f}, {stats['max']:.{digits}f}]"


def _against(entry: dict, baseline: str) -> str:
    return "" if entry.get("versus") in (None, baseline) else f" (against {entry['versus']})"


def _rule(baseline: str) -> str:
    return (
        f"Against {baseline} (a difference of means no larger than the wider of the two rows' spreads, "
        "max - min over seeds, is within the spread: no difference):"
    )


def _versus(entry: dict, figures: tuple[Figure, ...]) -> str:
    parts = []
    for f in figures:
        c = entry["vs_baseline"].get(f.key)
        if c is None:
            continue
        verdict = "within the spread" if c["within_spread"] else "beyond the spread"
        parts.append(f"{f.title} {c['delta']:+.{f.digits}f} ({verdict} {c['spread']:.{f.digits}f})")
    ratio = entry["vs_baseline"]["bytes_ratio"]
    parts.append(f"{BYTES.title} x{ratio:.2f}" if math.isfinite(ratio) else f"{BYTES.title} n/a")
    return "; ".join(parts)
