"""Write a random-weight Qwen3.5-style checkpoint in the official layout (tests and demos).

The directory looks like a real release: config.json (multimodal with "text_config" and a tiny
"vision_config", or plain text) plus model.safetensors, or sharded model-0000i-of-0000n.safetensors
with model.safetensors.index.json. Weights are random with scales that keep the model alive:
zero-centred norms near identity, A_log and dt_bias in the ranges of released checkpoints, an LM
head whose logits spread over several units so greedy decoding does not collapse to one token.

    python -m tools.tiny_target OUT_DIR [--seed 0] [--naming multimodal|text] [--shard-max-bytes N]
                                        [--fp8 [--fp8-block 128]]

--fp8 writes the fine-grained FP8 format of Qwen's "-FP8" releases (extract/quantization.py): the
decoder's linear weights as e4m3 with a weight_scale_inv per block, the rest unquantised, and a
quantization_config naming the modules it left alone.

With the tokenizer (on by default from the command line, `with_tokenizer` in the library) the
directory also holds tokenizer.json, tokenizer_config.json and chat_template.jinja.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import click
import torch
from safetensors.torch import save_file

from extract.checkpoint import INDEX_FILE, SINGLE_FILE, hf_name
from extract.kernels import KernelChoice
from extract.model import TargetModel
from extract.quantization import Fp8BlockFormat, quantize_fp8_blocks, scale_name
from extract.target_config import FULL_ATTENTION, LINEAR_ATTENTION, TargetConfig
from tools.tiny_tokenizer import unemittable_ids, write_tokenizer

logger = logging.getLogger(__name__)

NAMINGS = ("multimodal", "text")
# Linear weights an FP8 release keeps unquantised: the GatedDeltaNet decay/beta projections (and
# lm_head); embeddings, norms, the conv and the decay parameters are never quantised.
FP8_KEEP_SUFFIXES = ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight")


def tiny_config_dict(
    *,
    num_hidden_layers: int = 8,
    hidden_size: int = 64,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 6,
    partial_rotary_factor: float = 0.25,
    tie_word_embeddings: bool = False,
    vocab_size: int = 512,
) -> dict[str, Any]:
    """A tiny Qwen3.5 text config (plain layout, HF Qwen3_5TextConfig fields) for tests and demos.

    Defaults mirror the 27B's structure at toy width: 3:1 layout, GVA ratio 3 (2 q/k x 6 v heads),
    GQA 4:2, partial RoPE 0.25, untied embeddings.
    """
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "layer_types": [FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(num_hidden_layers)],
        "full_attention_interval": 4,
        "intermediate_size": 2 * hidden_size + 32,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "linear_num_key_heads": linear_num_key_heads,
        "linear_num_value_heads": linear_num_value_heads,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": partial_rotary_factor,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        "partial_rotary_factor": partial_rotary_factor,
        "tie_word_embeddings": tie_word_embeddings,
        "initializer_range": 0.02,
        "use_cache": False,
        "dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def qwen35_27b_config_dict(*, num_hidden_layers: int = 64, vocab_size: int = 248320) -> dict[str, Any]:
    """The Qwen3.5/3.6-27B text config (plain layout); fewer layers or a smaller vocab for
    benchmarks and GPU tests at full width."""
    cfg = tiny_config_dict(num_hidden_layers=num_hidden_layers, vocab_size=vocab_size)
    cfg.update(
        {
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "max_position_embeddings": 262144,
            "dtype": "bfloat16",
            "eos_token_id": 248044,
            "bos_token_id": 248044,
            "pad_token_id": None,
        }
    )
    return cfg


def _tiny_vision_config(out_hidden_size: int) -> dict[str, Any]:
    """Smallest vision tower HF's Qwen3_5VisionConfig accepts; never used by extraction."""
    return {
        "model_type": "qwen3_5_vision",
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": out_hidden_size,
        "num_position_embeddings": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "initializer_range": 0.02,
    }


def _full_config(text: dict[str, Any], naming: str) -> dict[str, Any]:
    if naming == "text":
        return dict(text)
    text = dict(text)
    text.pop("architectures", None)
    text["model_type"] = "qwen3_5_text"
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": _tiny_vision_config(text["hidden_size"]),
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
        "image_token_id": text["vocab_size"] - 4,
        "video_token_id": text["vocab_size"] - 3,
        "vision_start_token_id": text["vocab_size"] - 2,
        "vision_end_token_id": text["vocab_size"] - 1,
    }


