"""Compile every FP8 feed kernel (extract/target/fp8/kernels.py) for Hopper (sm_90) and Ada (sm_89) ahead of
time, with no GPU: triton's wheel carries the CUDA backend and ptxas. Run as a script
(tests/extract/target/fp8/test_fp8_kernels.py does, in a subprocess without TRITON_INTERPRET, which the CPU test session
sets); prints one JSON line per kernel variant and target with the PTX counts the test checks."""

import json
import os
import re

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from extract.target.fp8 import kernels as K  # noqa: E402

# (compute capability, HW_E4M3 as fp8_kernels._launch sets it there)
TARGETS = ((90, True), (89, False))
cases = {
    "_add_rmsnorm_quant_kernel": (
        K._add_rmsnorm_quant_kernel,
        {
            "h_ptr": "*bf16",
            "delta_ptr": "*bf16",
            "w_ptr": "*bf16",
            "h_out_ptr": "*bf16",
            "dense_ptr": "*bf16",
            "x8_ptr": "*fp8e4nv",
            "scale_ptr": "*fp32",
            "stride_h": "i32",
            "stride_delta": "i32",
            "G": "i32",
            "eps": "fp32",
            "X": "constexpr",
            "HAS_DELTA": "constexpr",
            "KEEP_DENSE": "constexpr",
            "P": "constexpr",
            "C": "constexpr",
        },
        dict(X=5120, HAS_DELTA=True, KEEP_DENSE=True, P=64, C=128),
    ),
    "_gated_rmsnorm_quant_kernel": (
        K._gated_rmsnorm_quant_kernel,
        {
            "o_ptr": "*bf16",
            "z_ptr": "*bf16",
            "w_ptr": "*bf16",
            "x8_ptr": "*fp8e4nv",
            "scale_ptr": "*fp32",
            "stride_o": "i32",
            "stride_z": "i32",
            "G": "i32",
            "eps": "fp32",
            "M": "constexpr",
            "P": "constexpr",
            "D": "constexpr",
        },
        dict(M=48, P=64, D=128),
    ),
    "_sigmoid_gate_quant_kernel": (
        K._sigmoid_gate_quant_kernel,
        {
            "o_ptr": "*bf16",
            "gate_ptr": "*bf16",
            "x8_ptr": "*fp8e4nv",
            "scale_ptr": "*fp32",
            "stride_o": "i32",
            "stride_gate": "i32",
            "stride_gate_head": "i32",
            "G": "i32",
            "N": "constexpr",
            "D": "constexpr",
            "R": "constexpr",
            "C": "constexpr",
        },
        dict(N=24, D=256, R=64, C=128),
    ),
    "_silu_mul_quant_kernel": (
        K._silu_mul_quant_kernel,
        {
            "gate_ptr": "*bf16",
            "up_ptr": "*bf16",
            "x8_ptr": "*fp8e4nv",
            "scale_ptr": "*fp32",
            "stride_gate": "i32",
            "stride_up": "i32",
            "G": "i32",
            "X": "constexpr",
            "P": "constexpr",
            "C": "constexpr",
        },
        dict(X=17408, P=16, C=128),
    ),
}
# 0f46C00000 is 24576.0 = 1.5 * 2^14: the constant of the software e4m3 rounding (fp8_kernels._to_e4m3).
INSTRUCTIONS = (
    "div.rn.f32",
    "div.full.f32",
    "max.NaN.f32",
    "cvt.rn.satfinite.e4m3x2.f32",
    "cvt.rz.f16.f32",
    "0f46C00000",
)

if __name__ == "__main__":
    for name, (fn, signature, shape) in cases.items():
        signature = {**signature, "GROUPED": "constexpr", "EXACT_CASTS": "constexpr", "HW_E4M3": "constexpr"}
        for arch, hw_e4m3 in TARGETS:
            for grouped in (False, True):  # rowwise, and per 128 channels (block mode)
                consts = {**shape, "GROUPED": grouped, "EXACT_CASTS": True, "HW_E4M3": hw_e4m3}
                constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
                source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
                kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32))
                ptx = kernel.asm["ptx"]
                counts = {op: len(re.findall(re.escape(op), ptx)) for op in INSTRUCTIONS}
                row = {"kernel": name, "arch": arch, "grouped": grouped, "cubin": "cubin" in kernel.asm, **counts}
                print(json.dumps(row))
