"""Benchmark of the drafter training step on one GPU: query tokens/s and MFU, CUDA graphs vs eager.

Random data of fixed shapes (no cache on disk; tools/bench/train_workload.py), the same step as
dflash-train (train.step's build_step_state and StepRunner), no metrics steps. Two sizes by default:
  27b     the Qwen3.5-27B drafter: 5 layers, hidden 5120, MLP 17408, 32/8 heads of 128, vocab 248320,
          block 16, token budget 49152, num_blocks default (halved on out-of-memory, reported)
  4b      a launch-bound size: 4B-target width 2560 (MLP 9216, 32/8 heads of 128), budget 8192
  27b2    the published Qwen3.8-27B-DFlash2 layout at the same width: 5 sliding layers (2048), block 8,
          the block convolutions and the selector (rank 256, top 16) with its loss; run it next to 27b
          (--sizes 27b,27b2) and compare ms per query token (us/q tok)
MFU divides by the datasheet dense bf16 peak (with --fp8 too: the FLOPs are the same, so FP8's speed-up
shows as MFU above what bf16 can reach) (train/metrics/flops.py, as the training CLI does: 989 TFLOP/s
on H100/H200, the PaLM/torchtitan definition). The bf16 matmul rate this GPU actually reaches (8192^3)
is measured too, and the step's share of it is printed as its own figure ("of matmul"): how much a
faster kernel could still win, not MFU.

FLOPs per step: tools/bench/train_workload.py (step_flops).

Sliding layers and long contexts: --layer-types (repeatable: one layout per run, e.g. all full vs the
published sliding,sliding,sliding,sliding,full) with --sliding-window, and --seq-lens (the packed
sequence length, i.e. the context length, one run each). Each result also counts the kv tiles the
flex BlockMasks visit per query tile (full and sliding masks): what the kernel skips outside the window.

Long positions (--position-offset N): every packed sequence is a piece of a long sample at positions
N.. (anchors past its first window tokens), to check the step's time and memory there (issue 31).

Kernel-time split (--profile): after the timed steps, --profile-steps more run under torch.profiler
and every CUDA kernel is classified by name (tools/bench/kernel_profile.py: GEMM, attention, softmax/loss,
elementwise, copy/cast, reduction, optimizer, other); the table is printed and stored per result
under "profile". The step's own options (STEP_FIELDS: --checkpoint-layers, the compute dtype, the
loss chunk, the elementwise cuts and DFlash 2's --selector-gold) are dflash-train's flags, generated from TrainConfig, so one
run can compare a setting on and off; --num-blocks overrides the density (e.g. 4096 per 49152 tokens
with --checkpoint-layers). Each result also reports ms per query token (step time / query tokens). The
step runs as dflash-train's defaults run it: --fp8 auto is linears+head on a GPU with FP8 tensor cores and
torchao (the result's step_options name the mode that ran); --fp8 off measures the bf16 step.

Usage: python -m tools.bench.train --out bench_train.json [--sizes 27b,4b] [--steps 5]
       python -m tools.bench.train --sizes 27b --modes graphs --seq-lens 4096,32768 \
           --layer-types full,full,full,full,full --layer-types sliding,sliding,sliding,sliding,full
       python -m tools.bench.train --sizes 27b --modes graphs --steps 3 --profile
       python -m tools.bench.train --sizes 27b --modes graphs --steps 3 --profile --compare-plain
           (the step without the elementwise cuts, then with them; or give --no-weight-copies etc.)
       python -m tools.bench.train --sizes 27b --modes graphs --steps 5 --compare-fp8
           (bf16, --fp8 linears and --fp8 linears+head side by side; needs torchao, SM 8.9+)
       python -m tools.bench.train --sizes 27b --modes graphs --steps 3 --num-blocks 4096 --checkpoint-layers
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import tempfile
import time
from dataclasses import dataclass
from functools import partial

import click
import torch

from shards import CacheConfig, TargetInfo
from shards.common.cli_options import build_config, config_options, from_options, option_fields
from shards.common.compile_cache import CompileCacheConfig, use_compile_cache
from shards.common.startup import StartupClock
from shards.format import canonical_precision
from tools.bench.kernel_profile import format_profile, profile_kernels
from tools.bench.train_workload import (
    SIZES,
    Size,
    bf16_matmul_peak,
    drafter_config,
    fill_random_batch,
    mean_keys_per_layer,
    parse_layer_types,
    step_flops,
    visited_kv_tiles,
)
from train.blocks import default_num_blocks, sample_blocks
from train.config import TrainConfig
from train.drafter.fp8 import FP8_MODES, FP8_RECIPES, resolve_fp8
from train.drafter.model import count_parameters
from train.metrics.flops import peak_flops
from train.metrics.sums import COUNT
from train.resolve import ResolvedRun
from train.step import StepRunner, build_step_state

log = logging.getLogger("bench_train")


# TrainConfig options of the step itself that the benchmark exposes as dflash-train's own flags.
STEP_FIELDS = (
    "checkpoint_layers",
    "compute_dtype",
    "loss_chunk_blocks",
    "weight_copies",
    "fused_loss",
    "compile_pointwise",
    "selector_gold",
    "fp8",
    "fp8_recipe",
)
# The elementwise cuts (train/precision.py, fused_loss.py, pointwise.py) and how the table names them.
CUTS = {"weight_copies": "copies", "fused_loss": "loss", "compile_pointwise": "compile"}


@dataclass(frozen=True)
class RunOptions:
    """What every configuration of one benchmark invocation shares besides size and mode."""

    steps: int  # timed steps per configuration, after warm-up
    profile_steps: int = 0  # steps run under torch.profiler after the timed ones; 0 = no profile
    layer_types: list[str] | None = None  # None = all full
    sliding_window: int | None = None
    num_blocks: int | None = None  # None = the size's own (or dflash-train's default for the budget)
    position_offset: int = 0  # > 0: every sequence is a piece of a long sample starting at this position
    step_options: dict = dataclasses.field(default_factory=dict)  # STEP_FIELDS -> TrainConfig values


@dataclass(frozen=True)
class Peaks:
    """The two denominators: MFU's (datasheet) and the measured matmul rate's (None where unknown)."""

    datasheet: float | None  # dense bf16 FLOP/s from the vendor's data sheet (train/metrics/flops.py)
    matmul: float | None  # bf16 8192^3 matmul FLOP/s measured on this GPU


def _fp8_mode(size: Size, options: RunOptions, device: torch.device) -> str:
    """--fp8 as dflash-train resolves it here (auto: train/drafter/fp8.py), so a result names the mode that ran."""
    opts, defaults = options.step_options, TrainConfig.__dataclass_fields__
    return resolve_fp8(
        opts.get("fp8", defaults["fp8"].default),
        device,
        arch=drafter_config(size, options.layer_types, options.sliding_window).arch,
        compute_dtype=canonical_precision(
            opts.get("compute_dtype", defaults["compute_dtype"].default), ("bfloat16", "float32")
        ),
        head_shape=(size.vocab, size.hidden),
        recipe=opts.get("fp8_recipe", defaults["fp8_recipe"].default),
    )


def bench_one(size: Size, mode: str, num_blocks: int, options: RunOptions, device: torch.device, peaks: Peaks) -> dict:
    """One configuration: set-up, warm-up, `options.steps` timed steps, then the optional profile."""
    steps, cuda = options.steps, device.type == "cuda"
    clock = StartupClock(device)  # start-up per phase; the first configuration's is a fresh process's
    dcfg = drafter_config(size, options.layer_types, options.sliding_window)
    cc = CacheConfig(
        target=TargetInfo(
            name="random",
            config_hash="random",
            hidden_size=size.hidden,
            num_layers=64,
            vocab_size=size.vocab,
            dtype="bfloat16",
        ),
        tap_layer_ids=list(range(size.taps)),
        token_budget=size.token_budget,
        max_seqs=64,
        mask_token_id=size.vocab - 1,
    )
    with tempfile.TemporaryDirectory() as tmp:
        cfg = from_options(
            TrainConfig,
            dict(
                cache=tmp,
                out_dir=tmp,
                device=str(device),
                block_size=size.block_size,
                num_blocks=num_blocks,
                num_layers=size.layers,
                cuda_graphs=mode == "graphs",
                **options.step_options,
            ),
        )
        cfg = dataclasses.replace(cfg, fp8=_fp8_mode(size, options, device))
    run = ResolvedRun(
        cache_config=cc,
        drafter=dcfg,
        num_blocks=num_blocks,
        train_ids=[0],
        eval_ids=[],
        steps_per_epoch=1,
        total_steps=10_000,
        warmup_steps=400,
    )
    gen = torch.Generator().manual_seed(0)
    head = {
        "embed_tokens": torch.randn(size.vocab, size.hidden, device=device, dtype=torch.bfloat16) * 0.02,
        "lm_head": torch.randn(size.vocab, size.hidden, device=device, dtype=torch.bfloat16) * 0.02,
    }
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    state = build_step_state(cfg, run, head, device, fp8_emulate=not cuda)  # CPU: the tests' tiny sizes
    fill_random_batch(state, size, gen, options.position_offset, dcfg.attention_window or 0)
    clock.mark("model")
    blocks = sample_blocks(
        input_ids_T=state.batch.input_ids_T,
        position_ids_T=state.batch.position_ids_T,
        loss_mask_T=state.batch.loss_mask_T,
        cu_seqlens_S1=state.batch.cu_seqlens_S1,
        anchor_mask_T=state.batch.anchor_mask_T,
        num_blocks=num_blocks,
        block_size=size.block_size,
        mask_token_id=size.vocab - 1,
    )
    mean_keys = mean_keys_per_layer(blocks, dcfg)
    state.layout.update(blocks.seq_start_N, blocks.anchor_N)
    tiles = visited_kv_tiles(state.layout)
    t_setup = time.perf_counter()
    runner = StepRunner(state, cuda_graphs=mode == "graphs", warmup_iters=2, clock=clock)
    runner.run(with_metrics=False)
    clock.mark("first_step")
    startup = clock.log(f"{size.name} {mode}")
    runner.run(with_metrics=False)
    _sync(device)
    setup_s = time.perf_counter() - t_setup
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.run(with_metrics=False)
    _sync(device)
    step_s = (time.perf_counter() - t0) / steps
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    sums = state.totals.sums
    loss = float(sums.view("loss/total") / sums.view("steps"))
    selector_steps = float(sums.view("selector_loss" + COUNT))  # DFlash 2 only
    selector_loss = float(sums.view("selector_loss")) / selector_steps if selector_steps else None
    flops = step_flops(size, dcfg, num_blocks, mean_keys)
    total = sum(flops.values())
    result = {
        "size": size.name,
        "arch": dcfg.arch,
        "mode": mode,
        "num_blocks": num_blocks,
        "query_tokens": num_blocks * size.block_size,
        "context_tokens": size.token_budget,
        "step_ms": step_s * 1e3,
        "query_tokens_per_s": num_blocks * size.block_size / step_s,
        "context_tokens_per_s": size.token_budget / step_s,
        "ms_per_query_token": step_s * 1e3 / (num_blocks * size.block_size),
        "tflops": total / step_s / 1e12,
        "mfu": total / step_s / peaks.datasheet if peaks.datasheet else None,
        "matmul_peak_share": total / step_s / peaks.matmul if peaks.matmul else None,
        "flops_per_step": flops,
        "layer_types": list(dcfg.layer_types),
        "sliding_window": dcfg.attention_window,
        "seq_len": size.seq_len,
        "position_offset": options.position_offset,
        "mean_keys_per_query": sum(mean_keys) / len(mean_keys),
        "mean_keys_per_layer": mean_keys,
        "kv_tiles_per_q_tile": tiles,
        "peak_mem_gib": peak_mem,
        "setup_s": setup_s,
        "startup": startup,
        "mean_loss": loss,
        "mean_selector_loss": selector_loss,
        "params": count_parameters(dcfg),
        "step_options": {**options.step_options, "fp8": cfg.fp8},
        "device": device.type,
    }
    if options.profile_steps:
        result["profile"] = profile_kernels(partial(runner.run, with_metrics=False), options.profile_steps, device)
        log.info("%s %s kernel profile:\n%s", size.name, mode, format_profile(result["profile"]))
    del runner, state, head, blocks
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_size(size: Size, modes: list[str], options: RunOptions, device: torch.device, peaks: Peaks) -> list[dict]:
    """Every mode of one size; out of memory halves the blocks and retries (the failure is a result too)."""
    num_blocks = options.num_blocks or size.num_blocks or default_num_blocks(size.token_budget, size.block_size)
    results = []
    for mode in modes:
        while True:
            try:
                results.append(bench_one(size, mode, num_blocks, options, device, peaks))
                log.info("%s %s: %s", size.name, mode, _row(results[-1]))
                break
            except torch.cuda.OutOfMemoryError:
                gc.collect()
                torch.cuda.empty_cache()
                results.append(
                    {
                        "size": size.name,
                        "mode": mode,
                        "num_blocks": num_blocks,
                        "step_options": {**options.step_options, "fp8": _fp8_mode(size, options, device)},
                        "device": device.type,
                        "error": "out of memory",
                    }
                )
                smaller = (num_blocks // 2) // 8 * 8
                log.warning("%s %s: out of memory at %d blocks; retrying with %d", size.name, mode, num_blocks, smaller)
                if smaller < 8:
                    break
                num_blocks = smaller
    return results


def _step_variants(step_options: dict, compare_plain: bool, compare_fp8: bool) -> list[dict]:
    """The step options of each configuration to run: as given; --compare-plain adds the step without the
    elementwise cuts before it; --compare-fp8 runs each of those with every FP8_MODES value."""
    variants = [{**step_options, **{name: False for name in CUTS}}, step_options] if compare_plain else [step_options]
    if compare_fp8:
        variants = [
            {**v, "fp8": fp8} if fp8 != "off" else {**v, "fp8": fp8, "fp8_recipe": FP8_RECIPES[0]}
            for v in variants
            for fp8 in FP8_MODES
        ]
    return variants


def _layout_name(r: dict) -> str:
    types = r.get("layer_types") or []
    if not any(t == "sliding_attention" for t in types):
        return "full"
    return "".join("s" if t == "sliding_attention" else "f" for t in types) + f"/{r['sliding_window']}"


def _step_name(r: dict) -> str:
    """The step variant of a result: its elementwise cuts and activation checkpointing, e.g. 'copies+loss+ckpt'."""
    opts = r.get("step_options") or {}
    cuda = r.get("device", "cuda") == "cuda"
    names = [
        short
        for name, short in CUTS.items()
        if opts.get(name) or (name == "compile_pointwise" and opts.get(name) is None and cuda)
    ]
    names += ["ckpt"] if opts.get("checkpoint_layers") else []
    fp8 = opts.get("fp8") or "off"
    if fp8 != "off":
        names.append(
            ("fp8" if fp8 == "linears" else "fp8+head") + ("/row" if opts.get("fp8_recipe") == "rowwise" else "")
        )
    return "+".join(names) or "plain"


def _row(r: dict) -> str:
    if "error" in r:
        return f"{r['size']:<5} {r['mode']:<7} {_step_name(r):<22} {r['num_blocks']:>6}  {r['error']}"
    tiles = r.get("kv_tiles_per_q_tile") or {}
    tile_text = "/".join(f"{tiles[k]:.0f}" for k in ("full", "sliding") if k in tiles)
    mfu = f"{100 * r['mfu']:>6.1f}%" if r["mfu"] is not None else f"{'-':>7}"
    share = r.get("matmul_peak_share")
    of_matmul = f"{100 * share:>8.1f}%" if share is not None else f"{'-':>9}"
    mem = f"{r['peak_mem_gib']:>7.1f}" if r["peak_mem_gib"] is not None else f"{'-':>7}"
    return (
        f"{r['size']:<5} {r['mode']:<7} {_step_name(r):<22} {_layout_name(r):<12} {r['seq_len']:>7} {r['num_blocks']:>6} "
        f"{r['query_tokens_per_s']:>12,.0f} {r['context_tokens_per_s']:>10,.0f} {r['step_ms']:>9.1f} "
        f"{1e3 * r['ms_per_query_token']:>8.2f} {r['tflops']:>8.1f} {mfu} {of_matmul} {mem} {r['mean_keys_per_query']:>8.0f} "
        f"{tile_text:>9}"
    )


@click.command()
@click.option("--out", "out_path", default="bench_train.json", show_default=True, help="JSON results file.")
@click.option(
    "--sizes",
    default="27b,4b",
    show_default=True,
    help="Comma-separated: 27b, 4b, launch, 27b2 (DFlash 2 in the published layout), 27b1-8 (DFlash 1 in "
    "that layout: 27b2's baseline), tiny and tiny2 (CPU tests).",
)
@click.option("--modes", default="graphs,eager", show_default=True, help="Comma-separated: graphs, eager.")
@click.option("--steps", default=5, show_default=True, help="Timed steps per configuration (after warm-up).")
@click.option(
    "--layer-types",
    "layouts",
    multiple=True,
    help="Drafter layer kinds, e.g. sliding,sliding,sliding,sliding,full; repeat the option to compare layouts. Default: all full.",
)
@click.option(
    "--sliding-window",
    default=2048,
    show_default=True,
    help="Window of the sliding layers (tokens, the query included).",
)
@click.option(
    "--seq-lens",
    default=None,
    help="Comma-separated packed sequence lengths (context length) to run each size at; default: the size's own.",
)
@click.option(
    "--num-blocks",
    default=None,
    type=int,
    help="Draft blocks per batch (query tokens = blocks x 16); default: the size's own (27b: 2048).",
)
@click.option(
    "--position-offset",
    default=0,
    show_default=True,
    help="Long-position anchors: every packed sequence is a piece of a long sample whose positions start here "
    "(e.g. 98304), anchors past its first sliding-window tokens (dflash-extract --max-seq-len).",
)
@click.option(
    "--compare-plain",
    is_flag=True,
    help="Run every configuration twice: first with the elementwise cuts off (the step before them), then "
    "with the step flags as given.",
)
@click.option(
    "--compare-fp8",
    is_flag=True,
    help="Run every configuration three times: --fp8 off (bf16), linears, linears+head (the step flags as "
    "given otherwise), so one run shows FP8's speed-up next to bf16. MFU stays against the bf16 datasheet peak.",
)
@click.option("--profile", is_flag=True, help="Profile --profile-steps more steps: kernel time by category.")
@click.option("--profile-steps", default=3, show_default=True, help="Steps under torch.profiler with --profile.")
@click.option(
    "--device",
    "device_name",
    default="cuda",
    show_default=True,
    help="cuda, or cpu (only for the tiny size: tests; eager mode, no MFU, no peak memory, --fp8 emulated).",
)
@config_options(TrainConfig, exclude=[o.name for o in option_fields(TrainConfig) if o.name not in STEP_FIELDS])
@config_options(CompileCacheConfig)
def main(
    out_path: str,
    sizes: str,
    modes: str,
    steps: int,
    layouts: tuple[str, ...],
    sliding_window: int,
    seq_lens: str | None,
    num_blocks: int | None,
    position_offset: int,
    compare_plain: bool,
    compare_fp8: bool,
    profile: bool,
    profile_steps: int,
    device_name: str,
    compile_cache: str | None,
    no_compile_cache: bool,
    **step_options,
) -> None:
    """Drafter training throughput (query tokens/s per GPU) and MFU, CUDA graphs vs eager."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    if device_name == "cuda":  # where the step compiles
        use_compile_cache(
            build_config(CompileCacheConfig, dict(compile_cache=compile_cache, no_compile_cache=no_compile_cache))
        )
    mode_list = [m.strip() for m in modes.split(",")]
    if device_name == "cpu":
        if "graphs" in mode_list:
            raise click.BadParameter("--modes graphs needs CUDA; pass --modes eager with --device cpu")
        device, peaks = torch.device("cpu"), Peaks(None, None)
    elif device_name == "cuda":
        if not torch.cuda.is_available():
            raise click.ClickException("bench_train needs a CUDA GPU (or --device cpu --sizes tiny)")
        device = torch.device("cuda:0")
        torch.cuda.set_device(device)
        datasheet, why = peak_flops(device, torch.bfloat16)
        peaks = Peaks(datasheet, bf16_matmul_peak(device))
        log.info(
            "MFU against the datasheet bf16 dense peak: %s; measured bf16 matmul (8192^3): %.1f TFLOP/s",
            f"{datasheet / 1e12:.1f} TFLOP/s ({why})" if datasheet else f"none ({why})",
            peaks.matmul / 1e12,
        )
    else:
        raise click.BadParameter(f"--device {device_name}: must be cuda or cpu")
    if num_blocks is not None and num_blocks < 1:
        raise click.BadParameter(f"--num-blocks {num_blocks}: must be >= 1")
    if profile and profile_steps < 1:
        raise click.BadParameter(f"--profile-steps {profile_steps}: must be >= 1")
    log.info("FLOPs/step = 6*P_layers*Q + 6*L*(2*H*M*D)*T + 12*L*N*D*keys*Q + 4*V*H*Q + 4*(K*H)*H*T")
    layer_specs = [parse_layer_types(spec) for spec in layouts] or [None]
    results = []
    for name in sizes.split(","):
        base = SIZES[name.strip()]
        lengths = [int(v) for v in seq_lens.split(",")] if seq_lens else [base.seq_len]
        for length in lengths:
            if not 1 <= length <= base.token_budget:
                raise click.BadParameter(f"--seq-lens {length}: must be in [1, token budget {base.token_budget}]")
            for types in layer_specs:
                if types is not None and len(types) != base.layers:
                    raise click.BadParameter(f"--layer-types {','.join(types)}: {base.name} has {base.layers} layers")
                size = dataclasses.replace(base, seq_len=length)
                for chosen in _step_variants(step_options, compare_plain, compare_fp8):
                    options = RunOptions(
                        steps=steps,
                        profile_steps=profile_steps if profile else 0,
                        layer_types=types,
                        sliding_window=sliding_window,
                        num_blocks=num_blocks,
                        position_offset=position_offset,
                        step_options=chosen,
                    )
                    results += bench_size(size, mode_list, options, device, peaks)
    header = (
        f"{'size':<5} {'mode':<7} {'step':<22} {'layout':<12} {'seq len':>7} {'blocks':>6} {'query tok/s':>12} "
        f"{'ctx tok/s':>10} {'step ms':>9} {'us/q tok':>8} {'TFLOP/s':>8} {'MFU':>7} {'of matmul':>9} {'mem GiB':>7} {'keys/q':>8} "
        f"{'kv tiles':>9}"
    )
    click.echo(header)
    click.echo("-" * len(header))
    for r in results:
        click.echo(_row(r))
    for r in results:
        if "profile" in r:
            click.echo(
                f"\n{r['size']} {r['mode']} {_step_name(r)} {r['num_blocks']} blocks:\n{format_profile(r['profile'])}"
            )
    with open(out_path, "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "datasheet_bf16_peak_flops": peaks.datasheet,
                "measured_bf16_matmul_flops": peaks.matmul,
                "torch": torch.__version__,
                "results": results,
            },
            f,
            indent=1,
        )
    click.echo(f"wrote {out_path}")


if __name__ == "__main__":
    main()
