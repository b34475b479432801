"""Benchmark the target's packed forward at 27B width against HF transformers and the matmul roofline.

Random weights (never zeros) for a subset of layers in the 3:1 layout (default 4: three
GatedDeltaNet + one attention), 49152 packed tokens (12 sequences of 4096 by default), CUDA
events after warm-up (the first calls autotune fla's Triton kernels). Reports:
  - tokens/s of `TargetModel.forward_packed`, projected to the full 64 layers (time x 64 / layers),
    with the pointwise ops compiled (the CUDA default) and eager;
  - the same for HF transformers' qwen3_5 text model on the same tokens as a [12, 4096] batch, with
    the same weights (fla is used by HF when installed), plus the bf16 relative L2 gap of a tap;
  - a bf16 matmul rate measured here (49152x5120 @ 5120x17408) and the roofline it implies:
    FLOPs/token = 2 x layer matmul params + causal attention (4 x heads x head_dim x mean context);
  - per-op timings of every available backend (gated delta rule, conv, attention) at 27B shapes,
    which is how the kernel defaults were chosen.
Prints a short table and writes JSON to --out. On an H200 it takes about two minutes.

    python -m tools.bench.target --out bench_target.json [--layers 4] [--no-hf]
    python -m tools.bench.target --tiny --out /tmp/b.json      # CPU smoke run on a tiny config
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch

from extract.target.config import TargetConfig
from extract.target.kernels import ATTENTION_BACKENDS, CONV_BACKENDS, GDN_BACKENDS, select_kernels
from extract.target.model import TargetModel
from tools.fixtures.tiny_target import qwen35_27b_config_dict, random_weights, tiny_config_dict

logger = logging.getLogger(__name__)
FULL_DEPTH = 64


def _timer(device: torch.device) -> Callable[[Callable[[], Any], int, int], float]:
    """Mean seconds per call after `warmup` calls; CUDA events on GPU, perf_counter on CPU."""

    def run(fn, warmup: int, iters: int) -> float:
        for _ in range(warmup):
            fn()
        if device.type != "cuda":
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - start) / iters
        torch.cuda.synchronize(device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return begin.elapsed_time(end) / 1e3 / iters

    return run


def matmul_tflops(device: torch.device, timer, m: int, k: int, n: int) -> float:
    gen = torch.Generator(device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(m, k, generator=gen, device=device).to(dtype)
    b = torch.randn(k, n, generator=gen, device=device).to(dtype)
    seconds = timer(lambda: a @ b, 3, 10)
    return 2 * m * k * n / seconds / 1e12


def flops_per_token(cfg: TargetConfig, num_layers: int, seq_len: int) -> float:
    """2 x matmul params of the first `num_layers` layers + causal attention score/value FLOPs."""
    H, F = cfg.hidden_size, cfg.intermediate_size
    gdn = H * (cfg.linear_conv_dim + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads) + cfg.linear_value_dim * H
    attn_proj = H * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    attn_proj += cfg.num_attention_heads * cfg.head_dim * H
    mean_context = (seq_len + 1) / 2
    attn_core = 4 * cfg.num_attention_heads * cfg.head_dim * mean_context
    total = 0.0
    for i in range(num_layers):
        total += 2 * 3 * H * F
        # The layer types repeat with the config's period (3:1), also past a benchmark's layer subset.
        full = cfg.is_full_attention(i % cfg.num_hidden_layers)
        total += 2 * attn_proj + attn_core if full else 2 * gdn
    return total


def _batch(cfg: TargetConfig, tokens: int, seq_len: int, device: torch.device):
    num_seqs = tokens // seq_len
    gen = torch.Generator(device).manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (num_seqs * seq_len,), generator=gen, device=device)
    pos = torch.arange(seq_len, device=device).repeat(num_seqs)
    cu = torch.arange(0, num_seqs * seq_len + 1, seq_len, dtype=torch.int32, device=device)
    return ids, pos, cu, num_seqs


def op_timings(cfg: TargetConfig, tokens: int, seq_len: int, device: torch.device, timer) -> dict[str, float]:
    """Milliseconds per call of each importable backend, one layer's worth of each op."""
    ids, _, cu, _ = _batch(cfg, tokens, seq_len, device)
    T = ids.shape[0]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(2)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    q, k = (
        rnd(T, cfg.linear_num_key_heads, cfg.linear_key_head_dim),
        rnd(T, cfg.linear_num_key_heads, cfg.linear_key_head_dim),
    )
    v = rnd(T, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
    g = -torch.rand(T, cfg.linear_num_value_heads, generator=gen, device=device) * 0.1
    beta = torch.rand(T, cfg.linear_num_value_heads, generator=gen, device=device).to(dtype)
    x, w = rnd(T, cfg.linear_conv_dim), rnd(cfg.linear_conv_dim, cfg.linear_conv_kernel_dim, scale=0.5)
    aq, ak, av = (
        rnd(T, n, cfg.head_dim) for n in (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_key_value_heads)
    )
    out: dict[str, float] = {}
    cases = [("gated_delta", b, dict(gated_delta=b)) for b in GDN_BACKENDS]
    cases += [("conv", b, dict(conv=b)) for b in CONV_BACKENDS]
    cases += [("attention", b, dict(attention=b)) for b in ATTENTION_BACKENDS]
    for op, backend, forced in cases:
        try:
            choice = select_kernels(device, allow_slow_kernels=True, **forced)
        except Exception as exc:
            logger.info("op %s backend %s unavailable: %s", op, backend, str(exc).splitlines()[0][:120])
            continue
        batch = choice.prepare(cu, T, device)
        slow = backend in ("torch", "sdpa")
        fn = {
            "gated_delta": lambda choice=choice, batch=batch: choice.gated_delta_rule(q, k, v, g, beta, batch),
            "conv": lambda choice=choice, batch=batch: choice.conv1d_silu(x, w, batch),
            "attention": lambda choice=choice, batch=batch: choice.attention(aq, ak, av, batch, cfg.head_dim**-0.5),
        }[op]
        with torch.inference_mode():
            try:
                out[f"{op}/{backend}_ms"] = 1e3 * timer(fn, 1 if slow else 3, 2 if slow else 10)
            except Exception as exc:  # e.g. fla's attention at head_dim 256 exceeds the H200's shared memory
                logger.info("op %s backend %s failed: %s", op, backend, str(exc).splitlines()[0][:160])
                out[f"{op}/{backend}_error"] = str(exc).splitlines()[0][:160]
    return out


def bench_ours(cfg, state, tokens, seq_len, device, timer, warmup, iters, allow_slow_kernels, compile_pointwise=None):
    kernels = select_kernels(device, allow_slow_kernels=allow_slow_kernels, compile_pointwise=compile_pointwise)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = TargetModel.from_state_dict(cfg, state, kernels, dtype=dtype)
    ids, pos, cu, _ = _batch(cfg, tokens, seq_len, device)
    taps = sorted({min(1, cfg.num_hidden_layers - 1), cfg.num_hidden_layers - 1})
    seconds = timer(lambda: model.forward_packed(ids, pos, cu, taps), warmup, iters)
    hidden = model.forward_packed(ids, pos, cu, taps)
    backends = dict(
        gated_delta=kernels.gated_delta_backend, conv=kernels.conv_backend, attention=kernels.attention_backend
    )
    return seconds, hidden, taps, backends


def bench_hf(cfg_dict, state, tokens, seq_len, device, timer, warmup, iters, taps):
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf_cfg = Qwen3_5TextConfig(
        **{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type", "dtype")}
    )
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = Qwen3_5TextModel(hf_cfg)
    # Our parameter names are HF's text-model names: load the same weights.
    params = {n: state[n].to(dtype) for n, _ in hf.named_parameters() if n in state}
    params["norm.weight"] = torch.zeros(cfg_dict["hidden_size"], device=device, dtype=dtype)
    hf.load_state_dict(params, strict=False, assign=True)
    hf.rotary_emb = type(hf.rotary_emb)(hf_cfg).to(device)  # buffers were on meta
    hf = hf.eval()
    ids, _, _, num_seqs = _batch(TargetConfig.from_hf_dict(cfg_dict), tokens, seq_len, device)
    ids_BL = ids.view(num_seqs, seq_len)

    def run():
        with torch.inference_mode():
            return hf(input_ids=ids_BL, output_hidden_states=True, use_cache=False)

    seconds = timer(run, warmup, iters)
    out = run()
    hidden = torch.stack([out.hidden_states[t + 1].reshape(-1, cfg_dict["hidden_size"]) for t in taps], dim=1)
    hf = out = None  # free the HF model before the next measurement
    return seconds, hidden


@click.command()
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Where to write the JSON results.",
)
@click.option(
    "--layers",
    type=int,
    default=4,
    show_default=True,
    help="Layers to build, in the 3:1 layout (a multiple of 4 projects exactly to 64).",
)
@click.option("--tokens", type=int, default=49152, show_default=True, help="Packed tokens per forward.")
@click.option("--seq-len", type=int, default=4096, show_default=True, help="Length of each packed sequence.")
@click.option("--warmup", type=int, default=2, show_default=True, help="Untimed forwards (fla autotunes here).")
@click.option("--iters", type=int, default=5, show_default=True, help="Timed forwards.")
@click.option("--hf/--no-hf", default=True, show_default=True, help="Also time HF transformers' qwen3_5.")
@click.option("--ops/--no-ops", default=True, show_default=True, help="Also time every backend of each op.")
@click.option("--allow-slow-kernels", is_flag=True, help="Run even if a fast kernel is missing on CUDA.")
@click.option("--tiny", is_flag=True, help="CPU smoke run: tiny config, 512 tokens, no roofline claims.")
def main(out_path, layers, tokens, seq_len, warmup, iters, hf, ops, allow_slow_kernels, tiny) -> None:
    """Tokens/s of the target's packed forward at 27B width, beside HF and the matmul roofline."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if layers <= 0 or tokens <= 0 or seq_len <= 0 or tokens < seq_len:
        raise click.BadParameter(
            f"need layers, tokens, seq_len > 0 and tokens >= seq_len; got {layers}, {tokens}, {seq_len}"
        )
    device = torch.device("cpu" if tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("no CUDA device: run on the GPU machine, or pass --tiny for a CPU smoke run")
    if tiny:
        cfg_dict, tokens, seq_len, warmup, iters = tiny_config_dict(num_hidden_layers=layers), 512, 128, 1, 2
    else:
        cfg_dict = qwen35_27b_config_dict(num_hidden_layers=layers)
    cfg = TargetConfig.from_hf_dict(cfg_dict)
    timer = _timer(device)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "layers": layers,
        "tokens": tokens - tokens % seq_len,
        "seq_len": seq_len,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    tokens = result["tokens"]

    result["matmul_tflops"] = matmul_tflops(device, timer, tokens, cfg.hidden_size, cfg.intermediate_size)
    fpt = flops_per_token(cfg, FULL_DEPTH, seq_len) if not tiny else flops_per_token(cfg, layers, seq_len)
    depth = FULL_DEPTH if not tiny else layers
    result["gflop_per_token_full_depth"] = fpt / 1e9
    result["roofline_tokens_per_s"] = result["matmul_tflops"] * 1e12 / fpt

    state = random_weights(cfg, seed=0, device=device, with_head=False)
    ours_s, ours_hidden, taps, backends = bench_ours(
        cfg, state, tokens, seq_len, device, timer, warmup, iters, allow_slow_kernels
    )
    result["backends"] = backends
    result["ours_ms_per_forward"] = ours_s * 1e3
    result["ours_tokens_per_s_full_depth"] = tokens / (ours_s * depth / layers)
    result["ours_fraction_of_roofline"] = result["ours_tokens_per_s_full_depth"] / result["roofline_tokens_per_s"]
    if device.type == "cuda":
        eager_s, eager_hidden, _, _ = bench_ours(
            cfg, state, tokens, seq_len, device, timer, 1, iters, allow_slow_kernels, compile_pointwise=False
        )
        result["ours_eager_pointwise_tokens_per_s_full_depth"] = tokens / (eager_s * depth / layers)
        gap = (eager_hidden.float() - ours_hidden.float()).norm() / eager_hidden.float().norm()
        result["rel_l2_compiled_vs_eager_pointwise"] = gap.item()
        del eager_hidden
    if hf:
        gc.collect()
        hf_s, hf_hidden = bench_hf(cfg_dict, state, tokens, seq_len, device, timer, warmup, iters, taps)
        result["hf_ms_per_forward"] = hf_s * 1e3
        result["hf_tokens_per_s_full_depth"] = tokens / (hf_s * depth / layers)
        result["speedup_vs_hf"] = hf_s / ours_s
        # Tap 0 is a layer output in both (HF's last entry is after the final norm: not compared).
        diff = (ours_hidden[:, 0].float() - hf_hidden[:, 0].float()).norm() / hf_hidden[:, 0].float().norm()
        result["rel_l2_vs_hf_tap0"] = diff.item()
    del state
    gc.collect()
    if ops:
        result["op_ms"] = op_timings(cfg, tokens, seq_len, device, timer)
    result["bench_seconds"] = time.perf_counter() - started

    rows = [
        ("matmul bf16 TFLOP/s", result["matmul_tflops"]),
        ("roofline tok/s (64 layers)", result["roofline_tokens_per_s"]),
        ("ours tok/s (projected)", result["ours_tokens_per_s_full_depth"]),
        ("ours fraction of roofline", result["ours_fraction_of_roofline"]),
    ]
    if "ours_eager_pointwise_tokens_per_s_full_depth" in result:
        rows += [("ours tok/s, eager pointwise", result["ours_eager_pointwise_tokens_per_s_full_depth"])]
    if hf:
        rows += [
            ("HF tok/s (projected)", result["hf_tokens_per_s_full_depth"]),
            ("speed-up vs HF", result["speedup_vs_hf"]),
            ("rel L2 vs HF (tap 0)", result["rel_l2_vs_hf_tap0"]),
        ]
    rows += [(k, v) for k, v in result.get("op_ms", {}).items()]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2, sort_keys=True))
    table = "\n".join(
        f"  {name:<34} {value:>12.4g}" if isinstance(value, float) else f"  {name:<34} {value}" for name, value in rows
    )
    logger.info("backends %s\n%s", backends, table)
    logger.info("wrote %s (%.0f s)", out_path, result["bench_seconds"])


if __name__ == "__main__":
    main()
