"""Helpers shared by the test_train_* modules: tiny caches, a tiny TrainConfig and its CLI arguments, the
trainer's first step computed by hand (no tests here)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from shards import (
    ShardReader,
    decode_context,
    encode_hidden,
    epoch_shard_order,
    load_target_head,
    write_manifest,
    write_shard,
)
from shards.common.cli_options import from_options
from shards.writer import write_cache_config
from tools.fixtures.synthetic_cache import write_synthetic_cache
from train.blocks import anchor_seed, sample_shard_blocks
from train.config import TrainConfig
from train.drafter.attention import BlockAttentionLayout
from train.drafter.config import DrafterConfig
from train.drafter.model import TargetHead
from train.loss.chunked import block_loss
from train.resolve import resolve_run

TINY_CACHE = dict(hidden_size=32, vocab_size=128, token_budget=128, max_seqs=4, tap_layer_ids=(1, 3, 5))


def tiny_cache(path: Path, num_batches: int = 6, seed: int = 0, **overrides) -> Path:
    write_synthetic_cache(path, num_batches=num_batches, seed=seed, **{**TINY_CACHE, **overrides})
    return path


# The tiny run's settings, by what they are for. The CLI tests pass the first three groups as flags
# (tiny_cli_args) and keep the CLI's defaults for the rest.
TINY_DRAFTER = dict(num_blocks=8, block_size=4, num_layers=1)  # 8 blocks of 4 per 128-token batch, 1 layer
ON_CPU = dict(compute_dtype="float32", attention="sdpa", device="cpu", num_buffers=2)
TINY_SCHEDULE = dict(log_every=1, warmup_ratio=0.1)
TINY_RUN = dict(epochs=2, metrics_every=2, checkpoint_every=0)  # library runs only: short, no checkpoints


def tiny_config(cache: Path, out: Path, **overrides) -> TrainConfig:
    """A 1-layer, 32-wide drafter with 8 blocks of 4 per 128-token batch, fp32 on CPU; overrides are
    dflash-train options by name (as flags, nested configs' fields included)."""
    options = {**TINY_DRAFTER, **ON_CPU, **TINY_SCHEDULE, **TINY_RUN, **overrides}
    return from_options(TrainConfig, {"cache": str(cache), "out_dir": str(out), **options})


def tiny_cli_args(cache: Path, out: Path, *extra: str) -> list[str]:
    """`dflash-train train` arguments of tiny_config's drafter, device and schedule, then `extra`."""
    settings = {**TINY_DRAFTER, **ON_CPU, **TINY_SCHEDULE}
    flags = [word for name, value in settings.items() for word in (f"--{name.replace('_', '-')}", str(value))]
    return ["train", "--cache", str(cache), "--out", str(out), *flags, *extra]


def read_records(run_dir: Path) -> list[dict]:
    """Step records of metrics.jsonl (events such as eval or skipped shards left out)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "event" not in r]


def hand_step_loss(model, drafter: DrafterConfig, cache: Path, cfg: TrainConfig, rank: int = 0, world_size: int = 1):
    """The LossParts of the trainer's first step on `rank`, computed here without the trainer: the rank's
    first shard of epoch 0, the anchors of its generator, the drafter's layout, float32 hidden states and
    the run's loss settings. Differentiable: the caller may call backward()."""
    run = resolve_run(cfg, world_size=world_size)
    reader = ShardReader(cache)
    t, _ = reader.read(epoch_shard_order(run.train_ids, 0, cfg.seed, rank, world_size)[0])
    raw = load_target_head(cache)
    head = TargetHead(raw["embed_tokens"].float(), raw["lm_head"].float())
    blocks = sample_shard_blocks(
        t,
        num_blocks=cfg.num_blocks,
        block_size=drafter.block_size,
        mask_token_id=drafter.mask_token_id,
        gamma=cfg.loss.gamma,
        generator=torch.Generator().manual_seed(anchor_seed(cfg.seed, rank=rank)),
    )
    layout = BlockAttentionLayout.for_drafter(drafter, num_ctx=reader.config.token_budget, num_blocks=cfg.num_blocks)
    layout.update(blocks.seq_start_N, blocks.anchor_N)
    hidden_TKH = decode_context(t, reader.config).float()
    out = model(hidden_TKH, t["position_ids"], head.embed(blocks.block_ids_NB), blocks.block_pos_NB, layout)
    return block_loss(out, head, blocks, cfg.loss)


def mix_modes(cache: Path, modes: list[dict]) -> Path:
    """Put a cache's samples in several serving modes, as dflash-extract records mixed-mode data:
    cache.json chat_modes, and sample i of shard b in mode (i + b) % len(modes) in the shard headers."""
    reader = ShardReader(cache)
    shards = {b: reader.read(b) for b in reader.batch_ids()}  # read before cache.json lists the modes
    cfg = reader.config
    cfg.chat_mode, cfg.chat_modes = None, modes
    write_cache_config(cache, cfg)
    for b, (tensors, info) in shards.items():
        samples = [dataclasses.replace(s, mode=(i + b) % len(modes)) for i, s in enumerate(info.samples)]
        write_shard(cache, cfg, b, tensors, samples)
    return cache


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


def run_steps(cache: Path, out: Path, num_steps: int, *, fp8_emulate: bool = False, **overrides) -> dict:
    """num_steps train_steps of tiny_config(**overrides) on the cache's first shard (CPU), with metrics:
    the step sums, each step's flat gradient just before its optimizer update, and the final weights.
    fp8_emulate: --fp8 runs torchao's emulation (build_step_state's test-only switch)."""
    from shards import LoadedShard, load_target_head
    from train.resolve import resolve_run
    from train.step import build_step_state, train_step

    cfg = tiny_config(cache, out, **overrides)
    state = build_step_state(
        cfg, resolve_run(cfg), load_target_head(cache), torch.device("cpu"), fp8_emulate=fp8_emulate
    )
    tensors, info = ShardReader(cache).read(0)
    state.batch.load(LoadedShard(0, tensors, info, release=lambda: None))
    grads: list[torch.Tensor] = []
    state.optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.append(state.grads.flat.clone()))
    for _ in range(num_steps):
        train_step(state, with_metrics=True)
    params = {name: p.detach().clone() for name, p in state.model.named_parameters()}
    return {"sums": state.totals.sums.flat.clone(), "grads": grads, "params": params, "state": state}
