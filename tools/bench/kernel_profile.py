"""Where a training step's kernel time goes: torch.profiler over a few steps, every kernel classified
by name into one of CATEGORIES, summed per step (tools/bench/train.py --profile).

On CUDA the profiled events are the device kernels (also those a replayed CUDA graph launches) plus
memcpy / memset; on CPU, where there are no kernels, the aten ops by their self CPU time, so the same
table and JSON come out of a tiny CPU run (tests). The classifier reads names only: the rules below
were written against the names the H200 runs print (cuBLAS sm90_xmma_* and nvjet_*, inductor's
triton_{poi,red,per,tem}_fused_*, aten's templated kernels).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

CATEGORIES = (
    "gemm",
    "attention",
    "softmax/loss",
    "elementwise",
    "copy/cast",
    "reduction",
    "optimizer",
    "other",
)

# Ordered (category, pattern) rules; the first match wins, so the specific rules come first:
# "cutlass" names attention kernels as well as GEMMs, "index_elementwise_kernel" and
# "elementwise_kernel<...direct_copy_kernel_cuda...>" contain "elementwise_kernel", and inductor's
# reductions that fuse a log_softmax are loss work, not a generic reduction.
_RULES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (category, re.compile(pattern, re.IGNORECASE))
    for category, pattern in (
        ("optimizer", r"adam|multi_tensor_apply|optimizer\.step"),
        # flex attention's compiled kernels are inductor templates (triton_tem_fused_*); flash / fmha / sdpa.
        ("attention", r"triton_tem_fused|flex_attention|flash|fmha|attention|sdpa|_efficient_attention"),
        (
            "gemm",
            r"gemm|nvjet|xmma|cutlass|cublas|gemv|splitkreduce|^aten::(mm|addmm|bmm|baddbmm|_scaled_mm)$",
        ),
        (
            "softmax/loss",
            r"softmax|logsumexp|cross_entropy|nll_loss|^aten::(_log_softmax|_softmax)",
        ),
        # Casts and copies: aten's copy kernel (also every dtype cast), cat, memcpy, inductor kernels that
        # only cast, and on CPU the copy ops. A memset is a fill: elementwise.
        (
            "copy/cast",
            r"direct_copy_kernel|copy_kernel|catarraybatchedcopy|memcpy"
            r"|^triton_poi_fused__to_copy_\d+$|^triton_poi_fused_clone_\d+$"
            r"|^aten::(copy_|_to_copy|to|clone|cat|contiguous|_copy_from|_copy_from_and_resize)$",
        ),
        ("other", r"index_elementwise|scatter_gather|indexselect|index_select|embedding|radixsort|scan|sort"),
        (
            "reduction",
            r"reduce_kernel|triton_red_|triton_per_|reduction"
            r"|^aten::(sum|mean|amax|amin|max|min|norm|linalg_vector_norm|all|any|cumsum|argmax|topk|std|var)$",
        ),
        (
            "elementwise",
            r"elementwise_kernel|triton_poi_|vectorized|unrolled|pointwise|memset"
            r"|^aten::(add|add_|sub|mul|mul_|div|div_|neg|exp|exp_|log|rsqrt|pow|silu|silu_backward|sigmoid"
            r"|where|fill_|zero_|zeros_like|ones_like|masked_fill|clamp|clamp_min|clamp_max|cos|sin|lt|le|gt|ge|eq"
            r"|ne|bitwise_and|bitwise_or|logical_not|abs|sqrt|reciprocal|lerp_|addcmul_|addcdiv_|maximum|minimum)$",
        ),
    )
)


def classify_kernel(name: str) -> str:
    """The CATEGORIES entry of one CUDA kernel (or, on CPU, aten op) name; 'other' when no rule matches."""
    for category, pattern in _RULES:
        if pattern.search(name):
            return category
    return "other"


def summarise_kernels(kernels: list[tuple[str, float]], num_steps: int, top: int = 15) -> dict:
    """Per-step table of (name, microseconds) events: ms and share of kernel time per category, kernel
    counts, the copy/cast kernel count per step, and the `top` most expensive kernel names."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    per_category = {c: {"us": 0.0, "count": 0} for c in CATEGORIES}
    per_name: dict[str, float] = {}
    for name, us in kernels:
        entry = per_category[classify_kernel(name)]
        entry["us"] += us
        entry["count"] += 1
        per_name[name] = per_name.get(name, 0.0) + us
    total_us = sum(e["us"] for e in per_category.values())
    categories = {
        c: {
            "ms_per_step": e["us"] / 1e3 / num_steps,
            "percent": 100.0 * e["us"] / total_us if total_us > 0 else 0.0,
            "kernels_per_step": e["count"] / num_steps,
        }
        for c, e in per_category.items()
    }
    ranked = sorted(per_name.items(), key=lambda item: -item[1])[:top]
    return {
        "steps": num_steps,
        "kernel_ms_per_step": total_us / 1e3 / num_steps,
        "kernels_per_step": len(kernels) / num_steps,
        "copy_cast_kernels_per_step": per_category["copy/cast"]["count"] / num_steps,
        "categories": categories,
        "top_kernels": [
            {"name": name, "category": classify_kernel(name), "ms_per_step": us / 1e3 / num_steps}
            for name, us in ranked
        ],
    }


def profile_kernels(run_step: Callable[[], None], num_steps: int, device: torch.device) -> dict:
    """Run `run_step` num_steps times under torch.profiler; the summarise_kernels table of what ran."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            run_step()
        if cuda:
            torch.cuda.synchronize(device)
    if cuda:
        kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        kernels = [
            (e.name, e.self_cpu_time_total)
            for e in prof.events()
            if e.device_type == DeviceType.CPU and not e.is_async and e.name.startswith("aten::")
        ]
    summary = summarise_kernels(kernels, num_steps)
    summary["source"] = "CUDA kernels" if cuda else "CPU aten ops (self time)"
    if not kernels:
        summary["warning"] = "the profiler recorded no kernels: profile with --modes eager instead"
    return summary


def format_profile(summary: dict) -> str:
    """The category table as text: ms per step, share of kernel time, kernels per step."""
    lines = [
        f"kernel time per step: {summary['kernel_ms_per_step']:.1f} ms over {summary['kernels_per_step']:.0f} "
        f"kernels ({summary['source']}, mean of {summary['steps']} steps); copy/cast kernels per step: "
        f"{summary['copy_cast_kernels_per_step']:.0f}",
        f"  {'category':<13} {'ms/step':>9} {'%':>6} {'kernels':>8}",
    ]
    for c, e in summary["categories"].items():
        lines.append(f"  {c:<13} {e['ms_per_step']:>9.1f} {e['percent']:>5.1f}% {e['kernels_per_step']:>8.0f}")
    if "warning" in summary:
        lines.append(f"  WARNING: {summary['warning']}")
    lines.append("  top kernels:")
    for k in summary["top_kernels"][:10]:
        lines.append(f"    {k['ms_per_step']:>8.2f} ms  {k['category']:<13} {k['name'][:110]}")
    return "\n".join(lines)
