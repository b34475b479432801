"""The target's HF checkpoint directory: where each of our parameters is stored and under which name,
and a check, from the safetensors headers alone, that every tensor the model reads is there with the
shape config.json implies (reading the tensors: extract/target/weights.py).

Layouts: config.json plus model.safetensors, or sharded *.safetensors with
model.safetensors.index.json. Names: the multimodal release (`Qwen3_5ForConditionalGeneration`)
keeps the text decoder under `model.language_model.`, a text-only export under `model.`;
`lm_head.weight` sits at the top in both and is absent when the embeddings are tied.
`model.visual.*` (the ViT) and `mtp.*` (the multi-token-prediction head) are never read.
Fine-grained FP8 checkpoints (extract/target/fp8/quantization.py) store e4m3 weights beside their
block scales (`<name>_scale_inv`); other quantizations are refused with their method's name.
"""

from __future__ import annotations

import re
from pathlib import Path

from safetensors import SafetensorError, safe_open

from extract.target.config import TargetConfig
from extract.target.fp8.quantization import (
    checkpoint_quantization,
    scale_name,
)
from shards.common.errors import UserError
from shards.common.json_input import read_json_object
from shards.common.schema import typed

# HF name of a parameter = prefix + our (text-model) name; lm_head.weight has no prefix.
NAMING_PREFIXES = {"multimodal": "model.language_model.", "text": "model."}
IGNORED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class MissingTensorError(UserError, KeyError, ValueError):
    """A tensor config.json implies is absent from the checkpoint (a ValueError for the CLIs' one-line
    messages; a KeyError for callers that look names up)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def open_safetensors(path: str | Path, **kw):
    """safe_open naming the file when it is not a readable safetensors file (truncated, not safetensors)."""
    try:
        return safe_open(str(path), framework="pt", **kw)
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"{path}: not a readable safetensors file ({e}); re-download or re-convert the checkpoint"
        ) from e


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
        weight_map = read_json_object(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: no 'weight_map' object")
        weight_map = typed(dict[str, str], weight_map, str(index_path), "weight_map")
        missing = sorted({name for name in weight_map.values() if not (ckpt_dir / name).is_file()})
        if missing:
            raise FileNotFoundError(f"{index_path} names shard files that do not exist: {missing[:4]}")
        return {name: ckpt_dir / file for name, file in weight_map.items()}
    files = [ckpt_dir / SINGLE_FILE] if (ckpt_dir / SINGLE_FILE).is_file() else sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt_dir}: no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors")
    locations: dict[str, Path] = {}
    for path in files:
        with open_safetensors(path) as f:
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


def source_name(local_name: str, naming: str, locations: dict[str, Path], tied: bool, ckpt_dir: Path) -> str:
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
    num_layers = TargetConfig.from_dir(ckpt_dir).num_hidden_layers
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
                with open_safetensors(path) as f:
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
            source = source_name(local, naming, locations, tied, ckpt_dir)
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
