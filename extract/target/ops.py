"""The target's pointwise math as plain torch functions: the zero-centred and gated RMSNorms, the
GatedDeltaNet gates, partial RoPE and the two gates of attention and the MLP (exact math:
shared/reference/qwen35-target.md section 2).

Every RMSNorm is zero-centred, y = norm(x) * (1 + w), computed in fp32, except the GatedDeltaNet output
norm: plain w, norm first, then a silu(z) gate. RoPE is NeoX rotate-half on the first rotary_dim dims
only, q/k normed per head before it. The log-decay g = -exp(A_log) * softplus(a + dt_bias) is fp32.
These run eager here; extract/target/pointwise.py wraps each in torch.compile on CUDA (one or two fused
kernels per call), and extract/target/fp8/feeds.py adds the quantisation of their outputs under FP8
compute.

Legend: T packed tokens, H hidden size, M/N heads, D head dim, R rotary dims, F MLP width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from extract.target.config import TargetConfig


def zero_centred_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * (1 + w) in fp32, cast back to x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + w.float())).to(x.dtype)


def add_zero_centred_rmsnorm(h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float):
    """(h + delta, norm(h + delta)): the residual add (in h's dtype, as HF) fused with the next norm."""
    h = h + delta
    return h, zero_centred_rmsnorm(h, w, eps)


def gated_rmsnorm(o_TMD: torch.Tensor, z_TMD: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """GatedDeltaNet output norm: plain weight, norm first, then silu(z) gate."""
    o32 = o_TMD.float()
    o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps)
    # HF rounds the normalised value to the activation dtype before the weight: keep that order.
    y = w * o32.to(o_TMD.dtype)
    return (y * F.silu(z_TMD.float())).to(o_TMD.dtype)


def gdn_gates(b_TM: torch.Tensor, a_TM: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias) in fp32 (<= 0; in half precision
    exp(A_log) could overflow to inf, HF's comment)."""
    return b_TM.sigmoid(), -A_log.float().exp() * F.softplus(a_TM.float() + dt_bias.float())


def partial_rope(x_TND: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE (rotate_half) on the first R dims of every head; the rest pass through."""
    R = cos_TR.shape[-1]
    x_rot, x_pass = x_TND[..., :R], x_TND[..., R:]
    rotated = torch.cat([-x_rot[..., R // 2 :], x_rot[..., : R // 2]], dim=-1)
    x_rot = x_rot * cos_TR.unsqueeze(1) + rotated * sin_TR.unsqueeze(1)
    return torch.cat([x_rot, x_pass], dim=-1)


def qk_norm_rope(q_TND, k_TMD, wq, wk, eps: float, cos_TR, sin_TR):
    """Per-head zero-centred RMSNorm of q and k, then partial RoPE (norm before RoPE, as HF)."""
    q_TND = partial_rope(zero_centred_rmsnorm(q_TND, wq, eps), cos_TR, sin_TR)
    k_TMD = partial_rope(zero_centred_rmsnorm(k_TMD, wk, eps), cos_TR, sin_TR)
    return q_TND, k_TMD


def sigmoid_gate(o_TND: torch.Tensor, gate_TND: torch.Tensor) -> torch.Tensor:
    """o * sigmoid(gate) flattened to [T, N*D]. gate_TND is a strided view into q_proj's output:
    reshaping it before the op would copy it (an eager pass over [T, N*D]); inside, it is one read."""
    return (o_TND * torch.sigmoid(gate_TND)).reshape(o_TND.shape[0], -1)


def silu_mul(gate_TF: torch.Tensor, up_TF: torch.Tensor) -> torch.Tensor:
    return F.silu(gate_TF) * up_TF


def rope_cos_sin(
    position_ids_T: torch.Tensor, cfg: TargetConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, R] for NeoX RoPE on the first R dims; angles in fp32, cast like HF."""
    R = cfg.rotary_dim
    inv_freq_R2 = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, R, 2, dtype=torch.float32, device=position_ids_T.device) / R)
    )
    freqs_TR2 = position_ids_T.float().unsqueeze(1) * inv_freq_R2
    angles_TR = torch.cat([freqs_TR2, freqs_TR2], dim=-1)
    return angles_TR.cos().to(dtype), angles_TR.sin().to(dtype)
