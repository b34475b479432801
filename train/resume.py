"""Whether a checkpoint may be resumed by this run: one comparison (shards.common.identity) of what the
checkpoint recorded with what the run has now, naming the flag of every setting that differs.

Compared, in this order (a refusal lists every difference, in this order):
  settings   the run's identity resolved against the cache (train/resolve.py: resolved_identity) with
             the checkpoint's "resolved_identity"; a checkpoint written before that was recorded: the
             raw cfg.identity() with its "config_identity"
  drafter    the resolved DrafterConfig with the checkpoint's, field by field (what the settings left out)
  world size the data cursor is per rank
  shards     the batch ids it trained on (the data cursor indexes them): another held-out split or
             another set of shards found
  cache      the target's config hash, then the cache identity (target head checksum, dataset
             fingerprint, shard count, cache id; checked only when the checkpoint recorded it)

A setting or drafter field added after a checkpoint was written is absent from its record: that run
trained as the behaviour before the field, which is the field's default (or, for a default changed since,
BEFORE_FIELD's value), so an absent key counts as that. Run now with another value, it differs and is named.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from shards.common.cli_options import flag_name, option_fields, shown
from shards.common.identity import differences
from train.checkpoint.store import STATE_FILE, Checkpoint, CheckpointError
from train.checkpoint.train_state import TrainState, train_state
from train.config import TrainConfig
from train.drafter.config import DFLASH2, DrafterConfig
from train.loss.config import LossConfig
from train.resolve import ResolvedRun, resolved_identity


def cache_identity(run: ResolvedRun) -> dict[str, Any]:
    """What a resumed run must find again in its cache: the same target weights, data and shards."""
    cc = run.cache_config
    return {
        "target_head_checksum": cc.target_head_checksum,
        "dataset_fingerprint": cc.dataset.fingerprint if cc.dataset is not None else None,
        "num_shards": len(run.train_ids) + len(run.eval_ids),
        "cache_id": cc.cache_id(),
    }


# Settings whose default changed: what a checkpoint written before the setting existed trained with.
BEFORE_FIELD = {"fp8": "off"}  # --fp8 auto resolves to a concrete mode, recorded; no FP8 before the flag


def recorded_setting(ckpt: Checkpoint, name: str) -> Any:
    """The value of setting `name` that checkpoint `ckpt` trained with (absent: module docstring)."""
    state = ckpt.state
    recorded = state.get("resolved_identity")
    if not isinstance(recorded, dict):
        recorded = state.get("config_identity") if isinstance(state.get("config_identity"), dict) else {}
    return recorded.get(name, BEFORE_FIELD.get(name, _field_defaults(TrainConfig).get(name)))


def _field_defaults(cls: type) -> dict[str, Any]:
    """{key: default as train_state.json holds it} of every option of config class `cls` that has one."""
    defaults = {}
    for o in option_fields(cls):
        if o.field.default is not dataclasses.MISSING:
            defaults[o.name] = o.field.default
        elif o.field.default_factory is not dataclasses.MISSING:
            defaults[o.name] = o.field.default_factory()
    return json.loads(json.dumps(defaults))


def _absent_as_default(recorded: dict, now: dict, cls: type) -> dict:
    """`recorded` with each key it lacks and `now` has set to that field's default (module docstring)."""
    defaults = {**_field_defaults(cls), **BEFORE_FIELD}
    return {**{k: defaults[k] for k in now.keys() - recorded.keys() if k in defaults}, **recorded}


SELECTOR_SETTINGS = tuple(f.name for f in dataclasses.fields(LossConfig) if f.name.startswith("selector_"))


def _without_selector(identity: dict) -> dict:
    return {k: v for k, v in identity.items() if k not in SELECTOR_SETTINGS}


