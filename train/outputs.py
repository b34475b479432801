"""Result files written where the user says (`eval --out`, `plot --out`, a run's OUT/eval.json).

Checked before any work (shards.common.owned.check_output_file): the parent directory must exist
(never created silently: a typo in it would scatter results) and an existing file is replaced only
when it is a regular file whose content shows that dflash-train wrote it (never a user's file of the
same name, a link or a FIFO). eval.json is strict JSON (a NaN figure is written as null) and replaced
atomically.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from shards.common.durable import atomic_write_text
from shards.common.json_input import parse_json
from shards.common.owned import Dir

# Keys every eval.json of dflash-train holds (EvalResult.to_dict; EvalOutput.to_dict without a walk
# holds batch_ids and speculative_decoding).
_EVAL_KEYS = ("batch_ids",)
_EVAL_ANY_OF = ("acceptance_length", "speculative_decoding")


def is_eval_record(d: Dir, name: str) -> bool:
    """Whether `name` in `d` is an eval.json that dflash-train wrote (eval --out or a run's OUT/eval.json)."""
    try:
        record = parse_json(d.read_bytes(name), str(d.path / name))
    except (OSError, ValueError):  # absent, not a regular file, not JSON
        return False
    return isinstance(record, dict) and all(k in record for k in _EVAL_KEYS) and any(k in record for k in _EVAL_ANY_OF)


def _strict(obj: Any) -> Any:
    """obj with every non-finite float as None (JSON has no NaN or Infinity)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def write_eval_json(path: str | Path, record: dict[str, Any]) -> None:
    """Write an eval.json atomically as strict JSON (NaN and infinities as null)."""
    atomic_write_text(path, json.dumps(_strict(record), indent=1, allow_nan=False) + "\n")
