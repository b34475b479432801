"""The run directory: only dflash-train's files in it, one training run at a time, its metrics history.

A run directory holds step-NNNNNNNN/ checkpoints, metrics.jsonl, run.json and run-resume-*.json,
eval.json, tb/ (TensorBoard), run*.png (dflash-train plot), the lock file and temporaries (.tmp-*).
Training refuses an --out that is a cache, lies inside or around the cache, or holds anything else:
a run writes and prunes files there, and must never touch what it did not make. Names alone prove
nothing (a user's own eval.json or metrics.jsonl): a directory is a run directory when it holds a
run.json that dflash-train wrote (RUN_RECORD_KEYS) or a checkpoint whose train_state.json it wrote;
without either it must be empty but for the lock and temporaries.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from shards.common.durable import PROBE, atomic_write_text, remove_stale_temporaries, temporary_final_name
from shards.common.json_input import InputFileError, parse_json, read_json
from shards.common.lock import LOCK_FILE
from shards.format import CACHE_CONFIG_FILE
from shards.ownership import describe, nested
from train.checkpoint import store as checkpoint

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
RUN_RECORD_FILE = "run.json"
# Keys every run.json that dflash-train writes has (train/loop.py Trainer._write_run_record).
RUN_RECORD_KEYS = ("config", "config_hash", "drafter", "total_steps", "world_size", "provenance")
_OURS = re.compile(r"^(step-\d{8}|metrics\.jsonl|run\.json|run-resume-\d{8}\.json|eval\.json|tb|run.*\.png)$")


def check_run_dir(out_dir: str | Path, cache_dir: str | Path) -> None:
    """Refuse an --out that is (or nests with) the cache, or holds files dflash-train does not write."""
    out = Path(out_dir)
    if nested(out, cache_dir):
        raise ValueError(
            f"--out {out} and --cache {cache_dir} are the same directory or one lies inside the "
            "other; choose a run directory outside the cache"
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; choose a new or empty run directory")
    if not out.is_dir():
        return
    if (out / CACHE_CONFIG_FILE).exists():
        raise ValueError(
            f"--out {out} is a dflash-extract cache ({out / CACHE_CONFIG_FILE}); choose a new or empty run directory"
        )
    entries = [p for p in sorted(out.iterdir()) if not (p.name == LOCK_FILE or _is_our_temporary(p))]
    if not entries:
        return
    resumed_records = sorted(out.glob("run-resume-*.json"))  # a run started with --resume writes only these
    if not (
        is_run_record(out / RUN_RECORD_FILE) or any(map(is_run_record, resumed_records)) or _holds_our_checkpoint(out)
    ):
        raise ValueError(
            f"--out {out} holds files dflash-train did not write ({describe(entries)}): it has no run.json "
            "of a dflash-train run (nor a checkpoint of one), so none of them is ours; choose a new or empty "
            "run directory (a run prunes and replaces files in it)"
        )
    foreign = [p for p in entries if not _OURS.match(p.name)]
    if foreign:
        raise ValueError(
            f"--out {out} holds files dflash-train did not write ({describe(foreign)}); choose a new "
            "or empty run directory (a run prunes and replaces files in it)"
        )


def _is_our_name(name: str) -> bool:
    return bool(_OURS.match(name))


def _is_our_temporary(path: Path) -> bool:
    """A temporary a killed run of ours left: a checkpoint folder being built, or an atomic write of one
    of our files (a user's .tmp-notes stays theirs)."""
    final = temporary_final_name(path)
    return checkpoint.is_checkpoint_temporary(path) or (final is not None and _is_our_temp_final(final))


def _is_our_temp_final(final: str) -> bool:
    """A final name our atomic writes use here, or check_writable's probe (another rank's, a moment ahead)."""
    return _is_our_name(final) or final == PROBE


def _holds_our_checkpoint(out: Path) -> bool:
    """A step-NNNNNNNN folder whose train_state.json dflash-train wrote (a checkpoint copied in to resume from)."""
    return any(
        all(k in c.state for k in ("step", "config_identity", "drafter")) for c in checkpoint.list_checkpoints(out)
    )


def is_run_record(path: Path) -> bool:
    """Whether `path` is a run.json that dflash-train wrote (a JSON object with every RUN_RECORD_KEYS key)."""
    try:
        record = read_json(path)
    except (OSError, InputFileError):
        return False
    return isinstance(record, dict) and all(k in record for k in RUN_RECORD_KEYS) and isinstance(record["config"], dict)


def clean_stale_temporaries(out_dir: str | Path) -> int:
    """Remove what killed runs left half written (checkpoint folders, run.json temporaries)."""
    n = checkpoint.remove_stale_temporaries(out_dir) + len(remove_stale_temporaries(out_dir, _is_our_temp_final))
    if n:
        log.info("removed %d temporary file(s) left in %s by a killed run", n, out_dir)
    return n


def truncate_metrics(out_dir: str | Path, step: int) -> int:
    """Keep only metrics.jsonl records of steps <= `step` (what the checkpoint being resumed had seen);
    returns how many were dropped. A resumed run then writes each later step exactly once."""
    path = Path(out_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = parse_json(line, str(path))
        except InputFileError:  # a line cut by a kill: it was never a complete record
            dropped += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return dropped