def check_resume(ckpt: Checkpoint, cfg: TrainConfig, run: ResolvedRun, world_size: int) -> None:
    """Refuse (ValueError naming each flag) to resume `ckpt` under other resolved settings or another cache;
    first, a train_state.json with a field of another type, an unknown or a missing one (naming it)."""
    _check_position(train_state(ckpt), ckpt, cfg, run, world_size)
    state = ckpt.state
    recorded, now = state.get("resolved_identity"), resolved_identity(cfg, run)
    if not isinstance(recorded, dict):  # written before the resolved identity was recorded
        recorded, now = state.get("config_identity", {}), cfg.identity()
    elif _same_directory(recorded.get("init_from"), cfg.drafter.init_from):  # before --init-from was hashed
        now["init_from"] = recorded["init_from"]
    if run.drafter.arch != DFLASH2:  # the selector's settings do nothing to a DFlash 1 drafter
        recorded, now = _without_selector(recorded), _without_selector(now)
    settings = differences(_absent_as_default(recorded, now, TrainConfig), now)
    diffs = [d.describe("checkpoint", "now", _setting, shown) for d in settings]
    recorded_drafter = state.get("drafter")
    if isinstance(recorded_drafter, dict):
        drafter_now = json.loads(json.dumps(dataclasses.asdict(run.drafter)))  # as the checkpoint holds it
        differ = {d.key for d in settings}  # named once, as a setting
        diffs += [
            d.describe("checkpoint", "now", _drafter_field, shown)
            for d in differences(_absent_as_default(recorded_drafter, drafter_now, DrafterConfig), drafter_now)
            if d.key not in differ
        ]
    diffs += [
        d.describe("checkpoint", "now", show=str) + " (the data cursor is per rank)"
        for d in differences({"world_size": state.get("world_size")}, {"world_size": world_size})
    ]
    target_hash = run.cache_config.target.config_hash
    diffs += [
        d.describe("checkpoint", "now", lambda key: f"cache target {key}")
        for d in differences({"config_hash": state.get("target_config_hash")}, {"config_hash": target_hash})
    ]
    recorded_ids = state.get("train_ids")
    if isinstance(recorded_ids, list) and recorded_ids != run.train_ids:  # the cursor indexes this list
        diffs.append(
            f"--eval-shards: checkpoint trained on {len(recorded_ids)} shards, now {len(run.train_ids)} "
            f"(first difference at shard id {_first_difference(recorded_ids, run.train_ids)}; the held-out "
            "split or the shards found differ)"
        )
    recorded_cache, cache_now = state.get("cache_identity"), cache_identity(run)
    if isinstance(recorded_cache, dict):  # checkpoints written before it was recorded are checked without it
        diffs += [
            d.describe("checkpoint", "now", lambda key: f"cache {key}")
            for d in differences({k: recorded_cache.get(k) for k in cache_now}, cache_now)
        ]
    if diffs:
        raise ValueError(
            f"cannot resume from {ckpt.path}: settings differ ({'; '.join(diffs)}); "
            "use the original settings or a new --out directory"
        )


def _first_difference(a: list[int], b: list[int]):
    return next((x for x, y in zip(a, b) if x != y), (a if len(a) > len(b) else b)[min(len(a), len(b))])


def _check_position(state: TrainState, ckpt: Checkpoint, cfg: TrainConfig, run: ResolvedRun, world_size: int) -> None:
    """The data position train_state.json records lies within this run's epochs and shards per rank (a
    cursor past them once ended the epoch silently)."""
    per_rank = len(run.train_ids) // world_size
    for name, value, most in (("epoch", state.epoch, cfg.epochs), ("cursor", state.cursor, per_rank)):
        if value > most:
            raise CheckpointError(
                f"{ckpt.path / STATE_FILE}: {name} {value} is past this run's {most} ({cfg.epochs} epochs of "
                f"{per_rank} shards per rank); restore the checkpoint, or use an earlier one"
            )


def _is_option(key: str) -> bool:
    return any(o.name == key for o in option_fields(TrainConfig))


def _setting(key: str) -> str:
    """The flag that sets a recorded setting, else the setting's own name."""
    return flag_name(TrainConfig, key) if _is_option(key) else key


def _drafter_field(key: str) -> str:
    return f"drafter {key} ({flag_name(TrainConfig, key)})" if _is_option(key) else f"drafter {key}"


def _same_directory(recorded: Any, now: str | None) -> bool:
    """A checkpoint's --init-from recorded as a path (before its content was recorded) names `now`."""
    if not isinstance(recorded, str) or now is None or recorded.startswith("content crc32"):
        return False
    try:
        return recorded == now or os.path.samefile(recorded, now)
    except OSError:
        return False
