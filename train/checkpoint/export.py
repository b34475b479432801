"""Export a trained drafter in z-lab's DFlashDraftModel layout (what vLLM / SGLang load), and reload it.

OUT/config.json        architectures ["DFlashDraftModel"], model_type "qwen3", block_size,
                       num_target_layers, dflash_config {mask_token_id, target_layer_ids}, Qwen3 fields
OUT/model.safetensors  the drafter's parameters under z-lab's names, bf16

config.json leaves nothing to an engine's defaults (what each engine reads, from their newest loaders,
December 2026):
- RoPE: vLLM's DFlash layers read rope_parameters["rope_theta"] and, where it is absent, set 1e6
  (set_default_rope_theta in qwen3_dflash.py), not the 1e7 of the Qwen3.5 targets; its config loader
  first moves a top-level rope_theta there (patch_rope_parameters), so only a config with neither field
  falls back. SGLang's DFlash attention (get_rope_config) reads rope_parameters["rope_theta"] when
  rope_parameters exists, else rope_theta. Both are written, equal, so neither engine falls back.
- max_position_embeddings: the target's, from the cache (vLLM sizes the RoPE table by it; SGLang takes
  32768 when absent and runs the drafter at the target's context length).
- Layer kinds: layer_types per layer; sliding layers need sliding_window and use_sliding_window true
  (HF Qwen3Config drops sliding_window when use_sliding_window is false, and vLLM / SGLang then refuse
  the sliding layers). vLLM makes a layer causal iff it is sliding unless is_causal (top level, read
  first) or dflash_config.causal say otherwise: is_causal is written exactly when the drafter was read
  with one (published DFlash 2 configs: false, its sliding layers bidirectional in the window), and
  dflash_config.causal never.
- Taps: dflash_config.target_layer_ids in z-lab's "output of layer j" convention; vLLM and SGLang add 1
  for their "input of layer j+1" capture. eagle_aux_hidden_state_layer_ids is not written: vLLM would
  take it as-is in place of target_layer_ids + 1.
- fc input: vLLM sizes it target_hidden_size (else hidden_size) x taps; written, equal to hidden_size.
- block_size, num_target_layers, mask_token_id (SGLang reads them top-level or in dflash_config, its
  --speculative-num-draft-tokens overriding block_size with a warning; vLLM reads
  dflash_config.mask_token_id and never block_size: it drafts 1 + num_speculative_tokens from
  --speculative-config, so `dflash-train export` prints both commands: train/checkpoint/serving.py).
- The target's bos / eos / pad ids, as the published configs carry them.

load_exported_drafter reads ours and published directories (model.safetensors, or shards listed in
model.safetensors.index.json) and refuses fields whose meaning we do not train (dflash_config.causal,
use_swa, attention sinks, rope scaling), naming them.

Export is for serving and evaluation, never a resume source (checkpoints are the loop's business).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from shards.common.crc import crc32
from shards.common.diskfull import DiskFullError, refusing_when_full
from shards.common.durable import check_writable
from shards.common.json_input import read_json_object
from shards.common.owned import DIR_MODE, Dir, Entry, Layout, OwnershipError, survey
from shards.common.schema import REQUIRED, read_field
from shards.container import read_header, write_container
from shards.format import CacheFormatError
from shards.projection import fold_fc, unfold_fc
from train.checkpoint.serving import EXPORTED_TRAINING, TRAINING_KEY
from train.checkpoint.store import (
    MODEL_FILE,
    STATE_FILE,
    Checkpoint,
    CheckpointError,
    load_model_state,
    resolve_checkpoint,
)
from train.checkpoint.train_state import train_state
from train.checkpoint.weight_shapes import check_weight_shapes
from train.drafter.config import DFLASH1, DFLASH2, DrafterConfig
from train.drafter.model import DFlashDrafter

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"  # sharded checkpoints: {"weight_map": {name: file}}
# Fields whose presence would make an engine read the drafter differently from how it was trained here.
_FOREIGN_FIELDS = (
    "use_swa",
    "swa_window_size",
    "causal",
    "attention_sink_bias",
    "add_swa_attention_sink_bias",
    "draft_vocab_size",
)


def zlab_parameter_names(cfg: DrafterConfig) -> list[str]:
    """The parameter names of z-lab's DFlashDraftModel for this shape: the one name mapping we follow."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        names += [p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
        if cfg.is_dflash2:
            names += [p + f"{conv}.{n}" for conv in _CONVS for n in ("base_kernel", "kernel_projection.weight")]
    if cfg.is_dflash2:  # the released checkpoint's codebooks carry no ".weight"
        names += [f"candidate_selector.{n}" for n in _SELECTOR_TENSORS]
    return names


