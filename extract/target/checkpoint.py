"""Read the target's weights from an HF checkpoint directory, one tensor at a time.

Layouts: config.json plus model.safetensors, or sharded *.safetensors with
model.safetensors.index.json. Names: the multimodal release (`Qwen3_5ForConditionalGeneration`)
keeps the text decoder under `model.language_model.`, a text-only export under `model.`;
`lm_head.weight` sits at the top in both and is absent when the embeddings are tied.
`model.visual.*` (the ViT) and `mtp.*` (the multi-token-prediction head) are never read.

Loading never holds the model twice in host memory: the model is built on the meta device and
each tensor goes file -> host -> device before the next is read. A_log and dt_bias stay fp32:
they feed exp() and softplus() of the decay.

Fine-grained FP8 checkpoints (extract/target/fp8/quantization.py) are dequantised while streaming: the e4m3
tensor and its block scales go to the device, are multiplied there and cast to the compute dtype,
so host memory and the host-to-device copy carry one byte per weight. Under --compute fp8 the
weights of the FP8 linear layers are kept as stored instead (`keep_fp8`): the e4m3 tensor and its
fp32 block scales go to the device unchanged, for block-scaled FP8 matmuls (extract/target/fp8/linear.py).
Other quantizations are refused with their method's name.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from extract.target.fp8.quantization import (
    FP8_DTYPE,
    Fp8BlockFormat,
    checkpoint_quantization,
    dequantize_fp8_blocks,
    scale_name,
)
from shards.format import FP8_E4M3_MAX

logger = logging.getLogger(__name__)

# HF name of a parameter = prefix + our (text-model) name; lm_head.weight has no prefix.
NAMING_PREFIXES = {"multimodal": "model.language_model.", "text": "model."}
IGNORED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")
FP32_PARAM_SUFFIXES = (".A_log", ".dt_bias")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class MissingTensorError(KeyError, ValueError):
    """A tensor config.json implies is absent from the checkpoint (a ValueError for the CLIs' one-line
    messages; a KeyError for callers that look names up)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _open(path: str | Path, **kw):
    """safe_open naming the file when it is not a readable safetensors file (truncated, not safetensors)."""
    try:
        return safe_open(str(path), framework="pt", **kw)
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"{path}: not a readable safetensors file ({e}); re-download or re-convert the checkpoint"
        ) from e


def storage_dtype(local_name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter is kept in: fp32 for the decay parameters, `dtype` otherwise."""
    return torch.float32 if local_name.endswith(FP32_PARAM_SUFFIXES) else dtype


def hf_name(local_name: str, naming: str) -> str:
    """The checkpoint name of one of our parameters under `naming` ("multimodal" or "text")."""
    if naming not in NAMING_PREFIXES:
        raise ValueError(f"naming={naming!r}, expected one of {sorted(NAMING_PREFIXES)}")
    if local_name == "lm_head.weight":
        return local_name
    return NAMING_PREFIXES[naming] + local_name


def tensor_locations(ckpt_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it (from the index, else from file headers)."""
    ckpt_dir = Path(ckpt_dir)
    index_path = ckpt_dir / INDEX_FILE
    if index_path.is_file():
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except json.JSONDecodeError as e:
            raise ValueError(f"{index_path}: not valid JSON ({e})") from e
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: no 'weight_map' object")
        missing = sorted({name for name in weight_map.values() if not (ckpt_dir / name).is_file()})
        if missing:
            raise FileNotFoundError(f"{index_path} names shard files that do not exist: {missing[:4]}")
        return {name: ckpt_dir / file for name, file in weight_map.items()}
    files = [ckpt_dir / SINGLE_FILE] if (ckpt_dir / SINGLE_FILE).is_file() else sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt_dir}: no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors")
    locations: dict[str, Path] = {}
    for path in files:
        with _open(path) as f:
            for name in f.keys():
                locations[name] = path
    return locations


