"""What the serving engines, and `eval --target`, need to hear about a trained drafter.

Read from the engines' newest DFlash loaders (December 2026):
- vLLM (v1/spec_decode/dflash.py, models/qwen3_dflash.py) never reads config.json's block_size: it drafts
  a block of 1 + `num_speculative_tokens` (from --speculative-config), so the serve command must say
  block_size - 1. Recipes written for DFlash 2 drafters say 7 (block 8), which would run a block-16
  drafter on blocks it was never trained on. Its full (non-causal) layers need an attention backend
  with non-causal support (flash_attn); a drafter mixing sliding and full layers needs the V2 model
  runner (VLLM_USE_V2_MODEL_RUNNER=1).
- SGLang (speculative/dflash_worker.py) takes the block from --speculative-num-draft-tokens (the whole
  block, anchor included) and warns when it differs from config.json's block_size; the command gives it.
- llama.cpp runs every draft layer non-causally and its converter drops the sliding window, so a drafter
  with sliding layers is for vLLM and SGLang only.
- A drafter whose config.json says is_causal false (published DFlash 2 configs: sliding layers attending
  their block both ways): vLLM reads the top-level is_causal first (_dflash_layer_causal, PR #52816);
  SGLang's DFlash loader (models/dflash.py as read in December 2026) runs every sliding layer as a causal
  DECODER layer whatever is_causal says, so it would serve such a drafter with attention it never trained.

trained_for(cache) is what a checkpoint records of its training cache (train_state.json): the target
the cache came from (for the printed commands), the longest reply in it (shards.DatasetRecord) and the
serving mode its data were rendered in (cache.json chat_mode: --thinking, --template-kwarg); an export
carries the last two in config.json under TRAINING_KEY (engines ignore it) so that `eval --target` can
say when it decodes past what the drafter ever drafted, or in another mode than it was trained for.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from shards import CacheConfig
from train.drafter.config import DrafterConfig

TRAINING_KEY = "dflash_training"  # config.json: {"longest_response": N, "chat_mode": {...}}, what training saw
# The trained_for entries an export carries under TRAINING_KEY (target_name is for the printed commands only).
EXPORTED_TRAINING = ("longest_response", "chat_mode", "chat_modes")


def trained_for(cache: CacheConfig) -> dict[str, Any]:
    """The train_state.json entries a checkpoint keeps of its training cache."""
    return {
        "target_name": cache.target.name,
        "longest_response": cache.dataset.longest_response if cache.dataset is not None else None,
        "chat_mode": cache.chat_mode,
        "chat_modes": cache.chat_modes,  # data in several modes: each of them (chat_mode is then None)
    }


def serve_commands(cfg: DrafterConfig, drafter_dir: str, target: str | None) -> list[str]:
    """The lines `dflash-train export` prints: a vLLM and an SGLang command that run the drafter on the
    block it was trained on, and which engine a sliding-window layout rules out."""
    target = shlex.quote(target) if target else "TARGET"
    drafter = str(drafter_dir)
    speculative = {"method": "dflash", "model": drafter, "num_speculative_tokens": cfg.block_size - 1}
    sliding = any(cfg.sliding_layers)
    vllm = [
        "VLLM_USE_V2_MODEL_RUNNER=1" if sliding and not all(cfg.sliding_layers) else "",
        f"vllm serve {target} --speculative-config {shlex.quote(json.dumps(speculative))}",
        "" if all(cfg.sliding_layers) else "--attention-backend flash_attn",
    ]
    lines = [
        f"serve it on the block it was trained on ({cfg.block_size} tokens: the anchor and "
        f"{cfg.block_size - 1} drafts per step; vLLM takes the drafts from num_speculative_tokens, never "
        "from config.json):",
        "  vLLM:   " + " ".join(word for word in vllm if word),
        f"  SGLang: python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {shlex.quote(drafter)} --speculative-num-draft-tokens {cfg.block_size}",
    ]
    if cfg.is_dflash2:
        lines.append(
            "  DFlash 2: vLLM needs the target's LM head unquantised (its selector takes the top-K of the full "
            "logits and refuses a quantised lm_head): serve a target whose lm_head is bf16"
        )
    if sliding and not cfg.sliding_causal:
        lines.append(
            "  is_causal false (sliding layers see their block both ways): vLLM honours it; SGLang's DFlash loader "
            "runs sliding layers causally whatever is_causal says, so serve this drafter with vLLM"
        )
    if sliding:
        lines.append(
            "  not llama.cpp: it runs every draft layer non-causally and its converter drops the sliding "
            f"window ({cfg.sliding_window} tokens), so these sliding layers would run as layers never trained"
        )
    return lines
