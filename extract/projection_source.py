"""--pca-from CACHE: a projected cache's projection taken over by this run, so that a held-out cache's codes
are the ones a drafter trained on CACHE reads. It is trusted only where it fits this run:

  settings  the estimate's (rank, normalize, sample tokens, seed) come with the projection; one given here
            explicitly that differs is refused, naming both values (one left unset follows the source);
  target    the source's target must be this run's: the same architecture (cache.json target.config_hash),
            taps and width before any model loads, then the same weights (target_head_checksum, the
            checksum of the embeddings, LM head and final norm both caches stored) before the copy;
  files     the source's cache.json and projection.safetensors are read as regular files only (a link is
            refused, never followed), the projection checked against its own and cache.json's checksums.
"""

from __future__ import annotations

import dataclasses

import torch

from extract.config import ExtractConfig
from shards import CacheConfig, TargetInfo, read_cache_config
from shards.common.cli_options import flag_name, shown
from shards.common.errors import UserError
from shards.common.owned import Dir
from shards.format import CACHE_CONFIG_FILE, ProjectionRecord
from shards.projection import load_projection

# The options that set the estimate, and the field of cache.json's projection each one sets.
ESTIMATE_SETTINGS = {
    "pca_rank": "rank",
    "pca_normalize": "normalize",
    "pca_sample_tokens": "sample_tokens",
    "pca_seed": "seed",
}


class ProjectionSourceError(UserError, ValueError):
    """--pca-from names a cache whose projection does not fit this run."""


def source_record(cfg: ExtractConfig, target: TargetInfo, taps: list[int]) -> ProjectionRecord:
    """The projection record of --pca-from's cache for this run's cache.json (checksum and variance kept
    filled in by the copy), once its settings and target match this run's; --pca-group-size is this run's
    own (how the codes are stored, not how P was estimated)."""
    source = _read_source(cfg.pca_from)
    projection = source.projection
    if projection is None or projection.checksum is None:
        raise ProjectionSourceError(f"--pca-from {cfg.pca_from}: not a projected cache with its projection estimated")
    for option, field in ESTIMATE_SETTINGS.items():
        given, theirs = getattr(cfg, option), getattr(projection, field)
        unset = given is None or (option == "pca_rank" and given == 0)  # --pca-rank 0 means no projection
        if not unset and given != theirs:
            flag = flag_name(ExtractConfig, option)
            raise ProjectionSourceError(
                f"{flag} {shown(given)}: --pca-from {cfg.pca_from} has {field.replace('_', ' ')} {shown(theirs)}; "
                f"drop {flag} (the source's is taken) or give {shown(theirs)}"
            )
    if source.target.config_hash != target.config_hash:
        raise ProjectionSourceError(
            f"--pca-from {cfg.pca_from}: its target has config_hash {source.target.config_hash}, --target "
            f"{cfg.target} has {target.config_hash}; a projection fits only the target it was estimated on"
        )
    if (source.tap_layer_ids, source.target.hidden_size) != (list(taps), target.hidden_size):
        raise ProjectionSourceError(
            f"--pca-from {cfg.pca_from}: projects taps {source.tap_layer_ids} of width {source.target.hidden_size}, "
            f"this cache stores taps {list(taps)} of width {target.hidden_size}"
        )
    return dataclasses.replace(projection, group_size=cfg.pca_group_size, checksum=None, variance_kept=None)


def check_source_weights(cfg: ExtractConfig, head_checksum: str) -> CacheConfig:
    """--pca-from's cache.json, once its target's weights are this run's (the head checksum both caches
    record; the config hash only names the architecture). Checked before this cache is created, and
    again when the projection is copied."""
    source = _read_source(cfg.pca_from)
    if source.target_head_checksum != head_checksum:
        raise ProjectionSourceError(
            f"--pca-from {cfg.pca_from}: its target's weights differ (head checksum {source.target_head_checksum}, "
            f"--target {cfg.target}'s is {head_checksum}); a projection fits only the target it was estimated on"
        )
    return source


def copy_source_projection(cfg: ExtractConfig, cache_cfg: CacheConfig) -> tuple[torch.Tensor, torch.Tensor, float]:
    """P, D and the variance kept of --pca-from's cache (source_record checked its settings and target
    architecture), once its target's weights are this run's (the head checksum both caches recorded)."""
    source = check_source_weights(cfg, cache_cfg.target_head_checksum)
    projection_RF, scale_F = load_projection(cfg.pca_from, source)
    return projection_RF, scale_F, source.projection.variance_kept


def _read_source(cache_dir: str) -> CacheConfig:
    """The source's cache.json, refused when a link (or anything but a regular file) takes its place."""
    with Dir.open(cache_dir) as d:
        d.refuse_other_than_file(CACHE_CONFIG_FILE)
    return read_cache_config(cache_dir)