def detect_naming(names) -> str:
    names = list(names)
    if any(n.startswith(NAMING_PREFIXES["multimodal"]) for n in names):
        return "multimodal"
    if any(n.startswith(NAMING_PREFIXES["text"]) for n in names):
        return "text"
    raise ValueError(
        f"checkpoint names carry neither {NAMING_PREFIXES['multimodal']!r} nor {NAMING_PREFIXES['text']!r} "
        f"(first names: {sorted(names)[:4]})"
    )


def _source_name(local_name: str, naming: str, locations: dict[str, Path], tied: bool, ckpt_dir: Path) -> str:
    name = hf_name(local_name, naming)
    if local_name == "lm_head.weight" and (tied or name not in locations):
        if not tied:
            raise MissingTensorError(
                f"{ckpt_dir}: lm_head.weight is missing and config.json says tie_word_embeddings=false"
            )
        name = hf_name("embed_tokens.weight", naming)
    if name not in locations:
        raise MissingTensorError(
            f"{ckpt_dir}: tensor {name!r} (for {local_name}) is not in the checkpoint; "
            "is the checkpoint complete and does config.json describe it?"
        )
    return name


MAX_REPORTED_TENSORS = 20  # bad tensors listed in one error; the rest are counted
SCALE_DTYPES = ("F32", "BF16", "F16")  # weight_scale_inv as the releases store it (float32) or narrower


_LAYER = re.compile(r"layers\.(\d+)\.")


def _undescribed_tensors(
    ckpt_dir: Path, locations: dict[str, Path], naming: str, expected: dict[str, tuple[int, ...]], tied: bool
) -> list[str]:
    """Tensors config.json does not describe: layers past its num_hidden_layers, and, in the layers the
    model runs, names it has no parameter for (a bias it would silently leave out). Layers not built
    (past the last tap) are not read, so not judged; nor are top-level names (a head not built)."""
    config = json.loads((ckpt_dir / "config.json").read_text())
    num_layers = (config.get("text_config") or config).get("num_hidden_layers")
    built = {int(m.group(1)) for n in expected if (m := _LAYER.match(n))}
    sources = {hf_name(n, naming) for n in expected}
    known = sources | {scale_name(n) for n in sources} | ({"lm_head.weight"} if tied else set())
    prefix = NAMING_PREFIXES[naming]
    beyond, unknown = [], []
    for name in sorted(locations):
        if name in known or name.startswith(IGNORED_PREFIXES):
            continue
        m = _LAYER.match(name[len(prefix) :]) if name.startswith(prefix) else None
        if m and num_layers is not None and int(m.group(1)) >= num_layers:
            beyond.append(name)
        elif m and int(m.group(1)) in built:
            unknown.append(name)
    problems = []
    if beyond:
        problems.append(
            f"{ckpt_dir}: {len(beyond)} tensor(s) of layers past config.json's num_hidden_layers {num_layers} "
            f"(e.g. {beyond[0]}): config.json is not this checkpoint's"
        )
    if unknown:
        problems.append(
            f"{ckpt_dir}: {len(unknown)} tensor(s) the Qwen3.5 model has no parameter for ({', '.join(unknown[:3])}): "
            "they would be left out of the forward"
        )
    return problems


