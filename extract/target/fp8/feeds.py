"""The FP8 twins of the pointwise ops that feed linear layers (--compute fp8): each runs the op of
extract/target/ops.py, then quantises the output that the next matmuls read, per token (group 0) or per
token per `group` channels (block mode), flattened to [T, X]. The `_dense` twins also return the dense
output, for the dense layers reading the same input (GatedDeltaNet's in_proj_a/b).

FEED_KERNELS maps each twin to the Triton kernel of extract/target/fp8/kernels.py that computes it in
one read of each row (same arguments, same outputs); Pointwise (extract/target/pointwise.py) picks one
or the other. The linear layers that consume the outputs: extract/target/fp8/linear.py.
"""

from __future__ import annotations

from extract.target.fp8 import kernels as fp8_kernels
from extract.target.fp8.quantization import quantize_activations_fp8
from extract.target.ops import add_zero_centred_rmsnorm, gated_rmsnorm, sigmoid_gate, silu_mul, zero_centred_rmsnorm

# The twins' names: Pointwise.feed runs f"{op}_fp8" (or f"{op}_fp8_dense") in place of op.
FP8_VARIANTS = (
    "zero_centred_rmsnorm_fp8",
    "zero_centred_rmsnorm_fp8_dense",
    "add_zero_centred_rmsnorm_fp8",
    "add_zero_centred_rmsnorm_fp8_dense",
    "gated_rmsnorm_fp8",
    "sigmoid_gate_fp8",
    "silu_mul_fp8",
)


# Compiled together with the op (Pointwise), the quantisation adds no pass over memory. One function
# (one code object) each: dynamo counts recompiles per code object, and a shared wrapper would exceed
# its limit under fullgraph=True.
def zero_centred_rmsnorm_fp8(x, w, eps: float, group: int):
    return quantize_activations_fp8(zero_centred_rmsnorm(x, w, eps), group)


def zero_centred_rmsnorm_fp8_dense(x, w, eps: float, group: int):
    y = zero_centred_rmsnorm(x, w, eps)
    return (y, *quantize_activations_fp8(y, group))


def add_zero_centred_rmsnorm_fp8(h, delta, w, eps: float, group: int):
    h, y = add_zero_centred_rmsnorm(h, delta, w, eps)
    return (h, *quantize_activations_fp8(y, group))


def add_zero_centred_rmsnorm_fp8_dense(h, delta, w, eps: float, group: int):
    h, y = add_zero_centred_rmsnorm(h, delta, w, eps)
    return (h, y, *quantize_activations_fp8(y, group))


def gated_rmsnorm_fp8(o_TMD, z_TMD, w, eps: float, group: int):
    y_TMD = gated_rmsnorm(o_TMD, z_TMD, w, eps)
    return quantize_activations_fp8(y_TMD.reshape(y_TMD.shape[0], -1), group)


def sigmoid_gate_fp8(o_TND, gate_TND, group: int):
    return quantize_activations_fp8(sigmoid_gate(o_TND, gate_TND), group)


def silu_mul_fp8(gate_TF, up_TF, group: int):
    return quantize_activations_fp8(silu_mul(gate_TF, up_TF), group)


# The FP8_VARIANTS functions as fp8_kernels computes them (same arguments, same outputs).
FEED_KERNELS = {
    "zero_centred_rmsnorm_fp8": lambda x, w, eps, group: fp8_kernels.add_rmsnorm_quant(x, None, w, eps, group=group),
    "zero_centred_rmsnorm_fp8_dense": lambda x, w, eps, group: fp8_kernels.add_rmsnorm_quant(
        x, None, w, eps, keep_dense=True, group=group
    ),
    "add_zero_centred_rmsnorm_fp8": lambda h, d, w, eps, group: fp8_kernels.add_rmsnorm_quant(
        h, d, w, eps, group=group
    ),
    "add_zero_centred_rmsnorm_fp8_dense": lambda h, d, w, eps, group: fp8_kernels.add_rmsnorm_quant(
        h, d, w, eps, keep_dense=True, group=group
    ),
    "gated_rmsnorm_fp8": fp8_kernels.gated_rmsnorm_quant,
    "sigmoid_gate_fp8": fp8_kernels.sigmoid_gate_quant,
    "silu_mul_fp8": fp8_kernels.silu_mul_quant,
}
