"""Training checkpoints: OUT/step-NNNNNNNN/ {model.safetensors, optimizer.pt, train_state.json}.

A checkpoint is built in a temporary directory beside its final name (.tmp-step-*), every file
fsynced, then renamed in one step and the run directory fsynced; train_state.json is written last
and records the crc32 of model.safetensors and optimizer.pt, and of its own content (state_checksum).
A folder counts only when it holds all three files, train_state.json parses (bounded: it is read as
untrusted) and matches its own checksum, and (when verified: resume, export) both file checksums match; a
damaged or partial newest checkpoint is skipped with a warning naming the file, and the previous
valid one wins. Valid ones older than the newest keep_checkpoints are deleted (Retention: never the
one just written or resumed from, never a damaged or later one), and temporaries of a killed save are
removed at the next start (remove_stale_temporaries). Checkpoints are resume sources only; whether
one may be resumed by a run is train/resume.py.

train_state.json: step, epoch, data cursor (index of the next shard in this epoch's per-rank
order), tokens seen, skipped shards, world size, config hash and identity, drafter config, cache
target fingerprint, and per-rank RNG states (torch CPU, CUDA, the block-sampling generator).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from shards.common.crc import crc32
from shards.common.diskfull import no_space_errno
from shards.common.durable import file_checksum, fsync_file
from shards.common.errors import UserError
from shards.common.json_input import InputFileError, parse_json, read_json_object
from shards.common.owned import DIR_MODE, FILE_MODE, TMP_PREFIX, Dir

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "train_state.json"
STATE_CHECKSUM = "state_checksum"  # train_state.json's checksum of itself (state_checksum)
_NAME = re.compile(r"^step-(\d{8})$")
# The folder save_checkpoint builds a checkpoint in: .tmp-step-NNNNNNNN-xxxxxxxx (Dir.make_temp_dir's suffix).
TEMPORARY_FOLDER = re.compile(rf"{re.escape(TMP_PREFIX)}step-\d{{8}}-\w+")


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


class CheckpointError(UserError, ValueError):
    """A checkpoint file is damaged, partial or cannot be written; the message names the file."""


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict,
    train_state: dict[str, Any],
    retention: Retention,
) -> Path:
    """Write step-{step:08d}/ durably (called on rank 0 only); then prune as `retention` says."""
    out_dir = Path(out_dir)
    final = out_dir / checkpoint_name(step)
    with Dir.open(out_dir, create=True) as run_dir:
        tmp_name, tmp = run_dir.make_temp_dir(f"{TMP_PREFIX}{final.name}-")
        current = out_dir / tmp_name / MODEL_FILE  # named in the error, as the user sees it
        try:
            with tmp:
                tmp.chmod(DIR_MODE)
                # safetensors and torch.save take paths: they write only in the folder just made exclusively,
                # through its descriptor (pinned_path), so nothing planted can redirect them.
                save_file(
                    {k: v.detach().cpu().contiguous() for k, v in model_state.items()}, tmp.pinned_path(MODEL_FILE)
                )
                current = current.with_name(OPTIMIZER_FILE)
                torch.save(optimizer_state, tmp.pinned_path(OPTIMIZER_FILE))
                checksums = {}
                for name in (MODEL_FILE, OPTIMIZER_FILE):
                    current = current.with_name(name)
                    os.chmod(tmp.pinned_path(name), FILE_MODE)
                    fsync_file(tmp.pinned_path(name))
                    checksums[name] = file_checksum(tmp.pinned_path(name))
                current = current.with_name(STATE_FILE)
                state = {**train_state, "checksums": checksums}
                state[STATE_CHECKSUM] = state_checksum(state)
                text = json.dumps(state, indent=1, sort_keys=True) + "\n"
                tmp.write_atomic(STATE_FILE, lambda f: f.write(text.encode()))
            if run_dir.lstat(final.name) is not None:  # a checkpoint of this step from a run that died after it
                run_dir.rmtree(final.name)  # a link of that name is refused, never followed
            current = final
            run_dir.replace(tmp_name, run_dir, final.name)
            run_dir.fsync()
        except BaseException as e:
            try:
                run_dir.rmtree(tmp_name)
            except OSError:
                pass
            if isinstance(e, OSError) and no_space_errno(e) is None:  # a full disk: the caller's one line
                raise CheckpointError(
                    f"checkpoint of step {step}: writing {current} failed ({e.strerror or e}); nothing partial was "
                    f"kept. Fix {out_dir} and re-run with --resume to continue from the last checkpoint"
                ) from e
            raise
    log.debug("checkpoint: saved %s", final)  # the writer reports it once durable (async_save.py)
    retention.verified.add(step)  # its checksums were just computed from the bytes written
    retention.prune(out_dir, written_step=step)
    return final


def verify_checkpoint(ckpt: Checkpoint, files: tuple[str, ...] = (MODEL_FILE, OPTIMIZER_FILE)) -> None:
    """Raise CheckpointError naming the first of `files` whose bytes differ from the recorded checksum."""
    recorded = ckpt.state.get("checksums")
    if not isinstance(recorded, dict):
        log.warning("checkpoint %s records no checksums (written by an older dflash-train): not verified", ckpt.path)
        return
    for name in files:
        path = ckpt.path / name
        try:
            found = file_checksum(path)
        except OSError as e:
            raise CheckpointError(f"{path}: unreadable ({e.strerror or e})") from e
        if found != recorded.get(name):
            raise CheckpointError(
                f"{path}: checksum mismatch (recorded {recorded.get(name)}, file has {found}): damaged or partial"
            )


def state_checksum(state: dict[str, Any]) -> str:
    """crc32 of train_state.json's content but this checksum, as canonical JSON (sorted keys, no spaces):
    what verifies the file itself, as its "checksums" verify the others. The same for the written and
    the parsed-back state: JSON keeps every value's text (floats by repr)."""
    body = {k: v for k, v in state.items() if k != STATE_CHECKSUM}
    return f"crc32:{crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


