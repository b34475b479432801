"""The projection of a projected cache (--pca-rank R): estimated once, before its first shard, from the
taps of a seeded sample of batches drawn across the whole dataset; shards/projection.py says what P and
D are and why the moment is not centred.

Estimate: M = sum_t h_t h_t^T over the sampled tokens (F x F, F = K*H, accumulated in fp32 on the device),
D from M's diagonal (per-tap: 1 / rms of each tap; none: ones), then the top R eigenvectors of D M D
(float64 eigendecomposition) as P's rows, each signed so that its largest entry is positive (the same
sample gives the same file). variance_kept = the R largest eigenvalues / the trace.

Cost at 27B width (5 taps x 5120, F = 25600) with the default 262,144 sample tokens: the target's forward
over the sample (what extracting those tokens costs, ~13 s at 20K tokens/s on one H200); the moment,
2 N F^2 = 3.4e14 flops in fp32 (a few seconds) in a 2.6 GB matrix; and one float64 eigendecomposition of
25600 x 25600 (5.2 GB; of the order of a minute or two on an H200: measured by the lead, BENCHMARKS.md).
The sampled batches are extracted again in the main pass (their share of the dataset's tokens).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import torch

from extract.dataset.packing import PackedBatch
from shards.format import CacheConfig

log = logging.getLogger(__name__)


def sample_batches(batches: list[PackedBatch], sample_tokens: int, seed: int) -> list[PackedBatch]:
    """Whole batches in a seeded random order across the plan until they hold `sample_tokens` real tokens
    (all of them when the dataset is smaller), returned in plan order."""
    order = list(range(len(batches)))
    random.Random(seed).shuffle(order)
    chosen, tokens = [], 0
    for i in order:
        if tokens >= sample_tokens:
            break
        chosen.append(i)
        tokens += batches[i].num_tokens
    return [batches[i] for i in sorted(chosen)]


class SecondMoment:
    """sum_t h_t h_t^T [F, F] of the concatenated taps of every token added, and how many were."""

    def __init__(self, width: int, device: torch.device):
        self.moment_FF = torch.zeros(width, width, dtype=torch.float32, device=device)
        self.num_tokens = 0

    def add(self, hidden_nKH: torch.Tensor) -> None:
        x_nF = hidden_nKH.flatten(1).float()
        self.moment_FF.addmm_(x_nF.T, x_nF)
        self.num_tokens += x_nF.shape[0]


def principal_projection(
    moment: SecondMoment, num_taps: int, rank: int, normalize: str
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """P [R, F] (orthonormal rows, fp32), D [F] (fp32) and the share of the scaled energy P keeps."""
    M_FF = moment.moment_FF.double() / max(moment.num_tokens, 1)
    width = M_FF.shape[0]
    if normalize == "per-tap":
        rms_K = M_FF.diagonal().view(num_taps, width // num_taps).mean(1).sqrt()
        scale_K = torch.where(rms_K > 0, 1.0 / rms_K, torch.ones_like(rms_K))
        scale_F = scale_K.repeat_interleave(width // num_taps)
    elif normalize == "none":
        scale_F = torch.ones(width, dtype=torch.float64, device=M_FF.device)
    else:
        raise ValueError(f"unknown projection normalize {normalize!r}")
    scaled_FF = scale_F[:, None] * M_FF * scale_F[None, :]
    eigenvalues_F, vectors_FF = torch.linalg.eigh(scaled_FF)  # ascending
    top_RF = vectors_FF[:, -rank:].flip(-1).T
    peak_R = top_RF.gather(1, top_RF.abs().argmax(1, keepdim=True))
    top_RF = top_RF * torch.sign(peak_R)
    energy = eigenvalues_F.clamp(min=0)
    kept = float(energy[-rank:].sum() / energy.sum()) if energy.sum() > 0 else 0.0
    return top_RF.float().contiguous(), scale_F.float(), kept


def estimate_projection(
    cache_cfg: CacheConfig,
    batches: list[PackedBatch],
    forward_taps: Callable[[PackedBatch], torch.Tensor],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """P, D and the variance kept for cache_cfg.projection, from the taps forward_taps(batch) [n, K, H] of a
    seeded sample of `batches` (the whole plan)."""
    record = cache_cfg.projection
    assert record is not None
    sample = sample_batches(batches, record.sample_tokens, record.seed)
    start = time.monotonic()
    moment = SecondMoment(cache_cfg.num_taps * cache_cfg.target.hidden_size, device)
    for batch in sample:
        moment.add(forward_taps(batch))
    sampled_s = time.monotonic() - start
    projection_RF, scale_F, kept = principal_projection(moment, cache_cfg.num_taps, record.rank, record.normalize)
    log.info(
        "projection: %d of %d dims, normalize %s, from %d tokens in %d batches (forward and moment %.1fs, "
        "eigendecomposition %.1fs): %.2f%% of the variance kept",
        record.rank,
        moment.moment_FF.shape[0],
        record.normalize,
        moment.num_tokens,
        len(sample),
        sampled_s,
        time.monotonic() - start - sampled_s,
        100 * kept,
    )
    return projection_RF, scale_F, kept