def random_weights(
    cfg: TargetConfig,
    seed: int,
    device: torch.device | str = "cpu",
    with_head: bool = True,
    dtype: torch.dtype = torch.float32,
    last_layer: int | None = None,
) -> dict[str, torch.Tensor]:
    """Our parameter name -> tensor (on `device`) with scales that keep activations finite and
    varied. with_head=False leaves out the final norm and LM head; last_layer stops the layers
    early; dtype casts each tensor as it is made (A_log and dt_bias stay fp32), so a 27B-width
    model never exists in fp32 at once."""
    with torch.device("meta"):
        shapes = TargetModel(
            cfg,
            KernelChoice(gated_delta_backend="torch", conv_backend="torch", attention_backend="sdpa"),
            with_head=with_head,
            last_layer=last_layer,
        )
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, meta in sorted(shapes.named_parameters(remove_duplicate=False)):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = _init(name, tuple(meta.shape), cfg, gen, device)
        out[name] = value if name.endswith(("A_log", "dt_bias")) else value.to(dtype)
    return out


def _init(name: str, shape: tuple[int, ...], cfg: TargetConfig, gen: torch.Generator, device) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device) * std

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.empty(shape, device=device).uniform_(low, high, generator=gen)

    if name == "embed_tokens.weight":
        return normal(1.0)
    if name == "lm_head.weight":
        return normal(3.0 / math.sqrt(cfg.hidden_size))  # logits spread ~3 units: varied argmax
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + normal(0.1)  # plain weight: near one
    if name.endswith("norm.weight"):
        return normal(0.1)  # zero-centred (1 + w): near zero
    if name.endswith("A_log"):
        return uniform(1.0, 16.0).log()
    if name.endswith("dt_bias"):
        dt = uniform(math.log(1e-3), math.log(1e-1)).exp()
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus: softplus(dt_bias) = dt
    if name.endswith("conv1d.weight"):
        return normal(1.0 / math.sqrt(shape[-1]))
    fan_in = shape[-1]
    # Residual-writing projections get half scale so the stream grows slowly over layers.
    scale = 0.5 if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")) else 1.0
    return normal(scale / math.sqrt(fan_in))


def write_random_checkpoint(
    out_dir: str | Path,
    config_dict: dict[str, Any] | None = None,
    seed: int = 0,
    naming: str = "multimodal",
    shard_max_bytes: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    with_mtp: bool = True,
    mixer_scale: float = 1.0,
    fp8_block: int | None = None,
    with_tokenizer: bool = False,
) -> Path:
    """Write config.json + safetensors under `out_dir`; returns the directory.

    config_dict: a plain text config (HF Qwen3_5TextConfig fields); default `tiny_config_dict()`.
    naming: "multimodal" (model.language_model.*, multimodal config.json) or "text" (model.*).
    shard_max_bytes: split into several files with an index once the total exceeds this.
    dtype: storage dtype of every tensor except A_log (always fp32, as in the release).
    with_mtp: also write a small mtp.* tensor, which loaders must skip (multimodal naming only).
    mixer_scale: multiplies the token mixers' output projections (GatedDeltaNet out_proj, attention
        o_proj). Below 1 the target leans on the current token, so its greedy text has structure a
        small drafter can learn in a CPU demo; 1 keeps the default scales.
    fp8_block: write the decoder's linear weights in fine-grained FP8 with fp8_block x fp8_block
        scale blocks (the releases use 128) and a quantization_config; None = unquantised.
    with_tokenizer: also write a small trained tokenizer and a Qwen3.5-shaped chat template
        (tools/tiny_tokenizer.py), as releases ship them, and give the ids whose text does not encode
        back to them zero rows of an untied LM head, so the greedy replies of the target round-trip
        through text; needs vocab_size >= 320.
    """
    if naming not in NAMINGS:
        raise ValueError(f"naming={naming!r}, expected one of {NAMINGS}")
    text = dict(config_dict) if config_dict is not None else tiny_config_dict()
    full = _full_config(text, naming)
    cfg = TargetConfig.from_hf_dict(full)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    fp8 = Fp8BlockFormat(block_n=fp8_block, block_k=fp8_block) if fp8_block is not None else None
    if fp8 is not None:
        keep = ["lm_head"] + [
            hf_name(f"layers.{i}.{suffix[: -len('.weight')]}", naming)
            for i in range(cfg.num_hidden_layers)
            for suffix in FP8_KEEP_SUFFIXES
            if not cfg.is_full_attention(i)
        ]
        full["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [fp8_block, fp8_block],
            "modules_to_not_convert": keep,
        }
    tensors: dict[str, torch.Tensor] = {}
    for local, value in random_weights(cfg, seed).items():
        if local.endswith(("linear_attn.out_proj.weight", "self_attn.o_proj.weight")):
            value = value * mixer_scale
        if local == "lm_head.weight" and with_tokenizer:
            # Zero logits for the ids whose text does not encode back to them (tools/tiny_tokenizer.py):
            # the max over ~300 random logits is positive, so greedy decoding never picks one.
            value = value.clone()
            value[unemittable_ids(cfg.vocab_size)] = 0.0
        name = hf_name(local, naming)
        if fp8 is not None and _fp8_quantised(local, value):
            tensors[name], tensors[scale_name(name)] = quantize_fp8_blocks(value, fp8)
            continue
        tensors[name] = value.to(torch.float32 if local.endswith("A_log") else dtype).contiguous()
    if with_mtp and naming == "multimodal":
        tensors["mtp.fc.weight"] = torch.zeros(cfg.hidden_size, 2 * cfg.hidden_size, dtype=dtype)

    with open(out_dir / "config.json", "w", encoding="utf-8") as f:
        json.dump(full, f, indent=2, sort_keys=True)
    _write_shards(out_dir, tensors, shard_max_bytes)
    if with_tokenizer:
        write_tokenizer(out_dir, cfg.vocab_size)
    logger.info("wrote a random %s-naming checkpoint to %s (seed %d, %d tensors)", naming, out_dir, seed, len(tensors))
    return out_dir