def load_checkpoint(folder: Path) -> Checkpoint:
    """The checkpoint a step-NNNNNNNN folder holds: its train_state.json bounded, parsed and matching its
    own checksum, its weight and optimizer files present; CheckpointError naming the file otherwise."""
    path = folder / STATE_FILE
    try:
        state = read_json_object(path)
    except (OSError, InputFileError) as e:
        raise CheckpointError(f"{path}: unreadable ({getattr(e, 'strerror', None) or e})") from e
    checked_state(path, state)
    absent = [n for n in (MODEL_FILE, OPTIMIZER_FILE) if not (folder / n).is_file()]
    if absent:
        raise CheckpointError(f"{folder}: missing {' and '.join(absent)} (an incomplete checkpoint)")
    named = _NAME.match(folder.name) or _NAME.match(folder.resolve().name)  # a link may name the folder
    return Checkpoint(folder, int(named.group(1)), state)


def checked_state(path: Path, state: Any) -> None:
    """train_state.json's content: an object matching its own checksum (CheckpointError naming the file)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    folder = path.parent
    recorded = state.get(STATE_CHECKSUM)
    if recorded is None:
        log.warning(
            "checkpoint %s: %s records no checksum of itself (an older dflash-train): not verified", folder, STATE_FILE
        )
    elif recorded != state_checksum(state):
        raise CheckpointError(
            f"{path}: checksum mismatch (recorded {recorded!r:.40}, content has {state_checksum(state)}): edited or damaged"
        )


def list_checkpoints(out_dir: str | Path) -> list[Checkpoint]:
    """Valid checkpoints, oldest first; incomplete, unreadable or edited folders are ignored (with a warning)."""
    found, out_dir = [], Path(out_dir)
    if not out_dir.is_dir():
        return found
    with Dir.open(out_dir) as run_dir:
        for name in run_dir.names():
            m = _NAME.match(name)
            if not m or not run_dir.is_dir(name):  # a link of a checkpoint's name is never one of ours
                continue
            p = out_dir / name
            # Seen without following links and never opening a FIFO or device: one planted there would
            # hang every command that lists checkpoints.
            try:
                with run_dir.child(name) as d:
                    state = parse_json(d.read_bytes(STATE_FILE), str(p / STATE_FILE))
                    complete = all(d.is_file(n) for n in (MODEL_FILE, OPTIMIZER_FILE))
                checked_state(p / STATE_FILE, state)
            except (OSError, ValueError, CheckpointError) as e:  # InputFileError is a ValueError
                log.warning("checkpoint %s ignored: %s", p, getattr(e, "strerror", None) or e)
                continue
            if not complete:
                log.warning("checkpoint %s ignored: missing %s or %s", p, MODEL_FILE, OPTIMIZER_FILE)
                continue
            found.append(Checkpoint(p, int(m.group(1)), state))
    return sorted(found, key=lambda c: c.step)


def checkpoint_folders(out_dir: str | Path) -> list[Path]:
    """Every step-NNNNNNNN folder in out_dir, valid or not (what a run directory's history holds)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.iterdir() if _NAME.match(p.name) and p.is_dir())


def latest_checkpoint(out_dir: str | Path, verify: bool = True) -> Checkpoint | None:
    """The newest checkpoint whose files match their checksums; a damaged newer one is skipped with a
    warning naming the file (verify=False: the newest complete folder, files unchecked)."""
    for ckpt in reversed(list_checkpoints(out_dir)):
        if not verify:
            return ckpt
        try:
            verify_checkpoint(ckpt)
            return ckpt
        except CheckpointError as e:
            log.warning("checkpoint %s skipped: %s; falling back to the previous one", ckpt.path, e)
    return None


def resolve_checkpoint(path: str | Path, files: tuple[str, ...] = (MODEL_FILE, OPTIMIZER_FILE)) -> Checkpoint | None:
    """The checkpoint `path` names (a step-NNNNNNNN folder), its `files` verified; or, for a run
    directory, its newest valid checkpoint; None when `path` is neither.

    A named checkpoint that is damaged is refused (CheckpointError), never replaced by an older one:
    the user asked for that step. A run directory's damaged newest one is skipped (latest_checkpoint).
    """
    path = Path(path)
    if not (path.is_dir() and _NAME.match(path.resolve().name)):
        return latest_checkpoint(path)
    named = load_checkpoint(path)
    verify_checkpoint(named, files)
    return named


@dataclass
class Retention:
    """Which checkpoints a run keeps after each save: the newest `keep` *valid* ones up to the step just
    written (each verified once per process), and what is older than them is deleted. Never pruned:
    the checkpoint just written and the one this run resumed from. Not counted, left in place and
    warned about once: a folder among the newest whose checksums do not match (it goes once `keep`
    valid newer ones exist), and a folder of a later step than the one just written (a resumed run's
    leftover: replaced when the run gets there). Used from one thread at a time (saves never overlap)."""

    keep: int  # valid checkpoints to keep (--keep-checkpoints)
    protected: set[int] = field(default_factory=set)  # steps never pruned (the one resumed from)
    verified: set[int] = field(default_factory=set)  # steps whose checksums this process checked or wrote
    damaged: set[int] = field(default_factory=set)  # steps found damaged (not read again)
    _reported: set[Path] = field(default_factory=set)  # folders already warned about

    def prune(self, out_dir: str | Path, written_step: int) -> None:
        checkpoints = list_checkpoints(out_dir)
        if sum(c.step <= written_step for c in checkpoints) <= self.keep:
            # Nothing older than the newest `keep` to delete: no folder needs reading (a 27B drafter's
            # checkpoint is ~20 GB) to decide what counts.
            remove_stale_temporaries(out_dir)
            return
        kept = 0
        for ckpt in reversed(checkpoints):
            if ckpt.step > written_step:
                self._report(
                    ckpt.path,
                    f"of a later step than the one just written ({written_step}): not counted "
                    "against --keep-checkpoints, left in place (replaced if the run reaches its step)",
                )
                continue
            if kept >= self.keep and ckpt.step != written_step and ckpt.step not in self.protected:
                _remove_folder(out_dir, ckpt.path.name)
                log.info("checkpoint: removed %s (keeping the newest %d)", ckpt.path, self.keep)
                continue
            if ckpt.step not in self.verified:
                if ckpt.step in self.damaged:
                    continue
                try:
                    verify_checkpoint(ckpt)
                except CheckpointError as e:
                    self.damaged.add(ckpt.step)
                    self._report(ckpt.path, f"damaged ({e}): not counted against --keep-checkpoints, left in place")
                    continue
                self.verified.add(ckpt.step)
            kept += 1
        remove_stale_temporaries(out_dir)

    def _report(self, path: Path, why: str) -> None:
        if path not in self._reported:
            self._reported.add(path)
            log.warning("checkpoint %s %s", path, why)


def _remove_folder(out_dir: str | Path, name: str) -> None:
    """Delete a folder of ours in the run directory, never through a link; a failure leaves it (as before)."""
    try:
        with Dir.open(out_dir) as run_dir:
            run_dir.rmtree(name)
    except (OSError, ValueError) as e:
        log.warning("could not remove %s: %s", Path(out_dir) / name, e)


def remove_stale_temporaries(out_dir: str | Path) -> int:
    """Delete the .tmp-step-* folders of saves that were killed; returns how many (call with the run's lock)."""
    with Dir.open(out_dir) as run_dir:
        stale = [n for n in run_dir.names() if TEMPORARY_FOLDER.fullmatch(n) and run_dir.is_dir(n)]
    for name in stale:
        _remove_folder(out_dir, name)
    return len(stale)


def load_model_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    path = ckpt.path / MODEL_FILE
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); use an earlier checkpoint") from e


def load_optimizer_state(ckpt: Checkpoint) -> dict:
    path = ckpt.path / OPTIMIZER_FILE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); use an earlier checkpoint") from e
