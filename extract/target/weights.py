"""Stream the target's weights from an HF checkpoint directory onto the device, one tensor at a time
(the checkpoint's layout, names and the header check before any read: extract/target/checkpoint.py).

Loading never holds the model twice in host memory: the model is built on the meta device and
each tensor goes file -> host -> device before the next is read. A_log and dt_bias stay fp32:
they feed exp() and softplus() of the decay.

Fine-grained FP8 checkpoints (extract/target/fp8/quantization.py) are dequantised while streaming: the e4m3
tensor and its block scales go to the device, are multiplied there and cast to the compute dtype,
so host memory and the host-to-device copy carry one byte per weight. Under --compute fp8 the
weights of the FP8 linear layers are kept as stored instead (`keep_fp8`): the e4m3 tensor and its
fp32 block scales go to the device unchanged, for block-scaled FP8 matmuls (extract/target/fp8/linear.py).
Block scales a quantiser never writes (negative, non-finite, zero over non-zero codes, huge) are refused.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path

import torch
from torch import nn

from extract.target.checkpoint import (
    IGNORED_PREFIXES,
    check_tensors,
    detect_naming,
    open_safetensors,
    source_name,
    tensor_locations,
)
from extract.target.fp8.quantization import (
    FP8_DTYPE,
    Fp8BlockFormat,
    checkpoint_quantization,
    dequantize_fp8_blocks,
    scale_name,
)
from shards.format import FP8_E4M3_MAX

logger = logging.getLogger(__name__)

FP32_PARAM_SUFFIXES = (".A_log", ".dt_bias")


def storage_dtype(local_name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter is kept in: fp32 for the decay parameters, `dtype` otherwise."""
    return torch.float32 if local_name.endswith(FP32_PARAM_SUFFIXES) else dtype


