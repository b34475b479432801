"""Export a trained drafter in z-lab's DFlashDraftModel layout (what vLLM / SGLang load), and reload it.

OUT/config.json        architectures ["DFlashDraftModel"], model_type "qwen3", block_size,
                       num_target_layers, dflash_config {mask_token_id, target_layer_ids}, Qwen3 fields
OUT/model.safetensors  the drafter's parameters under z-lab's names, bf16

Export is for serving and evaluation, never a resume source (checkpoints are the loop's business).
"""
from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from shards.container import read_header, write_container
from shards.durable import DIR_MODE, TMP_PREFIX, atomic_write, atomic_write_text, remove_stale_temporaries
from shards.format import CacheFormatError

from .drafter_config import DrafterConfig
from .model import DFlashDrafter

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def zlab_parameter_names(cfg: DrafterConfig) -> list[str]:
    """The parameter names of z-lab's DFlashDraftModel for this shape: the one name mapping we follow."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        names += [p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    return names


def drafter_config_to_hf(cfg: DrafterConfig) -> dict:
    """config.json of the exported drafter (Qwen3Config fields plus the DFlash keys)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.tap_layer_ids)},
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
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "initializer_range": 0.02,
        "dtype": "bfloat16",
    }


def drafter_config_from_hf(hf: dict, source: str = "config.json") -> DrafterConfig:
    """Inverse of drafter_config_to_hf; also reads published z-lab configs."""
    if "DFlashDraftModel" not in hf.get("architectures", []):
        raise ValueError(f"{source}: architectures {hf.get('architectures')} does not name DFlashDraftModel")
    dflash = hf.get("dflash_config") or {}
    missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
    if missing:
        raise ValueError(f"{source}: dflash_config lacks {missing}")
    rope_theta = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta"))
    num_heads = hf["num_attention_heads"]
    return DrafterConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_attention_heads=num_heads,
        num_key_value_heads=hf.get("num_key_value_heads", num_heads),
        head_dim=hf.get("head_dim", hf["hidden_size"] // num_heads), rms_norm_eps=hf["rms_norm_eps"],
        rope_theta=float(rope_theta), max_position_embeddings=hf["max_position_embeddings"],
        block_size=hf["block_size"], mask_token_id=dflash["mask_token_id"],
        tap_layer_ids=list(dflash["target_layer_ids"]), num_target_layers=hf["num_target_layers"],
        vocab_size=hf["vocab_size"])


# Written into model.safetensors' metadata: how a later export recognises a directory it may replace.
PRODUCER = "dflash-pipeline"


def export_status(out: Path) -> tuple[bool, list[Path]]:
    """(is an earlier export of ours, entries that are neither ours nor temporaries) for an existing out."""
    ours = {CONFIG_FILE, WEIGHTS_FILE}
    foreign = [p for p in sorted(out.iterdir()) if p.name not in ours and not p.name.startswith(TMP_PREFIX)]
    weights = out / WEIGHTS_FILE
    produced = False
    if weights.is_file():
        try:
            produced = read_header(weights).metadata.get("producer") == PRODUCER
        except CacheFormatError:
            produced = False
    return produced and not foreign, foreign


def check_export_target(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty directory that is not an earlier export of ours; replacing ours needs overwrite."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"export directory {out} is a file; choose a new or empty directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    ours, foreign = export_status(out)
    if not ours:
        shown = ", ".join(str(p) for p in (foreign or sorted(out.iterdir()))[:5])
        raise ValueError(f"export directory {out} is not empty and is not a drafter exported by dflash-train "
                         f"(found {shown}); nothing was written: choose a new or empty directory")
    if not overwrite:
        raise ValueError(f"export directory {out} holds an earlier export; pass --overwrite to replace it, "
                         "or choose a new directory")


def export_drafter(model: torch.nn.Module, cfg: DrafterConfig, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write config.json and model.safetensors (bf16, z-lab names) into out_dir; returns out_dir.

    out_dir must be new, empty, or (with overwrite) an earlier export of ours: never anyone else's
    files. Both files go through the durable-write path and are readable by every user (a serving
    process often runs as another user).
    model: a DFlashDrafter, also wrapped in DDP or torch.compile."""
    out = Path(out_dir)
    check_export_target(out, overwrite)
    if not out.is_dir():
        out.mkdir(parents=True)
        os.chmod(out, DIR_MODE)  # mkdir applies the umask
    remove_stale_temporaries(out)
    # DDP (.module) and torch.compile (._orig_mod) wrappers would prefix every name.
    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module) or isinstance(
            getattr(model, "module", None), torch.nn.Module):
        model = getattr(model, "_orig_mod", None) or model.module
    state = {name: t.detach().to("cpu", torch.bfloat16).contiguous() for name, t in model.state_dict().items()}
    expected = zlab_parameter_names(cfg)
    if sorted(state) != sorted(expected):
        raise ValueError(f"drafter state_dict names differ from z-lab's: extra {sorted(set(state) - set(expected))}, "
                         f"missing {sorted(set(expected) - set(state))}")
    meta = {"format": "pt", "producer": PRODUCER}
    try:
        atomic_write(out / WEIGHTS_FILE, lambda f: write_container(f, state, meta))
        atomic_write_text(out / CONFIG_FILE, json.dumps(drafter_config_to_hf(cfg), indent=2) + "\n")
    except OSError as e:
        raise OSError(e.errno, f"exporting to {out} failed: {e.strerror or e}"
                      + ("; free space and export again" if e.errno == errno.ENOSPC else "")) from e
    log.info("exported drafter (%d tensors) to %s", len(state), out)
    return out


def load_exported_drafter(path: str | Path, dtype: torch.dtype = torch.bfloat16,
                          device: torch.device | str = "cpu") -> tuple[DFlashDrafter, DrafterConfig]:
    """Load a DFlashDraftModel directory (ours or a published one) into a DFlashDrafter."""
    path = Path(path)
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    for p in (config_path, weights_path):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: not found; expected an exported DFlash drafter directory")
    cfg = drafter_config_from_hf(json.loads(config_path.read_text()), source=str(config_path))
    state = load_file(str(weights_path))
    expected = zlab_parameter_names(cfg)
    extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
    if extra or missing:
        raise ValueError(f"{weights_path}: tensor names differ from DFlashDraftModel: extra {extra}, missing {missing}")
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model, cfg
