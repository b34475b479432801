"""Training checkpoints: OUT/step-NNNNNNNN/ {model.safetensors, optimizer.pt, train_state.json}.

A checkpoint is built in a temporary directory beside its final name, every file fsynced, then
renamed in one step; train_state.json is written last, and a folder counts only when it holds all
three files and train_state.json parses. The newest valid folder wins; older ones beyond
keep_checkpoints are deleted. Checkpoints are resume sources only (export is separate).

train_state.json: step, epoch, data cursor (index of the next shard in this epoch's per-rank
order), tokens seen, skipped shards, world size, config hash and identity, drafter config, cache
target fingerprint, and per-rank RNG states (torch CPU, CUDA, the block-sampling generator).
"""
from __future__ import annotations

import base64
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from shards.durable import fsync_dir

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "train_state.json"
_NAME = re.compile(r"^step-(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]  # train_state.json


def encode_rng(t: torch.Tensor | None) -> str | None:
    return None if t is None else base64.b64encode(t.cpu().numpy().tobytes()).decode()


def decode_rng(s: str | None) -> torch.Tensor | None:
    if s is None:
        return None
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def save_checkpoint(out_dir: str | Path, step: int, model_state: dict[str, torch.Tensor], optimizer_state: dict,
                    train_state: dict[str, Any], keep: int) -> Path:
    """Write step-{step:08d}/ durably (called on rank 0 only); prune to the newest `keep`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / checkpoint_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=out_dir))
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in model_state.items()}, str(tmp / MODEL_FILE))
        torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(train_state, indent=1, sort_keys=True) + "\n")
        for name in (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():  # a checkpoint of the same step from a run that died after writing it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("checkpoint: saved %s", final)
    prune_checkpoints(out_dir, keep)
    return final


def list_checkpoints(out_dir: str | Path) -> list[Checkpoint]:
    """Valid checkpoints, oldest first; incomplete or unreadable folders are ignored (with a warning)."""
    out_dir = Path(out_dir)
    found = []
    if not out_dir.is_dir():
        return found
    for p in out_dir.iterdir():
        m = _NAME.match(p.name)
        if not m or not p.is_dir():
            continue
        try:
            state = json.loads((p / STATE_FILE).read_text())
        except (OSError, json.JSONDecodeError) as e:
            log.warning("checkpoint %s ignored: %s unreadable (%s)", p, STATE_FILE, e)
            continue
        if not all((p / n).is_file() for n in (MODEL_FILE, OPTIMIZER_FILE)):
            log.warning("checkpoint %s ignored: missing %s or %s", p, MODEL_FILE, OPTIMIZER_FILE)
            continue
        found.append(Checkpoint(p, int(m.group(1)), state))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(out_dir: str | Path) -> Checkpoint | None:
    ckpts = list_checkpoints(out_dir)
    return ckpts[-1] if ckpts else None


def prune_checkpoints(out_dir: str | Path, keep: int) -> None:
    for old in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
        log.info("checkpoint: removed %s (keeping the newest %d)", old.path, keep)
    for stale in Path(out_dir).glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)


def load_model_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.path / MODEL_FILE))


def load_optimizer_state(ckpt: Checkpoint) -> dict:
    return torch.load(ckpt.path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)


def check_resume_compatible(ckpt: Checkpoint, identity: dict[str, Any], world_size: int,
                            target_config_hash: str) -> None:
    """Refuse to resume under different settings, naming every field that differs."""
    recorded = ckpt.state.get("config_identity", {})
    diffs = [f"{k}: checkpoint {recorded.get(k)!r}, now {identity.get(k)!r}"
             for k in sorted(set(recorded) | set(identity)) if recorded.get(k) != identity.get(k)]
    if ckpt.state.get("world_size") != world_size:
        diffs.append(f"world_size: checkpoint {ckpt.state.get('world_size')}, now {world_size} "
                     "(the data cursor is per rank)")
    if ckpt.state.get("target_config_hash") != target_config_hash:
        diffs.append(f"cache target config_hash: checkpoint {ckpt.state.get('target_config_hash')!r}, "
                     f"now {target_config_hash!r}")
    if diffs:
        raise ValueError(f"cannot resume from {ckpt.path}: settings differ ({'; '.join(diffs)}); "
                         "use the original settings or a new --out directory")
