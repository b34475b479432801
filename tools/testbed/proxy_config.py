"""The proxy target's architecture: Qwen3.5-27B's structure at 7.97M parameters.

Same config fields, layer pattern and weight names as the release (tools/fixtures/tiny_target.py
writes them): 8 layers in the 3:1 layout (GatedDeltaNet, GatedDeltaNet, GatedDeltaNet, gated
attention), GatedDeltaNet with grouped value heads at the 27B's ratio of 3 (2 q/k heads, 6 v heads,
head dim 64), attention with 4 query heads over 2 kv heads of dim 64, partial RoPE 0.25, SwiGLU
MLP, untied embeddings (as the 27B: a drafter reads embed_tokens and lm_head as two matrices).

Size: hidden 256, MLP 512, vocab 4096 -> 7,968,712 parameters, 15.2 MiB in bf16: one safetensors
file under the 16 MiB a GPU run can hand back. Embeddings and LM head are 2.1M of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.fixtures.tiny_target import tiny_config_dict
from tools.testbed.tokenizer import VOCAB_SIZE

PROXY_TARGET_DIR = Path(__file__).parent / "proxy_target"  # the committed checkpoint and tokenizer
NAMING = "multimodal"  # the 27B release's layout: model.language_model.*, config.json with text_config


def proxy_config_dict(*, eos_token_id: int, pad_token_id: int) -> dict[str, Any]:
    """The plain text config (HF Qwen3_5TextConfig fields); the special ids come from the tokenizer."""
    cfg = tiny_config_dict(num_hidden_layers=8, hidden_size=256, vocab_size=VOCAB_SIZE)
    cfg.update(
        {
            "intermediate_size": 512,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "head_dim": 64,
            "max_position_embeddings": 8192,
            "dtype": "bfloat16",
            "bos_token_id": pad_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
        }
    )
    return cfg
