"""Time the ops that feed FP8 matmuls at 27B widths: the torch.compile'd FP8 twins of extract/target/fp8/feeds.py
against the Triton kernels of extract/target/fp8/kernels.py, with the bytes each must move and the rate.

    python -m tools.bench.fp8_feeds --out bench_fp8_feeds.json [--tokens 49152]

Per op: milliseconds per call (CUDA events, after warm-up), the minimum traffic (inputs read once,
outputs written once) and the rate that traffic implies, and the calls per forward of the 62 layers
extraction runs (47 GatedDeltaNet + 15 attention), so the saving per 49152-token batch is shown.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import torch

from extract.target.fp8 import feeds
from extract.target.fp8 import kernels as fp8_kernels
from extract.target.pointwise import Pointwise

H, F, MV, DV = 5120, 17408, 48, 128  # 27B hidden, MLP width, GatedDeltaNet value heads and head dim
NQ, D = 24, 256  # attention query heads and head dim
GDN_LAYERS, ATTENTION_LAYERS = 47, 15  # layers 0..61 (the deepest default tap is 61)
# op -> (calls per forward, bytes read and written per token)
OPS = {
    "zero_centred_rmsnorm_fp8_dense": (1, 2 * H + 2 * H + H),
    "add_zero_centred_rmsnorm_fp8_dense": (GDN_LAYERS - 1, 2 * 2 * H + 2 * H + 2 * H + H),
    "add_zero_centred_rmsnorm_fp8": (GDN_LAYERS + 2 * ATTENTION_LAYERS, 2 * 2 * H + 2 * H + H),
    "gated_rmsnorm_fp8": (GDN_LAYERS, 2 * MV * DV * 2 + MV * DV),
    "sigmoid_gate_fp8": (ATTENTION_LAYERS, 2 * NQ * D * 2 + NQ * D),
    "silu_mul_fp8": (GDN_LAYERS + ATTENTION_LAYERS, 2 * F * 2 + F),
}


def inputs(op: str, T: int, device: torch.device) -> tuple:
    """The op's arguments (rowwise quantisation: group 0) as extraction passes them."""
    return (*_tensors(op, T, device), 0)


def _tensors(op: str, T: int, device: torch.device) -> tuple:
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)

    w = 0.1 * rand(H)
    if op == "zero_centred_rmsnorm_fp8_dense":
        return rand(T, H), w, 1e-6
    if op.startswith("add_"):
        return rand(T, H), rand(T, H), w, 1e-6
    if op == "gated_rmsnorm_fp8":
        z = rand(T, 16384)[:, 10240:].view(T, MV, DV)  # z: a column slice of the q|k|v|z matmul
        return rand(T, MV, DV), z, rand(DV), 1e-6
    if op == "sigmoid_gate_fp8":
        gate = rand(T, NQ, 2 * D)[..., D:]  # the gate: per-head rows of q_proj's output
        return rand(T, NQ, D), gate
    gate_up = rand(T, 2 * F)  # gate and up: column slices of one matmul
    return gate_up[:, :F], gate_up[:, F:]


def time_ms(fn, args, iters: int) -> float:
    for _ in range(3):
        fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@click.command()
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False))
@click.option("--tokens", default=49152, show_default=True, help="Tokens per call (the token budget).")
@click.option("--iters", default=20, show_default=True)
def main(out_path: str, tokens: int, iters: int) -> None:
    if not torch.cuda.is_available():
        raise click.UsageError("this benchmark needs a CUDA GPU")
    if not fp8_kernels.available():
        raise click.UsageError("triton is not importable: the kernels cannot run")
    device = torch.device("cuda")
    pw = Pointwise(compiled=True)
    result = {"device": torch.cuda.get_device_name(device), "tokens": tokens, "ops": {}}
    saved_ms = 0.0
    print(f"{'op':<36} {'calls':>5} {'compiled ms':>11} {'triton ms':>9} {'GB':>6} {'TB/s c|t':>11}")
    for op, (calls, bytes_per_token) in OPS.items():
        args = inputs(op, tokens, device)
        compiled_ms = time_ms(getattr(pw, op), args, iters)
        triton_ms = time_ms(feeds.FEED_KERNELS[op], args, iters)
        gb = bytes_per_token * tokens / 1e9
        result["ops"][op] = {
            "calls_per_forward": calls,
            "compiled_ms": compiled_ms,
            "triton_ms": triton_ms,
            "min_traffic_gb": gb,
            "compiled_tb_per_s": gb / compiled_ms,
            "triton_tb_per_s": gb / triton_ms,
        }
        saved_ms += calls * (compiled_ms - triton_ms)
        print(
            f"{op:<36} {calls:>5} {compiled_ms:>11.3f} {triton_ms:>9.3f} {gb:>6.2f} "
            f"{gb / compiled_ms:>5.2f}|{gb / triton_ms:<5.2f}"
        )
        del args
    result["estimated_saved_ms_per_forward"] = saved_ms
    print(f"estimated saving per forward of {tokens} tokens (62 layers, calls counted as above): {saved_ms:.1f} ms")
    Path(out_path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
