"""Writing a cache: its config, the target head and one durable, checksummed shard per packed batch."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from shards.common.durable import atomic_write, atomic_write_text
from shards.common.owned import Dir
from shards.container import write_container
from shards.format import (
    CACHE_CONFIG_FILE,
    FORMAT_VERSION,
    SHARDS_DIR,
    TARGET_HEAD_FILE,
    TARGET_HEAD_TENSORS,
    CacheConfig,
    checksum,
    shard_path,
    target_head_shapes,
    tensor_specs,
)
from shards.sample_ids import MAX_SHARD_SAMPLES, sample_id_problem


@dataclass(frozen=True)
class SampleEntry:
    """Where one sample sits in its shard."""

    sample_id: str
    offset: int  # first token of the sample in the shard
    length: int  # tokens of the sample in the shard (after any truncation)
    loss_tokens: int  # supervised tokens (loss_mask == 1) of the sample
    mode: int = 0  # index into cache.json's modes (CacheConfig.modes): the serving mode it was rendered in


def create_cache(cache_dir: str | Path, cfg: CacheConfig, target_head: Mapping[str, torch.Tensor]) -> CacheConfig:
    """Write cache.json and target_head.safetensors and make the shard directory.

    cache.json is written last, so a directory with a cache.json always has its target head. Fills in
    cfg.target_head_checksum (the shards' cache_id depends on it) and returns cfg.
    """
    with Dir.opened(cache_dir, SHARDS_DIR, create=True):
        pass  # made now, not by the first shard's writer thread: a link there is refused before any work
    cfg.target_head_checksum = write_target_head(cache_dir, cfg, target_head)
    write_cache_config(cache_dir, cfg)
    return cfg


def write_target_head(cache_dir: str | Path, cfg: CacheConfig, target_head: Mapping[str, torch.Tensor]) -> str:
    """Durably write target_head.safetensors (the tensors checked against the cache's shapes and, when
    cfg records one, its checksum); returns the checksum."""
    missing = [n for n in TARGET_HEAD_TENSORS if n not in target_head]
    if missing:
        raise ValueError(f"target head is missing {missing}; expected {list(TARGET_HEAD_TENSORS)}")
    head = {}
    for name, shape in target_head_shapes(cfg.target).items():
        t = target_head[name].detach().to("cpu").contiguous()
        if tuple(t.shape) != shape:
            raise ValueError(f"target head tensor {name} has shape {tuple(t.shape)}, expected {shape}")
        head[name] = t
    head_checksum = checksum(head)
    if cfg.target_head_checksum not in (None, head_checksum):
        raise ValueError(f"target head checksum {head_checksum} differs from the config's {cfg.target_head_checksum}")
    meta = {"format_version": str(FORMAT_VERSION), "checksum": head_checksum}
    atomic_write(Path(cache_dir) / TARGET_HEAD_FILE, lambda f: write_container(f, head, meta))
    return head_checksum


def write_cache_config(cache_dir: str | Path, cfg: CacheConfig) -> None:
    atomic_write_text(Path(cache_dir) / CACHE_CONFIG_FILE, cfg.to_json())


def write_shard(
    cache_dir: str | Path,
    cfg: CacheConfig,
    batch_id: int,
    tensors: Mapping[str, torch.Tensor],
    samples: list[SampleEntry],
) -> Path:
    """Durably write one packed batch; it appears under its final name only when complete.

    `tensors` must match tensor_specs(cfg) exactly (CPU tensors); hidden states already in the storage
    encoding (codec.encode_hidden).
    """
    specs = tensor_specs(cfg)
    if set(tensors) != set(specs):
        raise ValueError(f"batch {batch_id}: tensors {sorted(tensors)} do not match the cache's {sorted(specs)}")
    for name, spec in specs.items():
        t = tensors[name]
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise ValueError(
                f"batch {batch_id}: tensor {name} is {tuple(t.shape)} {t.dtype}, "
                f"the cache expects {spec.shape} {spec.dtype}"
            )
    if len(samples) > MAX_SHARD_SAMPLES:
        raise ValueError(f"batch {batch_id}: {len(samples)} samples, more than the {MAX_SHARD_SAMPLES} a shard holds")
    for s in samples:
        if not 0 <= s.mode < len(cfg.modes):
            raise ValueError(
                f"batch {batch_id}: sample {s.sample_id!r} has mode {s.mode}, the cache lists {len(cfg.modes)}"
            )
        problem = sample_id_problem(s.sample_id)
        if problem is not None:  # the scan refuses such ids first, naming file and row
            raise ValueError(f"batch {batch_id}: sample id {problem}")
    host = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    metadata = {
        "format_version": str(cfg.format_version),
        "batch_id": str(batch_id),
        "cache_id": cfg.cache_id(),
        "storage_dtype": cfg.storage_dtype,
        "num_tokens": str(sum(s.length for s in samples)),
        "samples": json.dumps([_header_row(s, len(cfg.modes)) for s in samples]),
        "checksum": checksum(host),
    }
    path = shard_path(cache_dir, batch_id)
    with Dir.opened(cache_dir, SHARDS_DIR) as d:
        d.write_atomic(path.name, lambda f: write_container(f, host, metadata))
    return path


def _header_row(s: SampleEntry, num_modes: int) -> list:
    """A sample's row in the shard header: the mode index only in a cache of several modes, so caches of
    one mode keep the header every reader before chat_modes reads."""
    row = [s.sample_id, s.offset, s.length, s.loss_tokens]
    return row + [s.mode] if num_modes > 1 else row