def _fp8_quantised(local: str, value: torch.Tensor) -> bool:
    """The release's rule: every decoder-layer linear weight (2-D) except the GatedDeltaNet a/b ones."""
    return local.startswith("layers.") and value.ndim == 2 and not local.endswith(FP8_KEEP_SUFFIXES)


def _write_shards(out_dir: Path, tensors: dict[str, torch.Tensor], shard_max_bytes: int | None) -> None:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if shard_max_bytes is None or total <= shard_max_bytes:
        save_file(tensors, str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
        return
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > shard_max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in group})
    with open(out_dir / INDEX_FILE, "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="RNG seed of the random weights.")
@click.option(
    "--naming",
    type=click.Choice(NAMINGS),
    default="multimodal",
    show_default=True,
    help="Checkpoint layout: multimodal release (model.language_model.*) or text-only (model.*).",
)
@click.option(
    "--shard-max-bytes",
    type=int,
    default=None,
    help="Split the weights into files of at most this many bytes (default: one file).",
)
@click.option("--tied/--untied", default=False, show_default=True, help="Tie lm_head to embed_tokens.")
@click.option(
    "--mixer-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Scale of the token mixers' output projections (<1: more predictable greedy text, for demos).",
)
@click.option(
    "--fp8",
    is_flag=True,
    help="Write the decoder's linear weights in fine-grained FP8 (e4m3 + weight_scale_inv blocks).",
)
@click.option(
    "--fp8-block",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Rows and columns per FP8 scale block (with --fp8).",
)
@click.option(
    "--tokenizer/--no-tokenizer",
    "with_tokenizer",
    default=True,
    show_default=True,
    help="Also write a small trained tokenizer and a Qwen3.5-shaped chat template (for dflash-data).",
)
def main(
    out_dir: Path,
    seed: int,
    naming: str,
    shard_max_bytes: int | None,
    tied: bool,
    mixer_scale: float,
    fp8: bool,
    fp8_block: int,
    with_tokenizer: bool,
) -> None:
    """Write a tiny random Qwen3.5-style target checkpoint to OUT_DIR."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    write_random_checkpoint(
        out_dir,
        tiny_config_dict(tie_word_embeddings=tied),
        seed=seed,
        naming=naming,
        shard_max_bytes=shard_max_bytes,
        mixer_scale=mixer_scale,
        fp8_block=fp8_block if fp8 else None,
        with_tokenizer=with_tokenizer,
    )


if __name__ == "__main__":
    main()