_CONVS = ("attention_conv", "mlp_conv")
_SELECTOR_TENSORS = ("predecessor_codebook", "successor_codebook", "hidden_projection.weight")
_ARCHITECTURES = {DFLASH1: "DFlashDraftModel", DFLASH2: "DFlash2DraftModel"}
# DFlash 2's dflash_config sizes (z-lab reads dflash_config first, then the top level; so do vLLM/SGLang).
_DFLASH2_SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "input_embedding_scale")
# DFlash 2's logit transform: in dflash_config, as the released Muse-Glimmer config carries them and
# vLLM's qwen3_dflash2.py reads them (from dflash_config only: a top-level copy would serve unscaled logits).
_DFLASH2_LOGITS = ("output_multiplier", "final_logit_softcapping")


def _dflash2_fields_to_hf(cfg: DrafterConfig) -> dict:
    """dflash_config's additions for a DFlash 2 drafter's config.json."""
    if not cfg.is_dflash2:
        return {}
    return {"block_size": cfg.block_size, **{name: getattr(cfg, name) for name in _DFLASH2_SIZES + _DFLASH2_LOGITS}}


def drafter_config_to_hf(cfg: DrafterConfig) -> dict:
    """config.json of the exported drafter (Qwen3Config fields plus the DFlash keys)."""
    sliding = any(cfg.sliding_layers)
    return {
        "architectures": [_ARCHITECTURES[cfg.arch]],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.tap_layer_ids),
            **_dflash2_fields_to_hf(cfg),
        },
        "target_hidden_size": cfg.hidden_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": list(cfg.layer_types),
        **({"is_causal": cfg.is_causal} if cfg.is_causal is not None else {}),
        "sliding_window": cfg.sliding_window if sliding else None,
        "use_sliding_window": sliding,
        "max_window_layers": cfg.num_layers,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "bfloat16",
    }


