"""The typed view of a checkpoint's train_state.json, what resume, export and eval read it through.

store.py reads the file as untrusted (bounded, matched against its own checksum); before a run
resumes from it or a drafter is built from it, every field is checked here (shards/common/schema.py):
a value of another type, an unknown field (in the drafter's shape too) or a missing one is refused
naming the file and the field, as are a step other than the folder's name says and RNG states that
are not one valid base64 string per rank. A train_state.json of `[]` or with an unknown drafter field
once ended in an AttributeError or TypeError traceback.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass, field
from typing import Any

from shards.common.schema import record
from train.checkpoint.store import STATE_FILE, Checkpoint, CheckpointError
from train.drafter.config import DrafterConfig


@dataclass(kw_only=True)
class RngState:
    """One rank's random states, base64 of torch's state bytes (None: not used on that device)."""

    torch_cpu: str | None = None
    torch_cuda: str | None = None
    block_generator: str | None = None  # the generator that samples training blocks

    def __post_init__(self) -> None:
        for name in ("torch_cpu", "torch_cuda", "block_generator"):
            value = getattr(self, name)
            if value is not None:
                try:
                    binascii.a2b_base64(value, strict_mode=True)
                except binascii.Error as e:
                    raise ValueError(f"rng {name} is not base64 ({e})") from e


@dataclass(kw_only=True)
class TrainState:
    """train_state.json as train/loop.py writes it (fields added later default to None)."""

    step: int  # optimizer steps done
    epoch: int
    cursor: int  # index of the next shard in this epoch's per-rank order
    tokens_seen: int
    skipped_shards: int
    world_size: int  # ranks that wrote it: the data cursor and the RNG states are per rank
    config_identity: dict[str, Any]
    drafter: DrafterConfig
    rng: list[RngState]  # one per rank
    config_hash: str | None = None
    resolved_identity: dict[str, Any] | None = None
    target_config_hash: str | None = None
    cache_identity: dict[str, Any] | None = None
    train_ids: list[int] | None = None  # batch ids it trained on
    provenance: dict[str, Any] = field(default_factory=dict)
    checksums: dict[str, str] | None = None  # of model.safetensors and optimizer.pt
    state_checksum: str | None = None  # of this file (store.state_checksum)
    target_name: str | None = None  # the target's name, for the serve commands export prints
    longest_response: int | None = None  # the longest supervised run in the cache (eval --target warns past it)
    chat_mode: dict[str, Any] | None = None  # the cache's serving mode (eval --target warns in another one)
    chat_modes: list[dict[str, Any] | None] | None = None  # a cache of several modes: each (warned against)

    def __post_init__(self) -> None:
        for name in ("step", "epoch", "cursor", "tokens_seen", "skipped_shards"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, found {getattr(self, name)}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, found {self.world_size}")
        if len(self.rng) != self.world_size:
            raise ValueError(f"rng holds {len(self.rng)} states, world_size is {self.world_size}")


def train_state(ckpt: Checkpoint) -> TrainState:
    """The checkpoint's train_state.json, every field checked (InputFileError / CheckpointError naming it)."""
    source = str(ckpt.path / STATE_FILE)
    state = record(TrainState, ckpt.state, source)
    if state.step != ckpt.step:
        raise CheckpointError(f"{source}: step {state.step}, but the folder is {ckpt.path.name}: edited or moved")
    return state
