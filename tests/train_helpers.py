"""Helpers shared by the test_train_* modules: tiny caches and a tiny TrainConfig (no tests here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shards import ShardReader, encode_hidden, write_manifest, write_shard
from tools.synthetic_cache import write_synthetic_cache
from train.train_config import TrainConfig

TINY_CACHE = dict(hidden_size=32, vocab_size=128, token_budget=128, max_seqs=4, tap_layer_ids=(1, 3, 5))


def tiny_cache(path: Path, num_batches: int = 6, seed: int = 0, **overrides) -> Path:
    write_synthetic_cache(path, num_batches=num_batches, seed=seed, **{**TINY_CACHE, **overrides})
    return path


def tiny_config(cache: Path, out: Path, **overrides) -> TrainConfig:
    """A 1-layer, 32-wide drafter with 8 blocks of 4 per 128-token batch, fp32 on CPU."""
    options = dict(
        cache=str(cache),
        out_dir=str(out),
        epochs=2,
        num_blocks=8,
        block_size=4,
        num_layers=1,
        compute_dtype="float32",
        attention="sdpa",
        device="cpu",
        log_every=1,
        metrics_every=2,
        checkpoint_every=0,
        num_buffers=2,
        warmup_ratio=0.1,
    )
    options.update(overrides)
    return TrainConfig(**options)


def tiny_cli_args(cache: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--cache",
        str(cache),
        "--out",
        str(out),
        "--num-blocks",
        "8",
        "--block-size",
        "4",
        "--num-layers",
        "1",
        "--compute-dtype",
        "float32",
        "--attention",
        "sdpa",
        "--device",
        "cpu",
        "--log-every",
        "1",
        "--num-buffers",
        "2",
        "--warmup-ratio",
        "0.1",
        *extra,
    ]


def read_records(run_dir: Path) -> list[dict]:
    """Step records of metrics.jsonl (events such as eval or skipped shards left out)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "event" not in r]


def rewrite_shard(cache: Path, batch_id: int, edit) -> None:
    """Read a shard, let edit(tensors) change it (decoded hidden as float32 under 'hidden'), write it back."""
    reader = ShardReader(cache)
    tensors, info = reader.read(batch_id)
    tensors = dict(tensors)
    tensors["hidden"] = tensors["hidden"].float()
    edit(tensors)
    tensors.update(encode_hidden(tensors["hidden"], reader.config.storage_dtype))
    write_shard(cache, reader.config, batch_id, tensors, info.samples)


def make_learnable(cache: Path, stride: int = 1) -> None:
    """Turn a synthetic cache's sequences into counting sequences (token t+1 = token t + stride, mod V-1,
    so the MASK id V-1 never appears) and make each hidden state encode its own token: a drafter can
    learn to continue the count, an untrained one cannot."""
    reader = ShardReader(cache)
    cfg = reader.config
    vocab, hidden = cfg.target.vocab_size, cfg.target.hidden_size
    code_VKH = torch.randn(vocab, cfg.num_taps, hidden, generator=torch.Generator().manual_seed(7))
    for batch_id in reader.batch_ids():
        _, info = reader.read(batch_id)

        def edit(t, info=info, batch_id=batch_id):
            for i, s in enumerate(info.samples):
                start = (batch_id * 13 + i * 5) % (vocab - 1)
                ids = (start + stride * torch.arange(s.length)) % (vocab - 1)
                t["input_ids"][s.offset : s.offset + s.length] = ids.to(torch.int32)
            t["hidden"] = code_VKH[t["input_ids"].long()]
            t["hidden"][info.num_tokens :] = 0

        rewrite_shard(cache, batch_id, edit)
    write_manifest(cache, [reader.info(b) for b in reader.batch_ids()])