def drafter_config_from_hf(hf: dict, source: str = "config.json", mask_token_id: int | None = None) -> DrafterConfig:
    """Inverse of drafter_config_to_hf; also reads published z-lab / SpecForge configs. Every field read
    is type-checked, a refusal naming it (shards/common/schema.py).

    mask_token_id: used when the config's dflash_config.mask_token_id is null (some published configs)."""

    def get(name: str, annotation: Any, default: Any = REQUIRED, mapping: dict = hf, where: str = "") -> Any:
        return read_field(mapping, name, annotation, source, default, where)

    architectures = get("architectures", list[str], [])
    arch = next((a for a, name in _ARCHITECTURES.items() if name in architectures), None)
    if arch is None:
        raise ValueError(
            f"{source}: architectures {architectures} names neither DFlashDraftModel nor DFlash2DraftModel"
        )
    dflash = get("dflash_config", dict[str, Any], {})
    missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
    if missing:
        raise ValueError(f"{source}: dflash_config lacks {missing}")

    def foreign_in(d: dict) -> set[str]:  # causal overrides vLLM's per-layer causality either way
        return {k for k in _FOREIGN_FIELDS if d.get(k) is not None and (d[k] is not False or "causal" in k)}

    # vLLM also reads dflash_config.is_causal (after the top level's): one spelling is read here, the top level's.
    nested_is_causal = {"dflash_config.is_causal"} if dflash.get("is_causal") is not None else set()
    foreign = sorted(foreign_in(hf) | {f"dflash_config.{k}" for k in foreign_in(dflash)} | nested_is_causal)
    if foreign:
        raise ValueError(
            f"{source}: {foreign} change how engines run this drafter's attention or vocabulary, "
            "which dflash-train does not model; use a plain DFlashDraftModel (Qwen3 layers)"
        )
    rope = get("rope_parameters", dict[str, Any], {})
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise ValueError(
            f"{source}: rope_parameters.rope_type {rope.get('rope_type')!r} / rope_scaling "
            f"{hf.get('rope_scaling')!r}: only default RoPE is implemented"
        )
    thetas = {get("rope_theta", float, None, rope, "rope_parameters."), get("rope_theta", float, None)} - {None}
    if len(thetas) != 1:
        raise ValueError(
            f"{source}: RoPE theta rope_parameters.rope_theta {rope.get('rope_theta')!r} vs "
            f"rope_theta {hf.get('rope_theta')!r}: exactly one value must be given"
        )
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias", False):
        raise ValueError(
            f"{source}: hidden_act {hf.get('hidden_act')!r} / attention_bias "
            f"{hf.get('attention_bias')!r}: only silu without attention bias is implemented"
        )
    hidden_size = get("hidden_size", int)
    if get("target_hidden_size", int, None) not in (None, hidden_size):
        raise ValueError(
            f"{source}: target_hidden_size {hf['target_hidden_size']} differs from hidden_size "
            f"{hidden_size}; the drafter must be as wide as its target"
        )
    num_layers = get("num_hidden_layers", int)
    layer_types = get("layer_types", list[str], None) or _derived_layer_types(hf, num_layers, source)
    sliding = bool(layer_types) and "sliding_attention" in layer_types
    window = get("sliding_window", int, 4096) if sliding else None
    if sliding and not hf.get("use_sliding_window", False):
        raise ValueError(
            f"{source}: layer_types has sliding_attention layers but use_sliding_window is "
            f"{hf.get('use_sliding_window')!r}: HF, vLLM and SGLang then see no window (set it true)"
        )
    mask = get("mask_token_id", int, mask_token_id, dflash, "dflash_config.")
    if mask is None:
        raise ValueError(f"{source}: dflash_config.mask_token_id is null; pass --mask-token-id")
    num_heads = get("num_attention_heads", int)
    if num_heads < 1:  # head_dim's default divides by it
        raise ValueError(f"{source}: num_attention_heads must be positive, found {num_heads}")
    try:
        return DrafterConfig(
            num_layers=num_layers,
            hidden_size=hidden_size,
            intermediate_size=get("intermediate_size", int),
            num_attention_heads=num_heads,
            num_key_value_heads=get("num_key_value_heads", int, num_heads),
            head_dim=get("head_dim", int, hidden_size // num_heads),
            rms_norm_eps=get("rms_norm_eps", float),
            rope_theta=thetas.pop(),
            max_position_embeddings=get("max_position_embeddings", int),
            block_size=get("block_size", int, get("block_size", int, 16, dflash, "dflash_config.")),
            mask_token_id=mask,
            tap_layer_ids=get("target_layer_ids", list[int], REQUIRED, dflash, "dflash_config."),
            num_target_layers=get("num_target_layers", int),
            vocab_size=get("vocab_size", int),
            layer_types=layer_types,
            sliding_window=window,
            is_causal=get("is_causal", bool, None),
            bos_token_id=get("bos_token_id", int, None),
            eos_token_id=get("eos_token_id", int | list[int], None),
            pad_token_id=get("pad_token_id", int, None),
            **_dflash2_fields_from_hf(arch, hf, dflash, get),
        )
    except ValueError as e:  # the shape's own checks (DrafterConfig.__post_init__)
        raise ValueError(f"{source}: {e}") from e


def _dflash2_fields_from_hf(arch: str, hf: dict, dflash: dict, get) -> dict[str, Any]:
    """DrafterConfig's DFlash 2 fields of a config.json (dflash_config first, then the top level)."""
    if arch != DFLASH2:
        return {"arch": arch}
    fields: dict[str, Any] = {"arch": arch}
    for name in _DFLASH2_SIZES + _DFLASH2_LOGITS:
        annotation = float if name in ("input_embedding_scale", "output_multiplier") else int
        annotation = float | None if name == "final_logit_softcapping" else annotation
        default = (
            REQUIRED if name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k") else None
        )
        where = "dflash_config." if name in dflash else ""
        value = get(name, annotation, default, dflash if name in dflash else hf, where)
        if value is not None:
            fields[name] = value
    # 0 or a negative cap means none in z-lab's reference.
    if fields.get("final_logit_softcapping") is not None and fields["final_logit_softcapping"] <= 0:
        fields["final_logit_softcapping"] = None
    return fields


def _derived_layer_types(hf: dict, num_layers: int, source: str) -> list[str] | None:
    """The layer types HF's Qwen3Config (what engines read) derives when config.json has no layer_types:
    sliding from layer max_window_layers on, iff use_sliding_window; None when every layer is full."""
    if not hf.get("use_sliding_window", False) or hf.get("sliding_window", 4096) is None:
        return None
    first_sliding = read_field(
        hf, "max_window_layers", int, source, 28
    )  # Qwen3Config's defaults, also for sliding_window
    types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
    return types if "sliding_attention" in types else None


# Written into model.safetensors' metadata: how a later export recognises a directory it may replace.
PRODUCER = "dflash-pipeline"


_EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE)


