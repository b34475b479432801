"""The run directory: only dflash-train's files in it, one training run at a time, its metrics history.

A run directory holds step-NNNNNNNN/ checkpoints, metrics.jsonl, run.json and run-resume-*.json,
eval.json, tb/ (TensorBoard), run*.png (dflash-train plot), the lock file and temporaries (.tmp-*).
Training refuses an --out that is a cache, lies inside or around the cache, or holds anything else:
a run writes and prunes files there, and must never touch what it did not make. Names alone prove
nothing (a user's own eval.json or metrics.jsonl): a directory is a run directory when it holds a
run.json that dflash-train wrote (RUN_RECORD_KEYS) or a checkpoint whose train_state.json it wrote;
without either it must be empty but for the lock and temporaries. RUN_LAYOUT says so; the judging
(a link, FIFO or device is never ours, whatever its name) is shards/common/owned's.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from shards.common.durable import remove_stale_temporaries
from shards.common.json_input import InputFileError, parse_json
from shards.common.owned import PROBE, Dir, Entry, Layout, OwnershipError, describe, nested, survey
from shards.format import CACHE_CONFIG_FILE
from train.checkpoint import store as checkpoint
from train.metrics import METRICS_FILE

log = logging.getLogger(__name__)

RUN_RECORD_FILE = "run.json"
# Keys every run.json that dflash-train writes has (train/loop.py Trainer._write_run_record).
RUN_RECORD_KEYS = ("config", "config_hash", "drafter", "total_steps", "world_size", "provenance")
_OUR_FILES = re.compile(r"metrics\.jsonl|run\.json|run-resume-\d{8}\.json|eval\.json|run.*\.png")
_OUR_FOLDERS = re.compile(r"step-\d{8}|tb")
_RESUME_RECORD = re.compile(r"run-resume-\d{8}\.json")  # a run started with --resume writes only these


def _is_our_name(name: str) -> bool:
    return bool(_OUR_FILES.fullmatch(name) or _OUR_FOLDERS.fullmatch(name))


def _claim(d: Dir, e: Entry, marked: bool) -> bool:
    """In a directory marked as a run's, the names dflash-train writes (files as files, folders as folders)."""
    names = _OUR_FILES if e.is_file else _OUR_FOLDERS
    return marked and names.fullmatch(e.name) is not None


def _is_run_directory(d: Dir) -> bool:
    """A run.json (or run-resume record) that dflash-train wrote, or a checkpoint of one in it."""
    records = [RUN_RECORD_FILE, *(n for n in d.names() if _RESUME_RECORD.fullmatch(n))]
    return any(is_run_record(d, n) for n in records) or _holds_our_checkpoint(d.path)


RUN_LAYOUT = Layout(
    claim=_claim,
    temporaries=_is_our_name,  # atomic writes of our files, e.g. a killed run.json or eval.json write
    temporary_folders=checkpoint.TEMPORARY_FOLDER,
    marked=_is_run_directory,
)


def check_run_dir(out_dir: str | Path, cache_dir: str | Path) -> None:
    """Refuse an --out that is (or nests with) the cache, or holds files dflash-train does not write."""
    out = Path(out_dir)
    if nested(out, cache_dir):
        raise OwnershipError(
            f"--out {out} and --cache {cache_dir} are the same directory or one lies inside the "
            "other; choose a run directory outside the cache"
        )
    if out.exists() and not out.is_dir():
        raise OwnershipError(f"--out {out} is a file; choose a new or empty run directory")
    if not out.is_dir():
        return
    with Dir.open(out) as d:
        if d.is_file(CACHE_CONFIG_FILE):
            raise OwnershipError(
                f"--out {out} is a dflash-extract cache ({out / CACHE_CONFIG_FILE}); choose a new or empty run "
                "directory"
            )
        found = survey(d, RUN_LAYOUT)
    if found.foreign and not found.marked:
        raise OwnershipError(
            f"--out {out} holds files dflash-train did not write ({describe(found.foreign)}): it has no run.json "
            "of a dflash-train run (nor a checkpoint of one), so none of them is ours; choose a new or empty "
            "run directory (a run prunes and replaces files in it)"
        )
    if found.foreign:
        raise OwnershipError(
            f"--out {out} holds files dflash-train did not write ({describe(found.foreign)}); choose a new "
            "or empty run directory (a run prunes and replaces files in it)"
        )


def _holds_our_checkpoint(out: Path) -> bool:
    """A step-NNNNNNNN folder whose train_state.json dflash-train wrote (a checkpoint copied in to resume from)."""
    return any(
        all(k in c.state for k in ("step", "config_identity", "drafter")) for c in checkpoint.list_checkpoints(out)
    )


def is_run_record(d: Dir, name: str) -> bool:
    """Whether `name` in `d` is a run.json that dflash-train wrote (a regular file holding a JSON object
    with every RUN_RECORD_KEYS key); a link or FIFO of that name never is (and is never opened)."""
    try:
        record = parse_json(d.read_bytes(name), str(d.path / name))
    except (OSError, ValueError):  # absent, not a regular file, not JSON
        return False
    return isinstance(record, dict) and all(k in record for k in RUN_RECORD_KEYS) and isinstance(record["config"], dict)


def clean_stale_temporaries(out_dir: str | Path) -> int:
    """Remove what killed runs left half written (checkpoint folders, run.json temporaries)."""
    finals = remove_stale_temporaries(out_dir, lambda final: _is_our_name(final) or final == PROBE)
    n = checkpoint.remove_stale_temporaries(out_dir) + len(finals)
    if n:
        log.info("removed %d temporary file(s) left in %s by a killed run", n, out_dir)
    return n


def truncate_metrics(out_dir: str | Path, step: int) -> int:
    """Keep only metrics.jsonl records of steps <= `step` (what the checkpoint being resumed had seen);
    returns how many were dropped. A resumed run then writes each later step exactly once."""
    with Dir.open(out_dir) as d:
        if d.lstat(METRICS_FILE) is None:
            return 0
        kept, dropped = [], 0
        for line in d.read_text(METRICS_FILE).splitlines():
            try:
                rec = parse_json(line, str(d.path / METRICS_FILE))
            except InputFileError:  # a line cut by a kill: it was never a complete record
                dropped += 1
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
                dropped += 1
                continue
            kept.append(line)
        if dropped:
            d.write_atomic(METRICS_FILE, lambda f: f.write("".join(line + "\n" for line in kept).encode()))
    return dropped