def check_tensors(ckpt_dir: str | Path, expected: dict[str, tuple[int, ...]], tied: bool) -> None:
    """Every tensor of `expected` (our name -> the shape config.json implies) is in the checkpoint with
    that shape (and, when stored as FP8, its block scales with theirs). Reads the index and the
    safetensors headers only, no tensor data, so a damaged checkpoint is refused in seconds, before any
    work. Raises one ValueError naming every problem (file, tensor, expected and found shape; an
    unreadable header by its file), the first MAX_REPORTED_TENSORS listed and all counted."""
    ckpt_dir = Path(ckpt_dir)
    quant = checkpoint_quantization(ckpt_dir)
    locations = tensor_locations(ckpt_dir)
    naming = detect_naming(locations)
    headers: dict[Path, dict[str, tuple[tuple[int, ...], str]] | None] = {}  # file -> name -> (shape, dtype)
    problems: list[str] = []
    num_missing = 0  # a missing tensor makes the error a MissingTensorError (a KeyError) as well
    num_fp8 = 0  # weights stored as e4m3: an FP8 config over none of them is the wrong config

    def header(path: Path) -> dict[str, tuple[tuple[int, ...], str]] | None:
        if path not in headers:
            try:
                with _open(path) as f:
                    headers[path] = {
                        n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in f.keys()
                    }
            except ValueError as e:  # named once, however many tensors the file was to hold
                headers[path] = None
                problems.append(str(e))
        return headers[path]

    def check(source: str, want: tuple[int, ...], what: str) -> tuple[tuple[int, ...], str] | None:
        path = locations[source]
        held = header(path)
        if held is None:
            return None
        if source not in held:
            nonlocal num_missing
            num_missing += 1
            problems.append(f"{path}: tensor {source!r} is missing ({ckpt_dir / INDEX_FILE} names this file for it)")
            return None
        found = held[source]
        if found[0] != want:
            problems.append(f"{path}: {source} has shape {found[0]}, expected {want} {what}")
        return found

    for local, want in expected.items():
        try:
            source = _source_name(local, naming, locations, tied, ckpt_dir)
        except MissingTensorError:
            num_missing += 1
            untied = " (config.json says tie_word_embeddings=false)" if local == "lm_head.weight" else ""
            problems.append(
                f"{ckpt_dir}: {hf_name(local, naming)} is not in the checkpoint (expected shape {want}){untied}"
            )
            continue
        found = check(source, want, "from config.json")
        if found is not None and not found[1].startswith(("F8_", "BF16", "F16", "F32", "F64")):
            problems.append(
                f"{locations[source]}: {source} is stored as {found[1]}; weights are floats (BF16, F16, F32) "
                "or F8_E4M3 with block scales"
            )
        if found is not None and found[1].startswith("F8_") and found[1] != "F8_E4M3":
            problems.append(
                f"{locations[source]}: {source} is stored as {found[1]}; the FP8 loader reads e4m3 (F8_E4M3) "
                f"weights with block scales only"
            )
        if found is not None and found[1] == "F8_E4M3" and found[0] == want:
            num_fp8 += 1
            scale = scale_name(source)
            if quant is None:
                problems.append(f"{locations[source]}: {source} is FP8 but config.json has no quantization_config")
            elif scale not in locations:
                problems.append(f"{locations[source]}: {source} is FP8 but its block scales {scale!r} are missing")
            else:
                held = check(scale, quant.scale_shape(want), f"for {source} {want} in {quant.describe()}")
                if held is not None and held[1] not in SCALE_DTYPES:
                    problems.append(
                        f"{locations[scale]}: {scale} is stored as {held[1]}; block scales are floats "
                        f"({', '.join(SCALE_DTYPES)})"
                    )
    problems += _undescribed_tensors(ckpt_dir, locations, naming, expected, tied)
    if quant is not None and not num_fp8 and not problems:
        problems.append(
            f"{ckpt_dir / 'config.json'}: quantization_config says {quant.describe()}, but no weight is stored "
            f"as float8_e4m3fn: remove quantization_config if this is the bf16 release"
        )
    if problems:
        shown = problems[:MAX_REPORTED_TENSORS]
        more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise (MissingTensorError if num_missing else ValueError)(
            f"{ckpt_dir}: {len(problems)} bad or missing tensor(s) for the model config.json describes"
            + (f" (the first {len(shown)})" if more else "")
            + ":\n  "
            + "\n  ".join(shown)
            + more
            + "\nis the checkpoint complete (re-download it) and does its config.json describe it?"
        )


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
        source = _source_name(local, naming, locations, tied, ckpt_dir)
        by_file[locations[source]].append((local, source))

    loaded: dict[str, torch.Tensor] = {}
    kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    read_cache: dict[str, torch.Tensor] = {}  # only tied embeddings are read twice
    dequantised = 0
    for path, pairs in by_file.items():
        with _open(path, device="cpu") as f:
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
        with _open(locations[scale], device="cpu") as g:
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
        source = _source_name(local, naming, locations, cfg.tie_word_embeddings, ckpt_dir)
        with _open(locations[source], device="cpu") as f:
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