def load_weights_into(
    model: nn.Module,
    ckpt_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    keep_fp8: Collection[str] = (),
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Stream every parameter of `model` (built on meta, HF text-model names) from `ckpt_dir`.

    keep_fp8: our names of weights to keep as stored where the checkpoint holds them in e4m3. Those
    are returned, {name: (e4m3 [N, K], fp32 weight_scale_inv [n, k])} on `device`, bit for bit the
    file's tensors, and left out of the model (their parameters stay on meta for the caller to
    replace); every other tensor is loaded as always (FP8 ones dequantised to `dtype`)."""
    ckpt_dir = Path(ckpt_dir)
    quant = checkpoint_quantization(ckpt_dir)
    locations = tensor_locations(ckpt_dir)
    naming = detect_naming(locations)
    tied = bool(model.config.tie_word_embeddings)
    wanted = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    check_tensors(ckpt_dir, {name: tuple(p.shape) for name, p in wanted.items()}, tied)
    by_file: dict[Path, list[tuple[str, str]]] = defaultdict(list)
    for local in wanted:
        source = source_name(local, naming, locations, tied, ckpt_dir)
        by_file[locations[source]].append((local, source))

    loaded: dict[str, torch.Tensor] = {}
    kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    read_cache: dict[str, torch.Tensor] = {}  # only tied embeddings are read twice
    dequantised = 0
    for path, pairs in by_file.items():
        with open_safetensors(path, device="cpu") as f:
            for local, source in pairs:
                if source in read_cache:
                    loaded[local] = read_cache[source]
                    continue
                if local in keep_fp8 and f.get_slice(source).get_dtype() == "F8_E4M3":
                    w8, scale_inv = read_fp8_pair(f, path, source, locations, quant)
                    # the scales are fp32 in the releases (.float() is then no copy; exact for bf16 ones)
                    kept[local] = (w8.to(device), scale_inv.to(device).float())
                    continue
                tensor, was_fp8 = read_tensor(f, path, source, locations, quant, device, storage_dtype(local, dtype))
                dequantised += was_fp8
                loaded[local] = tensor
                if source.endswith("embed_tokens.weight") and tied:
                    read_cache[source] = tensor
    result = model.load_state_dict(loaded, strict=False, assign=True)
    assert not result.unexpected_keys and sorted(result.missing_keys) == sorted(kept), result
    model.requires_grad_(False)
    skipped = sum(1 for n in locations if n.startswith(IGNORED_PREFIXES))
    logger.info(
        "loaded %d tensors from %s (%s naming, %d files; %d vision/MTP tensors ignored; dtype %s)",
        len(loaded),
        ckpt_dir,
        naming,
        len(by_file),
        skipped,
        dtype,
    )
    if quant is not None:
        logger.info(
            "kernel weights: %s checkpoint; %d tensors dequantised to %s while streaming, %d stored unquantised%s",
            quant.describe(),
            dequantised,
            dtype,
            len(loaded) - dequantised,
            f", {len(kept)} linear weights kept as stored (e4m3 with their block scales)" if kept else "",
        )
    return kept


def read_tensor(
    f,
    path: Path,
    source: str,
    locations: dict[str, Path],
    quant: Fp8BlockFormat | None,
    device: torch.device | str,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, bool]:
    """(tensor on `device` in `dtype`, whether it was FP8): an e4m3 tensor is multiplied by its
    block scales (`name`_scale_inv, from whichever file holds it) on the device first."""
    if f.get_slice(source).get_dtype() != "F8_E4M3":
        return f.get_tensor(source).to(device=device, dtype=dtype), False
    w8, scale_inv = read_fp8_pair(f, path, source, locations, quant)
    return dequantize_fp8_blocks(w8.to(device), scale_inv.to(device), quant, dtype), True


def read_fp8_pair(
    f, path: Path, source: str, locations: dict[str, Path], quant: Fp8BlockFormat | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], weight_scale_inv [n, k]) of the FP8 tensor `source` as stored, on the host (the
    scales from whichever file holds them), after checking the pair against config.json's format."""
    if quant is None:
        raise ValueError(
            f"{path}: {source} is stored as float8_e4m3fn but config.json has no quantization_config; "
            f"the checkpoint is incomplete (restore its config.json from the release)"
        )
    scale = scale_name(source)
    if scale not in locations:
        raise ValueError(f"{path}: {source} is FP8 but its block scales {scale!r} are not in the checkpoint")
    w8 = f.get_tensor(source)
    if locations[scale] == path:
        scale_inv = f.get_tensor(scale)
    else:
        with open_safetensors(locations[scale], device="cpu") as g:
            scale_inv = g.get_tensor(scale)
    if w8.ndim != 2 or w8.dtype != FP8_DTYPE:
        raise ValueError(f"{path}: {source} is {w8.dtype} {tuple(w8.shape)}; FP8 weights must be 2-D {FP8_DTYPE}")
    want = quant.scale_shape(tuple(w8.shape))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"{locations[scale]}: {scale} has shape {tuple(scale_inv.shape)}, expected {want} for "
            f"{source} {tuple(w8.shape)} in {quant.describe()}"
        )
    bad_scales = ~torch.isfinite(scale_inv.float()) | (scale_inv.float() < 0)
    if bad_scales.any():
        raise ValueError(
            f"{locations[scale]}: {scale} holds {int(bad_scales.sum())} negative or non-finite block scale(s) "
            f"(first {scale_inv.flatten()[bad_scales.flatten()][0].item()!r}); weight_scale_inv is amax / 448 >= 0: "
            f"the checkpoint is damaged (re-download it)"
        )
    if ((w8.view(torch.uint8) & 0x7F) == 0x7F).any():  # e4m3fn's NaN codes (it has no infinity)
        raise ValueError(f"{path}: {source} holds NaN e4m3 codes: the checkpoint is damaged (re-download it)")
    _check_scale_values(w8, scale_inv, quant, f"{locations[scale]}: {scale}")
    return w8, scale_inv


