"""A cache of random hidden states with realistic packing, for tests and training benchmarks.

It goes through the same shards writer as dflash-extract, so it is a valid cache; only the numbers
are random (no target model runs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shards import CacheConfig, SampleEntry, TargetInfo, create_cache, encode_hidden, write_manifest, write_shard
from shards.format import PackingRecord
from shards.reader import ShardReader


def write_synthetic_cache(
    cache_dir: str | Path,
    *,
    hidden_size: int = 32,
    num_layers: int = 8,
    tap_layer_ids: tuple[int, ...] = (1, 3, 5),
    vocab_size: int = 128,
    token_budget: int = 256,
    max_seqs: int = 8,
    num_batches: int = 3,
    storage_dtype: str = "bf16",
    target_topk: int = 0,
    mask_token_id: int | None = None,
    seed: int = 0,
    plan: bool = False,
) -> CacheConfig:
    """plan: record a packing plan of num_batches shards in cache.json, as dflash-extract does (batch ids
    are then the planned 0..num_batches-1, present or not); default: none, the ids are the files."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = CacheConfig(
        target=TargetInfo(
            name="synthetic",
            config_hash=f"synthetic-{seed}",
            hidden_size=hidden_size,
            num_layers=num_layers,
            vocab_size=vocab_size,
            dtype="bfloat16",
        ),
        tap_layer_ids=list(tap_layer_ids),
        token_budget=token_budget,
        max_seqs=max_seqs,
        storage_dtype=storage_dtype,
        target_topk=target_topk,
        mask_token_id=vocab_size - 1 if mask_token_id is None else mask_token_id,
        # No dataset record: the batches are generated (the seed is in config_hash).
        packing=_plan(num_batches) if plan else None,
    )
    head = {
        "embed_tokens": torch.randn(vocab_size, hidden_size, generator=gen).to(torch.bfloat16),
        "lm_head": torch.randn(vocab_size, hidden_size, generator=gen).to(torch.bfloat16) / hidden_size**0.5,
        "final_norm": torch.zeros(hidden_size, dtype=torch.bfloat16),
    }
    create_cache(cache_dir, cfg, head)
    for batch_id in range(num_batches):
        tensors, samples = _random_batch(cfg, batch_id, rng, gen)
        write_shard(cache_dir, cfg, batch_id, tensors, samples)
    reader = ShardReader(cache_dir)
    write_manifest(cache_dir, [reader.info(b) for b in reader.batch_ids()])
    return cfg


def _plan(num_batches: int) -> PackingRecord:
    """A packing record that plans batch ids 0..num_batches-1 (nothing truncated, skipped or empty)."""
    counts = dict.fromkeys(("num_truncated", "num_skipped", "num_empty"), 0)
    return PackingRecord(
        algorithm="synthetic", long_seqs="truncate", num_batches=num_batches, padding_efficiency=0.0, **counts
    )


def _random_batch(cfg: CacheConfig, batch_id: int, rng: np.random.Generator, gen: torch.Generator):
    t, s = cfg.token_budget, cfg.max_seqs
    num_seqs = int(rng.integers(1, s + 1))
    cuts = np.sort(rng.choice(np.arange(1, t - t // 8), size=num_seqs - 1, replace=False)) if num_seqs > 1 else []
    total = int(rng.integers(t - t // 8, t + 1))
    bounds = [0, *[int(c) for c in cuts], total]
    input_ids = torch.zeros(t, dtype=torch.int32)
    position_ids = torch.zeros(t, dtype=torch.int32)
    loss_mask = torch.zeros(t, dtype=torch.uint8)
    samples = []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        input_ids[a:b] = torch.from_numpy(rng.integers(0, cfg.target.vocab_size - 1, size=b - a).astype(np.int32))
        position_ids[a:b] = torch.arange(b - a, dtype=torch.int32)
        prompt = int(rng.integers(0, max(1, (b - a) // 2)))
        loss_mask[a + prompt : b] = 1
        samples.append(SampleEntry(f"synthetic-{batch_id}-{i}", a, b - a, int(loss_mask[a:b].sum())))
    cu = torch.tensor(bounds + [total] * (s + 1 - len(bounds)), dtype=torch.int32)
    hidden = torch.randn(t, cfg.num_taps, cfg.target.hidden_size, generator=gen)
    hidden[total:] = 0
    tensors = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
        "cu_seqlens": cu,
        **encode_hidden(hidden, cfg.storage_dtype),
    }
    if cfg.target_topk:
        logits = torch.randn(t, cfg.target.vocab_size, generator=gen)
        lp, ids = logits.log_softmax(-1).topk(cfg.target_topk, dim=-1)
        tensors["target_topk_ids"] = ids.to(torch.int32)
        tensors["target_topk_logprobs"] = lp.to(torch.bfloat16)
    return tensors, samples
