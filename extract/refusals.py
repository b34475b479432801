"""Refusals of dflash-extract settings that can never give a usable cache, each raised before the work
it would waste: impossible token ids, top-k or taps for this target (before the dataset scan), a dataset
with nothing a drafter can learn from (after the scan, and again after packing), and shards that would
not fit the host memory or the free space under --out (before cache.json is written).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from extract.config import ExtractConfig
from extract.target.config import TargetConfig
from shards import CacheConfig
from shards.common.progress import format_bytes, plural
from shards.format import bytes_per_shard
from shards.ownership import survey_cache
from shards.reader import list_shards


def refuse_impossible_settings(cfg: ExtractConfig, target: TargetConfig, taps: list[int]) -> None:
    """Settings that can never give a usable cache, refused before the dataset scan and cache.json."""
    vocab, layers = target.vocab_size, target.num_hidden_layers
    for flag, value in (("--mask-token-id", cfg.mask_token_id), ("--pad-token-id", cfg.pad_token_id)):
        if value is not None and not 0 <= value < vocab:
            raise ValueError(
                f"{flag} {value} is outside the target's vocabulary [0, {vocab}) "
                f"({Path(cfg.target) / 'config.json'}); pass an id below {vocab}"
            )
    if cfg.target_topk > vocab:
        raise ValueError(
            f"--target-topk {cfg.target_topk} is more than the target's vocabulary of {vocab} tokens; "
            f"pass at most {vocab}"
        )
    if len(set(taps)) != len(taps):
        raise ValueError(
            f"--num-taps {cfg.num_taps} asks for more taps than the target's {layers} layers give "
            f"distinct ones (the default spread would store layers {_shorten(taps)}); pass --num-taps "
            f"{len(set(taps))} or list distinct layers with --taps"
        )
    width = len(taps) * target.hidden_size
    if cfg.pca_rank >= width:
        raise ValueError(
            f"--pca-rank {cfg.pca_rank} is not below the taps' width ({len(taps)} taps x {target.hidden_size} = "
            f"{width}): it would store more than the taps; pass a smaller --pca-rank (e.g. {width // 8}) or 0"
        )
    bad = [t for t in taps if not 0 <= t < layers]
    if bad:
        raise ValueError(f"--taps {bad}: the target has layers 0..{layers - 1} ({Path(cfg.target) / 'config.json'})")
    if layers - 1 in taps:
        # Serving engines capture tap j as the input of layer j + 1: the last layer has none, and the
        # drafter would fail only at serving time (vLLM on the feature size, SGLang with an index error).
        raise ValueError(
            f"--taps {','.join(map(str, taps))}: layer {layers - 1} is the target's last layer, which vLLM and "
            f"SGLang cannot tap (they capture tap j as the input of layer j + 1); tap layers up to {layers - 2}"
        )


def _shorten(values: list, shown: int = 8) -> str:
    return str(values) if len(values) <= shown else f"[{', '.join(map(str, values[:shown]))}, ... {len(values)} in all]"


def refuse_unsupervised(cfg: ExtractConfig, index) -> None:
    """A drafter learns from supervised tokens whose successor is supervised too (its anchors)."""
    report = index.report
    if report.num_loss_tokens == 0 or report.num_anchor_positions == 0:
        raise ValueError(
            f"{cfg.data}: no supervised tokens in {len(index)} samples that a drafter can learn from "
            f"({report.num_loss_tokens} tokens have loss_mask 1, none followed by another supervised token of "
            "the same sample); check the loss_mask column (1 = train on this token)"
        )


def refuse_unsupervised_after_packing(cfg: ExtractConfig, index) -> None:
    """--long-seqs may cut away every anchor position (a long prompt before each reply)."""
    report = index.report
    if report.num_packed_anchor_positions == 0:
        where = (
            f"past the first {cfg.token_budget} tokens of samples longer than that"
            if cfg.long_seqs == "truncate"
            else f"in samples longer than that, which --long-seqs {cfg.long_seqs} drops"
        )
        raise ValueError(
            f"{cfg.data}: at --token-budget {cfg.token_budget} packing keeps no supervised tokens a drafter can "
            f"learn from (all {report.num_anchor_positions} anchor positions lie {where}); raise --token-budget"
        )


def refuse_what_cannot_fit(cfg: ExtractConfig, cache_cfg: CacheConfig, plan) -> None:
    """Before any work: the writer's host buffers must fit this machine's memory, and the shards still
    to write must fit the free space under --out."""
    shard_bytes = bytes_per_shard(cache_cfg)
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's ranks on this machine
    buffers = ranks_here * cfg.writer_buffers
    if buffers * shard_bytes > host_bytes:
        raise ValueError(
            f"--token-budget {cfg.token_budget}: one shard is {format_bytes(shard_bytes)} and the writers keep "
            f"{plural(buffers, 'shard')} in host memory ({cfg.writer_buffers} per rank, {ranks_here} ranks here: "
            f"{format_bytes(buffers * shard_bytes)}), more than this machine's {format_bytes(host_bytes)}; "
            "lower --token-budget (or --writer-buffers)"
        )
    out = Path(cfg.out_dir)
    todo = len(plan.batches) - (len(list_shards(out)) if out.is_dir() and not cfg.overwrite else 0)
    where = out
    while not where.exists() and where.parent != where:
        where = where.parent
    free = shutil.disk_usage(where).free
    if cfg.overwrite and out.is_dir():  # the old cache's files go first: their space is free for the new one
        free += sum(e.st.st_size for e in survey_cache(out).ours)
    if todo * shard_bytes > free:
        raise ValueError(
            f"--out {out}: {plural(todo, 'shard')} of {format_bytes(shard_bytes)} still to write "
            f"({format_bytes(todo * shard_bytes)}), but {where} has {format_bytes(free)} free; free space, choose "
            "another --out, or lower the size (--storage fp8, fewer --num-taps)"
        )
