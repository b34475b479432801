"""FLOPs of one training step and the device's peak, for MFU (model FLOPs utilisation).

Counted: the matmuls of the trainable drafter and the frozen LM head, forward and backward, from the
shapes alone. A matmul of [rows, in] by [in, out] costs 2*rows*in*out FLOPs forward; its backward
costs the same again for the input gradient and again for the weight gradient. So:
  fc (context fusion)      rows T (every context token)  forward + weight grad (its input, the cached
                                                          target states, needs no gradient): 4 T in out
  q, o, MLP projections    rows Q = blocks x block size  6 Q in out
  k, v projections         rows T + Q (KV injection)     6 (T + Q) in out
  LM head (frozen)         rows Q, H -> V                forward + input grad: 4 Q H V
Not counted: attention scores and values (their cost depends on where the anchors fall: a block sees
its sequence's context before its anchor), norms, RoPE, losses, and the monitoring metrics' extra
pass over the vocabulary on metrics steps. The MFU derived from this count is a lower bound.
"""

from __future__ import annotations

import torch

from train.drafter.config import DrafterConfig

# Dense bf16 tensor-core peak per GPU (no sparsity), FLOP/s, by a substring of the device name.
# From the vendors' data sheets (SXM parts); a device not listed gets no MFU figure.
PEAK_BF16_FLOPS = (
    ("H200", 989.4e12),
    ("H100", 989.4e12),
    ("GH200", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
)


def drafter_step_flops(cfg: DrafterConfig, num_ctx_tokens: int, num_blocks: int) -> int:
    """Matmul FLOPs of one training step (forward and backward) over one packed batch; see the module doc."""
    H, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    T, Q = num_ctx_tokens, num_blocks * cfg.block_size
    q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    fc = 4 * T * cfg.fc_in_features * H
    per_layer = 6 * Q * H * q_out + 6 * Q * q_out * H + 6 * (T + Q) * H * kv_out * 2 + 6 * Q * H * F * 3
    head = 4 * Q * H * V
    return fc + cfg.num_layers * per_layer + head


def peak_flops(device: torch.device, compute_dtype: torch.dtype) -> tuple[float | None, str]:
    """(peak FLOP/s of one device for this compute dtype or None, the reason when None)."""
    if device.type != "cuda":
        return None, f"no peak known for {device.type}"
    name = torch.cuda.get_device_name(device)
    if compute_dtype != torch.bfloat16:
        return None, f"peaks are listed for bf16 only (compute {str(compute_dtype).removeprefix('torch.')})"
    for key, peak in PEAK_BF16_FLOPS:
        if key in name:
            return peak, name
    return None, f"no peak listed for {name}"
