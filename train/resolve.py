"""The config resolved against the cache: `resolve_run(cfg)` reads only the cache's JSON, the target
head's shapes and a few shard headers (no model, no GPU) and returns a `ResolvedRun`: the drafter shape (the
options pinned in cfg.drafter, the rest derived from the target's width or the --init-from drafter), the
train / held-out shard split (on a sample boundary: train/holdout.py) and the step budget, refusing a
cache that does not fit the config with both sides named.
`resolved_identity` is what a resume compares: the config's identity with each derived value filled in.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shards import CacheConfig, ShardError, ShardReader, read_cache_config
from shards.common.cli_options import flag_name, shown
from shards.container import read_header
from shards.format import TARGET_HEAD_FILE, shard_path, target_head_shapes
from shards.projection import load_projection
from train.blocks import default_num_blocks
from train.config import TrainConfig
from train.drafter.config import DFLASH1, DFLASH2, DFLASH2_27B_LAYOUT, DrafterConfig, DrafterOptions
from train.holdout import split_held_out

# MLP width / hidden of the published Qwen3.5-27B drafter (17408 / 5120); the default for other widths.
_MLP_RATIO = 3.4


def resolved_identity(cfg: TrainConfig, run: ResolvedRun) -> dict[str, Any]:
    """cfg.identity() with every option the cache or --init-from resolves (unset = derived) replaced by
    the value it resolved to: what a resume compares, so an unset flag and its resolved value given
    explicitly are the same run, and a cache whose MASK id (or taps) changed under an unset flag is not."""
    identity = cfg.identity()
    drafter = dataclasses.asdict(run.drafter)
    for name in identity.keys() & drafter.keys():
        identity[name] = drafter[name]
    identity["num_blocks"] = run.num_blocks
    if run.init_fingerprint is not None:  # the drafter's content, not the path it was read from
        identity["init_from"] = run.init_fingerprint
    return json.loads(json.dumps(identity))  # as train_state.json holds it: tuples as lists


@dataclass(kw_only=True)
class ResolvedRun:
    """What a TrainConfig means for one cache: everything the loop needs before touching a model."""

    cache_config: CacheConfig
    drafter: DrafterConfig
    num_blocks: int
    train_ids: list[int]  # batch ids trained on
    eval_ids: list[int]  # held-out batch ids (never trained on)
    steps_per_epoch: int  # per rank: each step reads one shard on every rank
    total_steps: int  # optimizer steps of the whole run (the schedule's length)
    warmup_steps: int
    init_fingerprint: str | None = None  # export.drafter_fingerprint of --init-from


def planned_batch_ids(cache_cfg: CacheConfig, cache_dir: str | Path) -> list[int]:
    """Every planned shard's batch id, not just the files present (the shards the cache files, when
    cache.json records no plan): the train / held-out split of training and `eval --eval-shards`, so a
    missing file is refused by name (or skipped under --skip-bad-shards) instead of shifting the split."""
    planned = cache_cfg.planned_batches
    return list(range(planned)) if isinstance(planned, int) else ShardReader(cache_dir).batch_ids()


def default_block_size(arch: str | None) -> int:
    """--block-size when neither the flag nor an --init-from drafter gives one: the published layout of
    the drafter kind (DFlash 2: Qwen3.8-27B-DFlash2's 8; DFlash 1: z-lab's 16)."""
    return DFLASH2_27B_LAYOUT["block_size"] if arch == DFLASH2 else DrafterConfig.block_size


def default_intermediate_size(hidden_size: int) -> int:
    """For caches that do not record the target's MLP width: the 27B's, else ~3.4 x hidden."""
    if hidden_size == 5120:
        return 17408
    return int(math.ceil(hidden_size * _MLP_RATIO / 64) * 64)


def resolve_run(cfg: TrainConfig, world_size: int = 1) -> ResolvedRun:
    """Check the cache against the config and derive the run's shapes and step budget."""
    cache_cfg = read_cache_config(cfg.cache)
    _check_taps(cfg, cache_cfg)
    _check_target_head(cfg.cache, cache_cfg)
    pinned = cfg.drafter
    if cfg.loss.kl_lambda > 0 and cache_cfg.target_topk == 0:
        raise ValueError(
            f"--kl-lambda {cfg.loss.kl_lambda} needs a cache with --target-topk > 0, but cache {cfg.cache} "
            "stores no target top-k; re-extract with --target-topk 8 or pass --kl-lambda 0"
        )
    mask_token_id = pinned.mask_token_id if pinned.mask_token_id is not None else cache_cfg.mask_token_id
    target = cache_cfg.target
    if mask_token_id is not None and not 0 <= mask_token_id < target.vocab_size:
        given = (
            f"--mask-token-id {mask_token_id}"
            if pinned.mask_token_id is not None
            else (f"cache {cfg.cache} records mask_token_id {mask_token_id} (cache.json) and --mask-token-id is unset:")
        )
        raise ValueError(
            f"{given} outside the target's vocabulary [0, {target.vocab_size}); pass --mask-token-id with the "
            f"target's MASK token (248070 for Qwen3.5)"
        )
    token_ids = {name: getattr(target, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    # The target's context length, which the export carries (None: a cache from before it was recorded).
    positions = {"max_position_embeddings": target.max_position_embeddings} if target.max_position_embeddings else {}
    if pinned.init_from is not None:
        drafter = _drafter_from_init(cfg, cache_cfg, mask_token_id)
        if pinned.arch == DFLASH2 and drafter.arch == DFLASH1:  # the warm start: DFlash 1 weights, new parts inert
            drafter = drafter.replace(arch=DFLASH2)
        # The target's own ids and context length win over whatever the published drafter recorded.
        drafter = drafter.replace(**{k: v for k, v in token_ids.items() if v is not None}, **positions)
    else:
        if mask_token_id is None:
            raise ValueError(
                f"no MASK token id: cache {cfg.cache} records none (cache.json mask_token_id null); "
                "pass --mask-token-id (248070 for Qwen3.5)"
            )
        try:
            drafter = DrafterConfig.for_target(
                hidden_size=target.hidden_size,
                intermediate_size=(
                    pinned.intermediate_size
                    or target.intermediate_size
                    or default_intermediate_size(target.hidden_size)
                ),
                vocab_size=target.vocab_size,
                num_target_layers=target.num_layers,
                tap_layer_ids=list(cache_cfg.tap_layer_ids),
                mask_token_id=mask_token_id,
                **_shape_options(cfg),
            )
            if pinned.num_attention_heads is not None:
                try:
                    drafter = drafter.replace(
                        num_attention_heads=pinned.num_attention_heads,
                        num_key_value_heads=pinned.num_key_value_heads,
                        head_dim=pinned.head_dim,
                    )
                except ValueError as e:
                    raise ValueError(
                        f"--num-attention-heads {pinned.num_attention_heads} --num-key-value-heads "
                        f"{pinned.num_key_value_heads} --head-dim {pinned.head_dim}: {e}; pick query heads "
                        "divisible by the kv heads and an even head dim, or omit all three"
                    ) from e
            drafter = drafter.replace(**token_ids, **positions)
        except ValueError as e:
            raise ValueError(f"drafter shape for cache {cfg.cache}: {e}") from e

    drafter = _projected(drafter, cache_cfg, cfg.cache)
    refuse_unseen_context(cache_cfg, drafter, cfg.cache)
    num_blocks = cfg.num_blocks or default_num_blocks(cache_cfg.token_budget, drafter.block_size)
    if num_blocks > cache_cfg.token_budget:
        raise ValueError(
            f"--num-blocks {num_blocks} exceeds the cache's --token-budget {cache_cfg.token_budget} "
            f"(one anchor per token at most); pass a smaller --num-blocks or omit it"
        )
    all_ids = planned_batch_ids(cache_cfg, cfg.cache)
    _check_shards_present(cfg, all_ids)
    _check_a_shard_header(cfg, all_ids)
    if cfg.eval.shards >= len(all_ids):
        raise ValueError(
            f"--eval-shards {cfg.eval.shards} leaves no training shards: cache "
            f"{cfg.cache} has {len(all_ids)}; pass --eval-shards {max(0, len(all_ids) - 1)} or fewer"
        )
    train_ids, eval_ids = all_ids, []
    if cfg.eval.shards > 0:
        asked = f"--eval-shards {cfg.eval.shards}"
        train_ids, eval_ids = split_held_out(
            all_ids, cfg.eval.shards, cache_cfg, cfg.cache, asked=asked, keep_training=True
        )
    steps_per_epoch = len(train_ids) // world_size
    if steps_per_epoch < 1:
        raise ValueError(
            f"cache {cfg.cache} has {len(train_ids)} training shards, fewer than the "
            f"{world_size} ranks: every rank needs at least one shard per epoch"
        )
    total_steps = cfg.epochs * steps_per_epoch
    if cfg.max_steps != -1:
        total_steps = min(total_steps, cfg.max_steps)
    return ResolvedRun(
        cache_config=cache_cfg,
        drafter=drafter,
        num_blocks=num_blocks,
        train_ids=train_ids,
        eval_ids=eval_ids,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        warmup_steps=cfg.optim.warmup_steps(total_steps),
        init_fingerprint=_init_fingerprint(cfg),
    )


# DrafterOptions fields that DrafterConfig.for_target takes under the same names (with the run's block_size).
_FOR_TARGET_OPTIONS = ("num_layers", "rope_theta", "layer_types", "sliding_window", "arch")
# DrafterOptions fields that --init-from takes from the drafter's config.json (DrafterConfig's names too).
_INIT_SHAPE_FIELDS = (
    "num_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "layer_types",
    "sliding_window",
)


def refuse_unseen_context(cache_cfg: CacheConfig, drafter: DrafterConfig, cache: str | Path) -> None:
    """A cache whose long samples are stored as pieces serves only drafters that see, from each anchor,
    no further back than a piece's context and no further ahead than its label tail."""
    pieces = cache_cfg.pieces
    if pieces is None or pieces.num_pieced_samples == 0:
        return
    where = (
        f"cache {cache} stores samples of up to {pieces.longest_sample} tokens as pieces of "
        f"{cache_cfg.token_budget} with {pieces.context} tokens of context and {pieces.label_reach} of labels"
    )
    layers = ",".join(drafter.layer_types)
    if not all(drafter.sliding_layers):
        raise ValueError(
            f"{where}; a full-attention layer (--layer-types {layers}) would see the whole sample, which no "
            f"piece holds: make every layer sliding (--layer-types sliding,... with --sliding-window at most "
            f"{pieces.context}), or re-extract with --max-seq-len {cache_cfg.token_budget} (long samples cut) or "
            f"a --token-budget of at least {pieces.longest_sample}"
        )
    if drafter.sliding_window > pieces.context:
        raise ValueError(
            f"{where}; --sliding-window {drafter.sliding_window} (--layer-types {layers}) reaches past a "
            f"piece's context: pass --sliding-window {pieces.context} or less, or re-extract with --piece-context "
            f"{drafter.sliding_window}"
        )
    if drafter.block_size - 1 > pieces.label_reach:
        raise ValueError(
            f"{where}; --block-size {drafter.block_size} needs {drafter.block_size - 1} label tokens after a "
            f"piece's last anchor: pass --block-size {pieces.label_reach + 1} or less, or re-extract with "
            f"--piece-label-reach {drafter.block_size - 1}"
        )


def _shape_options(cfg: TrainConfig) -> dict[str, Any]:
    """The shape options given, for DrafterConfig.for_target (its defaults for the rest); --layer-types
    alone sets the layer count."""
    pinned = cfg.drafter
    given = {name: getattr(pinned, name) for name in _FOR_TARGET_OPTIONS if getattr(pinned, name) is not None}
    given["block_size"] = cfg.block_size or default_block_size(pinned.arch)
    if pinned.layer_types is not None:
        given.setdefault("num_layers", len(pinned.layer_types))
    return given


def _init_fingerprint(cfg: TrainConfig) -> str | None:
    from train.checkpoint.export import drafter_fingerprint  # export imports the model: imported here

    return None if cfg.drafter.init_from is None else drafter_fingerprint(cfg.drafter.init_from)


def _drafter_from_init(cfg: TrainConfig, cache_cfg: CacheConfig, mask_token_id: int | None) -> DrafterConfig:
    """The --init-from drafter's shape, refused (every differing field named) when it does not fit."""
    from train.checkpoint.export import (  # export imports the model: imported here
        check_weight_files,
        read_drafter_config,
    )

    pinned = cfg.drafter
    try:
        drafter = read_drafter_config(pinned.init_from, mask_token_id=mask_token_id)
        check_weight_files(pinned.init_from, drafter)  # a cut-short file, other shapes: refused before any model
    except (OSError, ValueError) as e:
        raise ValueError(f"--init-from {pinned.init_from}: {e}") from e
    target = cache_cfg.target
    problems = []
    if pinned.arch == DFLASH1 and drafter.arch == DFLASH2:
        problems.append(f"--arch {DFLASH1}: the drafter is {DFLASH2} (drop --arch)")
    for option in _INIT_SHAPE_FIELDS:
        ours, theirs = getattr(pinned, option), getattr(drafter, option)
        if ours is not None and ours != theirs:
            flag = flag_name(DrafterOptions, option)
            typed = pinned.layer_types_typed if option == "layer_types" else shown(ours)
            problems.append(f"{flag} {typed}: the drafter has {shown(theirs)} (drop {flag})")
    for name, theirs, cache_value in (
        ("hidden_size", drafter.hidden_size, target.hidden_size),
        ("tap_layer_ids", drafter.tap_layer_ids, list(cache_cfg.tap_layer_ids)),
        ("num_target_layers", drafter.num_target_layers, target.num_layers),
        ("vocab_size", drafter.vocab_size, target.vocab_size),
    ):
        if theirs != cache_value:
            problems.append(f"{name}: drafter {theirs!r}, cache {cache_value!r}")
    if cfg.block_size is not None and drafter.block_size != cfg.block_size:
        problems.append(
            f"block_size: drafter {drafter.block_size}, this run {cfg.block_size} "
            f"(pass --block-size {drafter.block_size})"
        )
    if mask_token_id is not None and drafter.mask_token_id != mask_token_id:
        problems.append(f"mask_token_id: drafter {drafter.mask_token_id}, cache/run {mask_token_id}")
    if problems:
        raise ValueError(f"--init-from {pinned.init_from} does not fit cache {cfg.cache}: " + "; ".join(problems))
    return drafter


def _projected(drafter: DrafterConfig, cache_cfg: CacheConfig, cache: str) -> DrafterConfig:
    """A projected cache's drafter reads its R codes (fc' of R inputs; the export folds it back)."""
    projection = cache_cfg.projection
    if projection is None:
        return drafter
    if projection.checksum is None:
        raise ValueError(
            f"cache {cache}: its projection was never estimated (cache.json projection.checksum is null); finish the "
            "cache with its dflash-extract command (`dflash-shards verify` prints it)"
        )
    load_projection(cache, cache_cfg)  # a replaced or damaged projection.safetensors is refused before any model
    return drafter.replace(context_width=projection.rank, context_projection=projection.checksum)


def _check_shards_present(cfg: TrainConfig, batch_ids: list[int]) -> None:
    """Every planned shard's file is there (a stat each, before any model or buffer): an unfinished or
    damaged cache is refused now, not at the first step that reads a missing shard."""
    missing = [b for b in batch_ids if not shard_path(cfg.cache, b).is_file()]
    if missing and not cfg.skip_bad_shards:
        raise ValueError(
            f"cache {cfg.cache}: {len(missing)} of its {len(batch_ids)} planned shards are missing (e.g. "
            f"{shard_path(cfg.cache, missing[0])}); finish the cache (re-run its dflash-extract command: "
            "`dflash-shards verify` prints it), or pass --skip-bad-shards to train on the rest"
        )


def _check_a_shard_header(cfg: TrainConfig, batch_ids: list[int]) -> None:
    """A present shard's header agrees with cache.json (cache id, tensor shapes and dtypes): the loader's
    buffers are sized from cache.json, so one edited past its shards (token_budget 10**10: 3.8 TB asked)
    is refused now, not by an allocation. With --skip-bad-shards the first shard whose header agrees
    will do."""
    reader = ShardReader(cfg.cache)
    first_error = None
    for batch_id in (b for b in batch_ids if shard_path(cfg.cache, b).is_file()):
        try:
            reader.info(batch_id)
            return
        except ShardError as e:
            first_error = first_error or e
            if not cfg.skip_bad_shards:
                break
    if first_error is not None:
        raise ValueError(
            f"cache {cfg.cache}: {first_error}; if cache.json was edited, restore it, else check the cache "
            "(`dflash-shards verify`)"
        ) from first_error


def _check_taps(cfg: TrainConfig, cache_cfg: CacheConfig) -> None:
    taps = cfg.drafter.tap_layer_ids
    if taps is not None and list(taps) != list(cache_cfg.tap_layer_ids):
        raise ValueError(
            f"--taps {shown(taps)}: the run expects layers {taps}, cache "
            f"{cfg.cache} holds {cache_cfg.tap_layer_ids}; re-extract with these --taps or drop --taps"
        )


def _check_target_head(cache_dir: str, cache_cfg: CacheConfig) -> None:
    """The stored target head must have the [vocab, hidden] shapes cache.json declares (header only)."""
    path = Path(cache_dir) / TARGET_HEAD_FILE
    if not path.is_file():
        raise ValueError(f"{path}: not found; the cache has no target head (re-run dflash-extract)")
    entries = read_header(path).entries
    vocab, hidden = cache_cfg.target.vocab_size, cache_cfg.target.hidden_size
    for name, shape in target_head_shapes(cache_cfg.target).items():
        if name not in entries:
            raise ValueError(f"{path}: tensor {name} missing; expected shape {shape}")
        if tuple(entries[name].shape) != shape:
            raise ValueError(
                f"{path}: tensor {name} has shape {tuple(entries[name].shape)}, but cache.json "
                f"declares target vocab {vocab} x hidden {hidden}, i.e. {shape}"
            )