def _produced_by_us(d: Dir) -> bool:
    """model.safetensors is a regular file whose header names this program as its producer."""
    if not d.is_file(WEIGHTS_FILE):
        return False
    try:
        return read_header(d.pinned_path(WEIGHTS_FILE)).metadata.get("producer") == PRODUCER
    except CacheFormatError:
        return False


def _ours(d: Dir, e: Entry, marked: bool) -> bool:
    return e.is_file and e.name in _EXPORT_FILES


EXPORT_LAYOUT = Layout(claim=_ours, temporaries=_EXPORT_FILES.__contains__, marked=_produced_by_us)


def check_export_target(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty directory that is not an earlier export of ours; replacing ours needs overwrite."""
    if out.exists() and not out.is_dir():
        raise OwnershipError(f"export directory {out} is a file; choose a new or empty directory")
    if out.is_dir():
        with Dir.open(out) as d:
            found = survey(d, EXPORT_LAYOUT)
        entries = sorted(found.ours + found.scaffolding + found.foreign, key=lambda e: e.name)
        if entries and (found.foreign or not found.marked):
            shown = ", ".join(str(e) for e in (found.foreign or entries)[:5])
            raise OwnershipError(
                f"export directory {out} is not empty and is not a drafter exported by dflash-train "
                f"(found {shown}); nothing was written: choose a new or empty directory"
            )
        if entries and not overwrite:
            raise OwnershipError(
                f"export directory {out} holds an earlier export; pass --overwrite to replace it, or choose a new "
                "directory"
            )
    check_writable(out, f"export directory {out}")


def export_drafter(
    model: DFlashDrafter,
    cfg: DrafterConfig,
    out_dir: str | Path,
    overwrite: bool = False,
    training: dict[str, Any] | None = None,
) -> Path:
    """Write config.json and model.safetensors (bf16, z-lab names) into out_dir; returns out_dir.

    out_dir must be new, empty, or (with overwrite) an earlier export of ours: never anyone else's
    files. Both files go through the durable-write path and are readable by every user (a serving
    process often runs as another user). training: what the drafter was trained on, kept in config.json
    under serving.TRAINING_KEY (the engines ignore it; `eval --target` reads it)."""
    out = Path(out_dir)
    check_export_target(out, overwrite)
    served, cfg = served_state(model, cfg)
    state = {name: t.detach().to("cpu", torch.bfloat16).contiguous() for name, t in served.items()}
    expected = zlab_parameter_names(cfg)
    if sorted(state) != sorted(expected):
        raise ValueError(
            f"drafter state_dict names differ from z-lab's: extra {sorted(set(state) - set(expected))}, "
            f"missing {sorted(set(expected) - set(state))}"
        )
    meta = {"format": "pt", "producer": PRODUCER}
    hf = drafter_config_to_hf(cfg) | ({TRAINING_KEY: training} if training else {})
    config = json.dumps(hf, indent=2) + "\n"
    weights_bytes = sum(t.nbytes for t in state.values())
    try:
        created = not out.is_dir()
        with Dir.open(out, create=True) as d:
            if created:
                d.chmod(DIR_MODE)  # mkdir applies the umask
            d.remove_temporaries(_EXPORT_FILES.__contains__)  # ours only: never a user's .tmp-x
            nothing = "nothing of this export was written; free space and export again"
            with refusing_when_full(out / WEIGHTS_FILE, nothing, weights_bytes):
                d.write_atomic(WEIGHTS_FILE, lambda f: write_container(f, state, meta))
            then = f"{WEIGHTS_FILE} was; free space and export again with --overwrite"
            with refusing_when_full(out / CONFIG_FILE, then):
                d.write_atomic(CONFIG_FILE, lambda f: f.write(config.encode()))
    except DiskFullError:
        raise
    except OSError as e:
        raise OSError(e.errno, f"exporting to {out} failed: {e.strerror or e}") from e
    log.info("exported drafter (%d tensors) to %s", len(state), out)
    return out


def served_state(model: DFlashDrafter, cfg: DrafterConfig) -> tuple[dict[str, torch.Tensor], DrafterConfig]:
    """The drafter as engines load it: a projected drafter's fc' folded into the standard fc = fc' A
    (multiplied in float32, before any cast), its projection dropped; any other drafter as it is."""
    state = dict(model.state_dict())
    if cfg.context_width is None:
        return state, cfg
    state["fc.weight"] = fold_fc(state["fc.weight"], state.pop("context_projection"))
    return state, cfg.replace(context_width=None, context_projection=None)


def drafter_from_checkpoint(ckpt: Checkpoint) -> tuple[DFlashDrafter, DrafterConfig]:
    """The drafter a training checkpoint holds, built from its recorded config, every weight loaded (strict)."""
    cfg = train_state(ckpt).drafter
    weights = ckpt.path / MODEL_FILE
    check_weight_shapes([weights], cfg, weights, described_by=str(ckpt.path / STATE_FILE))  # before allocating
    with torch.device("meta"):  # no initialisation of weights that the checkpoint's replace
        model = DFlashDrafter(cfg)
    model = model.to_empty(device="cpu")
    model.load_state_dict(load_model_state(ckpt), strict=True)
    return model, cfg


def export_checkpoint(checkpoint: str | Path, out: str | Path, overwrite: bool = False) -> Checkpoint:
    """`dflash-train export CHECKPOINT OUT`: the checkpoint a step-NNNNNNNN folder names (verified: refused
    when damaged, never replaced by another) or a run directory's newest valid one, exported to OUT;
    returns the checkpoint exported. OUT is checked before any work."""
    check_export_target(Path(out), overwrite)
    ckpt = resolve_checkpoint(checkpoint)
    if ckpt is None:
        raise CheckpointError(
            f"{checkpoint}: not a valid checkpoint (step-NNNNNNNN with train_state.json, "
            "model.safetensors, optimizer.pt) nor a run directory holding one"
        )
    model, cfg = drafter_from_checkpoint(ckpt)
    state = train_state(ckpt)
    training = {k: getattr(state, k) for k in EXPORTED_TRAINING if getattr(state, k) is not None}
    export_drafter(model, cfg, out, overwrite=overwrite, training=training or None)
    return ckpt


def read_drafter_config(path: str | Path, mask_token_id: int | None = None) -> DrafterConfig:
    """The DrafterConfig of a DFlashDraftModel directory's config.json (no weights read)."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: not found; expected an exported DFlash drafter directory")
    hf = read_json_object(config_path)
    try:
        return drafter_config_from_hf(hf, source=str(config_path), mask_token_id=mask_token_id)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{config_path}: not a DFlashDraftModel config ({type(e).__name__}: {e})") from e


def _weight_files(path: Path) -> tuple[list[Path], Path]:
    """The safetensors files of a drafter directory and what lists them (model.safetensors or its index)."""
    index_path, single = path / WEIGHTS_INDEX_FILE, path / WEIGHTS_FILE
    if single.is_file():
        return [single], single
    if index_path.is_file():
        weight_map = read_field(read_json_object(index_path), "weight_map", dict[str, str], str(index_path), {})
        files = [path / f for f in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent or not files:
            raise FileNotFoundError(f"{index_path}: lists shards that are not there: {absent or 'none at all'}")
        return files, index_path
    raise FileNotFoundError(
        f"{path}: neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}; expected an exported DFlash drafter directory"
    )


def _unreadable(path: Path, e: Exception) -> ValueError:
    return ValueError(f"{path}: unreadable ({e}): damaged or partial; export (or download) the drafter again")


def drafter_fingerprint(path: str | Path) -> str:
    """crc32 over a drafter directory's config.json and weight files, in order: what a resumed
    --init-from run compares, so the same drafter under another path (or a copy) is the same run."""
    files = [Path(path) / CONFIG_FILE, *_weight_files(Path(path))[0]]
    value = 0
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 26):
                value = crc32(chunk, value)
    return f"content crc32 {value:08x}"


def check_weight_files(path: str | Path, cfg: DrafterConfig) -> None:
    """Refuse (ValueError naming the file and tensor) a drafter directory whose weight files are missing,
    cut short, not safetensors, or hold other tensors than `cfg` describes; reads headers only, so it
    runs before any model is built."""
    files, where = _weight_files(Path(path))
    check_weight_shapes(files, cfg, where, described_by=str(Path(path) / CONFIG_FILE))


def read_drafter_weights(path: str | Path, cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """The drafter tensors of a directory: model.safetensors, or the shards model.safetensors.index.json
    lists; names and shapes must be exactly z-lab's for cfg, checked from the headers before any tensor
    is read (the error names the extra and missing ones, or the tensor of another shape)."""
    check_weight_files(path, cfg)
    files, where = _weight_files(Path(path))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except SafetensorError as e:
            raise _unreadable(f, e) from e
    _check_values(state, where)
    return state


def _check_values(state: dict[str, torch.Tensor], where: Path) -> None:
    """Refuse integer tensors and non-finite values: either would load, then train or draft garbage."""
    not_float = sorted(f"{n} ({t.dtype})" for n, t in state.items() if not t.is_floating_point())
    if not_float:
        raise ValueError(f"{where}: tensors {not_float[:5]} are not floating point; expected bf16, fp16 or fp32")
    bad = sorted(n for n, t in state.items() if not torch.isfinite(t).all())
    if bad:
        raise ValueError(
            f"{where}: {len(bad)} tensor(s) hold NaN or inf values ({', '.join(bad[:5])}); the drafter is damaged"
        )


def load_exported_drafter(
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    mask_token_id: int | None = None,
) -> tuple[DFlashDrafter, DrafterConfig]:
    """Load a DFlashDraftModel directory (ours or a published one) into a DFlashDrafter."""
    cfg = read_drafter_config(path, mask_token_id=mask_token_id)
    state = read_drafter_weights(path, cfg)
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model, cfg


@torch.no_grad()
def load_drafter_weights_(
    model: DFlashDrafter, path: str | Path, projection: tuple[torch.Tensor, torch.Tensor] | None = None
) -> None:
    """Copy a DFlashDraftModel directory's weights into `model` in place (its dtype and device kept);
    the directory must describe model's shape (read_drafter_weights checks names and shapes) with a full
    fc, or, for a DFlash 2 model, be a DFlash 1 drafter of that shape: the warm start, where the convolutions
    and the selector keep their inert initialisation (train/drafter/dflash2.py) and the drafter is unchanged.
    A projected model (`projection` = its cache's P and D) starts from fc' = W0 D^-1 P^T."""
    cfg = model.config
    warm_start = cfg.is_dflash2 and read_drafter_config(path, cfg.mask_token_id).arch == DFLASH1
    full = cfg.replace(context_width=None, context_projection=None)
    state = read_drafter_weights(path, full.replace(arch=DFLASH1) if warm_start else full)
    if cfg.context_width is not None:
        assert projection is not None, "a projected drafter is initialised with its cache's projection"
        state["fc.weight"] = unfold_fc(state["fc.weight"], *projection)
    for name, p in model.named_parameters():
        if name in state or not warm_start:
            p.copy_(state[name].to(p.dtype))
    what = "a DFlash 1 drafter (warm start: convolutions identity, selector inert)" if warm_start else "the drafter"
    log.info("initialised %s from %s (%d tensors)", what, path, len(state))
