"""A projected cache's projection: codes z = A h with A = P D, stored in projection.safetensors.

h [F = K*H]: one token's taps concatenated in tap order (h[k*H + c] = tap k, channel c).
D [F]: a fixed positive scaling folded in before the projection: ones ("none"), or 1 / rms of each tap over
  the sample ("per-tap"), so that the deep taps' massive-activation channels do not take the leading
  components. A per-token normalisation is no fixed linear map and could not be folded: never.
P [R, F]: orthonormal rows, the top-R eigenvectors of the sample's second moment of D h, NOT centred: the
  drafter's fc has no bias, so fc'(A h) = (fc' A) h exactly, while a centred code A (h - mean) would need
  a bias no exported drafter has.
A = P D [R, F] (P's columns scaled): what the extractor applies and what export folds, fc = fc' A
  (fold_fc). A published fc W0 [H, F] starts training as fc' = W0 D^-1 P^T (unfold_fc): then
  fc' A h = W0 D^-1 P^T P D h, which is W0 h when D h lies in P's row space.

projection.safetensors holds "projection" P and "scale" D, fp32, and its checksum in the header; cache.json
records the same checksum (ProjectionRecord.checksum), which every shard's cache_id covers: a tampered
file is refused by load_projection (as is a link in its place: never followed), a swapped pair of file and
cache.json by the shards.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shards.common.durable import atomic_write
from shards.common.owned import Dir
from shards.container import write_container
from shards.format import FORMAT_VERSION, PROJECTION_FILE, CacheConfig, CacheFormatError, checksum
from shards.reader import read_checked_tensors

PROJECTION_TENSORS = ("projection", "scale")


def write_projection(cache_dir: str | Path, projection_RF: torch.Tensor, scale_F: torch.Tensor) -> str:
    """Durably write projection.safetensors (P and D as fp32); returns its checksum for cache.json."""
    tensors = {
        "projection": projection_RF.detach().to("cpu", torch.float32).contiguous(),
        "scale": scale_F.detach().to("cpu", torch.float32).contiguous(),
    }
    found = checksum(tensors)
    meta = {"format_version": str(FORMAT_VERSION), "checksum": found}
    atomic_write(Path(cache_dir) / PROJECTION_FILE, lambda f: write_container(f, tensors, meta))
    return found


def load_projection(cache_dir: str | Path, cfg: CacheConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """P [R, F] and D [F] of a projected cache, fp32, checked against cache.json: shapes, the file's own
    checksum, and the checksum cache.json records (the cache's identity)."""
    path = Path(cache_dir) / PROJECTION_FILE
    record = cfg.projection
    if record is None:
        raise ValueError(f"{cache_dir}: not a projected cache (cache.json has no projection)")
    with Dir.open(cache_dir) as d:
        # A link there is refused, never followed; one swapped in after this look is caught by the checksums below.
        d.refuse_other_than_file(PROJECTION_FILE)
        present = d.lstat(PROJECTION_FILE) is not None
    if not present:
        raise CacheFormatError(f"{path}: not found; the projected cache lacks its projection: re-run dflash-extract")
    tensors, found = read_checked_tensors(path, PROJECTION_TENSORS)
    width = cfg.num_taps * cfg.target.hidden_size
    shapes = {"projection": (record.rank, width), "scale": (width,)}
    for name, want in shapes.items():
        t = tensors[name]
        if tuple(t.shape) != want or t.dtype != torch.float32:
            raise CacheFormatError(f"{path}: tensor {name} is {tuple(t.shape)} {t.dtype}, expected {want} fp32")
    if found != record.checksum:
        raise CacheFormatError(
            f"{path}: holds another projection (checksum {found}, cache.json records {record.checksum}); the "
            "cache's codes were made with the recorded one: restore the original file or re-extract the cache"
        )
    return tensors["projection"], tensors["scale"]


def applied_matrix(projection_RF: torch.Tensor, scale_F: torch.Tensor) -> torch.Tensor:
    """A = P D [R, F]: taps to codes."""
    return projection_RF * scale_F


def codes_of(hidden_TKH: torch.Tensor, applied_RF: torch.Tensor) -> torch.Tensor:
    """codes [T, R] = A concat_k(h_k), computed in hidden's dtype: the one GEMM a projected cache adds."""
    return hidden_TKH.flatten(1) @ applied_RF.to(hidden_TKH.dtype).T


def fold_fc(fc_HR: torch.Tensor, applied_RF: torch.Tensor) -> torch.Tensor:
    """The standard fc [H, F] = fc' A, multiplied in float32 (float64 stays float64) and left in that
    dtype: the caller casts once, after the product."""
    dtype = torch.promote_types(fc_HR.dtype, torch.float32)
    return fc_HR.to(dtype) @ applied_RF.to(dtype)


def unfold_fc(fc_HF: torch.Tensor, projection_RF: torch.Tensor, scale_F: torch.Tensor) -> torch.Tensor:
    """fc' [H, R] = W0 D^-1 P^T of a full-width fc W0 [H, F]: where training from a published drafter starts."""
    dtype = torch.promote_types(fc_HF.dtype, torch.float32)
    return (fc_HF.to(dtype) / scale_F.to(dtype)) @ projection_RF.to(dtype).T