# Largest |weight| a block scale may give (448 x scale): trained LLM linear weights stay below ~100, so
# a block reaching this was not written by a quantiser (a flipped exponent, a scale stored as its inverse).
MAX_DEQUANTISED_WEIGHT = 1e4


def _check_scale_values(w8: torch.Tensor, scale_inv: torch.Tensor, quant, what: str) -> None:
    """Refuse block scales a quantiser never writes: 0 over non-zero codes (the block's weights would
    read as 0), or so large that the weights dequantise above MAX_DEQUANTISED_WEIGHT."""
    s = scale_inv.float()
    if not (s == 0).any() and not FP8_E4M3_MAX * float(s.max()) > MAX_DEQUANTISED_WEIGHT:
        return  # the usual case, decided from the scales alone
    amax = _block_code_amax(w8, quant)  # [n, k] largest |code| per block
    dead = (s == 0) & (amax > 0)
    if dead.any():
        raise ValueError(
            f"{what} holds {int(dead.sum())} zero block scale(s) over non-zero e4m3 codes (a quantiser writes "
            "amax / 448 > 0 there): the checkpoint is damaged (re-download it)"
        )
    peak = float((amax * s).max())
    if peak > MAX_DEQUANTISED_WEIGHT:
        raise ValueError(
            f"{what} dequantises weights to |w| = {peak:.3g}, above {MAX_DEQUANTISED_WEIGHT:.0e} (trained weights stay "
            "below ~100): the block scales are damaged (re-download the checkpoint)"
        )


def _block_code_amax(w8: torch.Tensor, quant) -> torch.Tensor:
    n, k = w8.shape
    bn, bk = quant.block_n, quant.block_k
    codes = torch.nn.functional.pad(w8.float().abs(), (0, -k % bk, 0, -n % bn))
    return codes.view(codes.shape[0] // bn, bn, codes.shape[1] // bk, bk).amax(dim=(1, 3))


def load_target_head(ckpt_dir: str | Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """{"embed_tokens": [V, H], "lm_head": [V, H], "norm": [H]} in their stored dtype (bf16 when FP8).

    With tied embeddings lm_head is a copy of embed_tokens (a separate tensor, so the pair can be
    written to one safetensors file). `norm` is the zero-centred final norm's raw weight w (the
    model applies 1 + w).
    """
    from extract.target.config import TargetConfig

    ckpt_dir = Path(ckpt_dir)
    cfg = TargetConfig.from_dir(ckpt_dir)
    quant = checkpoint_quantization(ckpt_dir)
    locations = tensor_locations(ckpt_dir)
    naming = detect_naming(locations)
    out: dict[str, torch.Tensor] = {}
    for key, local in (("embed_tokens", "embed_tokens.weight"), ("lm_head", "lm_head.weight"), ("norm", "norm.weight")):
        source = source_name(local, naming, locations, cfg.tie_word_embeddings, ckpt_dir)
        with open_safetensors(locations[source], device="cpu") as f:
            # An FP8 head (rare: releases keep it unquantised) is dequantised to bf16.
            if f.get_slice(source).get_dtype() == "F8_E4M3":
                tensor = read_tensor(f, locations[source], source, locations, quant, device, torch.bfloat16)[0]
            else:
                tensor = f.get_tensor(source).to(device)
        out[key] = tensor
    if out["lm_head"].data_ptr() == out["embed_tokens"].data_ptr() or cfg.tie_word_embeddings:
        out["lm_head"] = out["embed_tokens"].clone()
    expected = {
        "embed_tokens": (cfg.vocab_size, cfg.hidden_size),
        "lm_head": (cfg.vocab_size, cfg.hidden_size),
        "norm": (cfg.hidden_size,),
    }
    for key, shape in expected.items():
        if tuple(out[key].shape) != shape:
            raise ValueError(f"{ckpt_dir}: {key} has shape {tuple(out[key].shape)}, expected {shape}")
    return out
