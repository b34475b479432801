"""Benchmark dflash-extract end to end at 27B width on a realistic length mix.

A random-weight target at the full 64-layer 27B shape is built on the GPU (no checkpoint on disk:
54 GB would not fit the machine's disk beside the cache), then the real extraction loop
(`extract.runner.extract_batches`: dataset loading, packing, forward, pinned copies, writer thread,
durable shards) runs over a lognormal length mix (median ~1.5K tokens, max 8K). Reports, per GPU, for the configurations --configs names (run in this order: dense ones first, since
the switch to FP8 compute is in place):
  no_write        the loop without writing (compute only)
  write_bf16      writing a bf16 cache to local disk
  write_fp8       writing an fp8 cache
  fp8_no_write    FP8 compute (linear layers on e4m3 matmuls), compute only
  fp8_write_fp8   FP8 compute writing an fp8 cache (the issue-16 goal: >= 20K tokens/s per H200)
  write_pca       writing a projected cache (--pca-rank R fp8 codes; the issue-30 goal: within 3% of
                  write_fp8's tokens/s), and fp8_write_pca with FP8 compute (of fp8_write_fp8's). The
                  projection is estimated once, before the first of them, from --pca-sample-tokens tokens
                  of the mix (its forward, moment and eigendecomposition timed: pca_estimate)
and the same names with `_before` (every memory-traffic cut off: ForwardOptions all False and the
writer's host copies on the forward's stream, i.e. the code path before those cuts) or, for
fp8_write_fp8, `_no_<cut>` (that one cut off: fuse_residual, split_conv, concat_linears, copy_stream),
each as tokens/s of the short run ("end to end": from the first batch's launch until the last shard is
durable, so it includes filling and draining the pipeline once) and as the steady rate between the
first and the last batch finishing (what a long extraction sees), with the write rate and the time the
loop waited for the disk. Before the first FP8 configuration, the per-tap relative error of FP8 compute
against dense compute (same weights, one full batch) is measured, next to the error of fp8 storage
alone. The JSON at --out is rewritten after every step, so a timeout loses only the step it cut.
Also (--long-samples 65536,131072): each length as one sample through the target whole and stored as
pieces (dflash-extract --max-seq-len), in the last configuration's settings, twice (the second timed):
tokens/s of the sample through the target and the GPU's peak memory (issue 31).
Also (--hf-layers > 0): HF transformers' qwen3_5 (fla when installed) on the same samples in
length-sorted, padded batches of the same token count, on a layer subset projected to 64
(tools/bench/hf_padded.py).
Start-up (under "startup"): the seconds of building the weights, the FP8 conversion (--startup-only), the
first and the second batch of the first configuration, with torch.compile's share, as dflash-extract logs
them; --compile-cache DIR / --no-compile-cache as dflash-extract's. tools/bench/startup.py runs it cold and warm.

    python -m tools.bench.extract --out bench_extract.json --cache-dir /tmp/bench_cache --hf-layers 0 \
        --configs no_write,write_fp8,fp8_no_write,fp8_write_fp8 --timed-batches 6
    python -m tools.bench.extract --out bench_extract_pca.json --cache-dir /tmp/bench_cache --hf-layers 0 \
        --configs write_fp8,write_pca,fp8_write_fp8,fp8_write_pca --pca-rank 3200 --timed-batches 8
    python -m tools.bench.extract --out bench_extract_cuts.json --cache-dir /tmp/bench_cache --hf-layers 0 \
        --configs write_fp8_before,write_fp8,fp8_write_fp8_before,fp8_write_fp8 --timed-batches 8 --profile
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from pathlib import Path

import click
import numpy as np
import torch

from extract.cache_dir import build_cache_config
from extract.config import ExtractConfig
from extract.dataset.index import Sample, SampleLoader, scan_dataset, write_parquet
from extract.dataset.packing import PackingConfig, load_batch, plan_batches
from extract.projection import estimate_projection
from extract.runner import extract_batches
from extract.target.config import TargetConfig
from extract.target.kernels import select_kernels
from extract.target.model import TargetModel
from extract.target.options import ForwardOptions
from extract.writer import AsyncShardWriter
from shards import create_cache, write_cache_config
from shards.codec import decode_hidden, encode_hidden
from shards.common.cli_options import build_config, config_options
from shards.common.compile_cache import CompileCacheConfig, use_compile_cache
from shards.common.errors import user_errors
from shards.common.startup import StartupClock
from shards.projection import write_projection
from tools.bench.hf_padded import hf_padded_tokens_per_s
from tools.bench.scratch import CACHE, DATA, claim_scratch_dir, fresh_folder, remove_folder
from tools.fixtures.tiny_target import qwen35_27b_config_dict, random_weights, tiny_config_dict

log = logging.getLogger("bench_extract")


def length_mix(num_samples: int, median: float, sigma: float, max_len: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), sigma, size=num_samples), 16, max_len).astype(np.int64)


def write_mix(path: Path, lengths: np.ndarray, vocab: int, seed: int) -> None:
    rng = np.random.default_rng(seed + 1)
    samples = []
    for i, n in enumerate(lengths.tolist()):
        ids = rng.integers(0, vocab, size=n).astype(np.int32)
        mask = (np.arange(n) >= n // 4).astype(np.uint8)
        samples.append(Sample(f"mix-{i}", ids, mask))
    write_parquet(path, samples)


BASE_CONFIGS = {  # name -> (compute, storage, write)
    "no_write": ("dense", "bf16", False),
    "write_bf16": ("dense", "bf16", True),
    "write_fp8": ("dense", "fp8", True),
    "fp8_no_write": ("fp8", "bf16", False),
    "fp8_write_fp8": ("fp8", "fp8", True),
    "write_pca": ("dense", "pca", True),
    "fp8_write_pca": ("fp8", "pca", True),
}
# The memory-traffic cuts a configuration can switch off: the ForwardOptions fields and the writer's
# side stream for host copies.
CUTS = tuple(f.name for f in dataclasses.fields(ForwardOptions)) + ("copy_stream",)
CONFIGS = {}  # name -> (compute, storage, write, cuts switched off)
for _name, _spec in BASE_CONFIGS.items():
    CONFIGS[_name] = (*_spec, frozenset())
    CONFIGS[f"{_name}_before"] = (*_spec, frozenset(CUTS))
for _cut in CUTS:
    CONFIGS[f"fp8_write_fp8_no_{_cut}"] = (*BASE_CONFIGS["fp8_write_fp8"], frozenset({_cut}))


class DiscardingSink:
    """A ShardSink that drops every batch: the extraction loop timed without the copy-out and disk.
    done_s: when each batch's forward finished on the device (a thread waits on one event per batch)."""

    def __init__(self, device: torch.device) -> None:
        self.bytes_written, self.shards_written, self.wait_s = 0, 0, 0.0
        self.done_s: list[float] = []
        self._events: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True) if device.type == "cuda" else None
        if self._thread is not None:
            self._thread.start()

    def submit(self, batch_id, arrays, hidden_nKH, topk, samples) -> None:
        if self._thread is None:  # CPU: the forward has finished when it returns
            self.done_s.append(time.monotonic())
            return
        event = torch.cuda.Event()
        event.record()
        self._events.put(event)

    def _run(self) -> None:
        while (event := self._events.get()) is not None:
            event.synchronize()
            self.done_s.append(time.monotonic())

    def close(self) -> None:
        if self._thread is not None:
            self._events.put(None)
            self._thread.join()

    close_quietly = close


class TimedWriter(AsyncShardWriter):
    """The real writer, noting when each shard became durable (done_s)."""

    def __init__(self, *args, **kwargs) -> None:
        self.done_s: list[float] = []
        super().__init__(*args, **kwargs)

    def _write(self, job) -> None:
        super()._write(job)
        self.done_s.append(time.monotonic())


def _sink(
    cfg: ExtractConfig, cache_cfg, device: torch.device, write: bool, copy_stream: bool
) -> TimedWriter | DiscardingSink:
    if not write:
        return DiscardingSink(device)
    return TimedWriter(cfg.out_dir, cache_cfg, device, num_buffers=cfg.writer_buffers, copy_stream=copy_stream)


def steady_tokens_per_s(tokens_per_batch: list[int], done_s: list[float]) -> float | None:
    """Tokens of batches 2..N over the time from batch 1 finishing to batch N finishing."""
    if len(done_s) < 2 or done_s[-1] <= done_s[0]:
        return None
    return sum(tokens_per_batch[1 : len(done_s)]) / (done_s[-1] - done_s[0])


def _rel_err_per_tap(got_nKH: torch.Tensor, want_nKH: torch.Tensor, taps: list[int]) -> dict[str, float]:
    return {
        str(tap): ((got_nKH[:, j].float() - want_nKH[:, j].float()).norm() / want_nKH[:, j].float().norm()).item()
        for j, tap in enumerate(taps)
    }


def _save(out_path: str, result: dict) -> None:
    Path(out_path).write_text(json.dumps(result, indent=2))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward_batch(
    model: TargetModel, index, batch, taps: list[int], device: torch.device, token_budget: int
) -> torch.Tensor:
    """The taps [n, K, H] of one packed batch's real tokens (for the FP8-vs-dense error)."""
    arrays = load_batch(SampleLoader(index), batch, PackingConfig(token_budget=token_budget))
    n = batch.num_tokens
    ids = torch.from_numpy(arrays["input_ids"][:n]).to(device)
    pos = torch.from_numpy(arrays["position_ids"][:n]).to(device)
    cu = torch.from_numpy(arrays["cu_seqlens"][: len(batch.sample_ids) + 1])
    return model.forward_packed(ids, pos, cu, taps)


def _estimate(model, cache_cfg, index, plan, device: torch.device, token_budget: int, result: dict):
    """P and D of the *_pca configurations, as dflash-extract estimates them; the time it took in result."""
    _sync(device)
    t0 = time.perf_counter()
    taps = cache_cfg.tap_layer_ids
    projection_RF, scale_F, kept = estimate_projection(
        cache_cfg, plan.batches, lambda b: _forward_batch(model, index, b, taps, device, token_budget), device
    )
    _sync(device)
    result["pca_estimate"] = {
        "rank": cache_cfg.projection.rank,
        "sample_tokens": cache_cfg.projection.sample_tokens,
        "seconds": time.perf_counter() - t0,
        "variance_kept": kept,
    }
    log.info("projection estimated: %s", result["pca_estimate"])
    return projection_RF, scale_F


MATMUL_KERNEL_WORDS = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "f8f8bf16")  # in GEMM kernel names


def kernel_profile(
    model: TargetModel, index, batch, taps: list[int], device: torch.device, token_budget: int, top: int = 25
) -> dict:
    """GPU time per kernel name over one forward (torch.profiler), most first, and the share of the
    GEMMs in it: what is left besides the matmuls, by kernel. On CPU: self CPU time per op instead."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]) as prof:
        _forward_batch(model, index, batch, taps, device, token_budget)
        _sync(device)
    us_per_name: dict[str, float] = {}
    for event in prof.events():
        if on_cuda and event.device_type != DeviceType.CUDA:
            continue
        us = event.time_range.elapsed_us() if on_cuda else event.self_cpu_time_total
        us_per_name[event.name] = us_per_name.get(event.name, 0.0) + us
    total_us = sum(us_per_name.values())
    matmul_us = sum(us for n, us in us_per_name.items() if any(w in n.lower() for w in MATMUL_KERNEL_WORDS))
    ranked = sorted(us_per_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "tokens": batch.num_tokens,
        "total_ms": total_us / 1e3,
        "matmul_ms": matmul_us / 1e3,
        "top": [{"name": n, "ms": us / 1e3, "share": us / max(total_us, 1e-9)} for n, us in ranked],
    }


def long_sample_run(
    model, target, taps, base: ExtractConfig, length: int, write: bool, root: Path, device, projection=None
) -> dict:
    """One sample of `length` tokens extracted whole and stored as pieces, twice; the second run's figures.
    projection: (P, D) when `base` stores a projected cache (the last configuration was a *_pca one)."""
    data = root / DATA / f"long-{length}.parquet"
    write_mix(data, np.array([length]), target.vocab_size, seed=length)
    cfg = dataclasses.replace(base, data=str(data), max_seq_len=length)
    index = scan_dataset(data, vocab_size=target.vocab_size, token_budget=length)
    plan = plan_batches(index, cfg.packing)
    runs = []
    for _ in range(2):  # the first compiles and grows the allocator
        remove_folder(root, CACHE)
        cache_cfg = build_cache_config(cfg, target, taps, plan, index)
        create_cache(cfg.out_dir, cache_cfg, _zero_head(target))
        if projection is not None:
            cache_cfg.projection.checksum = write_projection(cfg.out_dir, *projection)
            write_cache_config(cfg.out_dir, cache_cfg)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sink = _sink(cfg, cache_cfg, device, write, True)
        s = extract_batches(model, cfg, cache_cfg, index, plan.batches, device, sink)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        runs.append({"seconds": s.seconds, "sample_tokens_per_s": length / s.seconds, "peak_gib": peak})
    log.info("long sample of %d tokens: %.0f tok/s, peak %.1f GiB", length, runs[1]["sample_tokens_per_s"], peak)
    return {**runs[1], "pieces": len(plan.batches), "first_seconds": runs[0]["seconds"], "write": write}


def _zero_head(target: TargetConfig) -> dict[str, torch.Tensor]:
    vocab, hidden = target.vocab_size, target.hidden_size
    return {
        "embed_tokens": torch.zeros(vocab, hidden, dtype=torch.bfloat16),
        "lm_head": torch.zeros(vocab, hidden, dtype=torch.bfloat16),
        "final_norm": torch.zeros(hidden, dtype=torch.bfloat16),
    }


@click.command()
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False))
@click.option(
    "--cache-dir",
    default="/tmp/bench_extract_cache",
    show_default=True,
    help="The benchmark's own directory (new, empty or made by an earlier run: another is refused, untouched): "
    "each configuration's cache in cache/, the length mix in data/ (tools/bench/scratch.py).",
)
@click.option("--num-samples", default=400, show_default=True, help="Samples in the length mix (~2K tokens each).")
@click.option(
    "--timed-batches",
    "--batches",
    "timed_batches",
    default=8,
    show_default=True,
    help="Timed batches per configuration (the first configuration of each compute mode is preceded "
    "by two warm-up batches).",
)
@click.option("--layers", default=64, show_default=True, help="Target layers (64 = the real 27B depth).")
@click.option(
    "--hf-layers", default=4, show_default=True, help="Layers for the HF comparison (projected to 64); 0 = skip."
)
@click.option("--token-budget", default=49152, show_default=True)
@click.option(
    "--configs",
    default="no_write,write_bf16,write_fp8",
    show_default=True,
    help=f"Comma-separated configurations to run, from {', '.join(CONFIGS)}; the fp8_* ones need an "
    "FP8 GPU (sm_89+) and add the FP8-vs-dense per-tap error.",
)
@click.option(
    "--tiny", is_flag=True, help="CPU smoke run on the tiny config (checks the script, measures nothing useful)."
)
@click.option(
    "--long-samples",
    default="",
    help="Comma-separated sample lengths (e.g. 65536,131072) each extracted whole and stored as pieces, in the "
    "last configuration's settings: tokens/s and peak GPU memory (under 'long_samples' in --out).",
)
@click.option(
    "--profile",
    is_flag=True,
    help="After the last configuration, profile one forward in its settings: GPU time per kernel name, "
    "GEMMs vs the rest (printed, and under 'profile' in --out).",
)
@click.option(
    "--pca-rank",
    default=3200,
    show_default=True,
    help="Codes per token of the *_pca configurations (3200 = 1/8 of 5 x 5120).",
)
@click.option(
    "--pca-sample-tokens", default=262144, show_default=True, help="Tokens the *_pca projection is estimated from."
)
@click.option(
    "--startup-only",
    is_flag=True,
    help="Start-up as dflash-extract sees it (tools/bench/startup.py runs it cold, then warm): the first "
    "configuration's first batches right after the weights, no FP8-vs-dense error measured before them.",
)
@config_options(CompileCacheConfig)
@user_errors()
def main(
    out_path,
    cache_dir,
    num_samples,
    timed_batches,
    layers,
    hf_layers,
    token_budget,
    configs,
    tiny,
    long_samples,
    profile,
    pca_rank,
    pca_sample_tokens,
    startup_only,
    **compile_options,
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    names = [c.strip() for c in configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or not names:
        raise click.BadParameter(f"{unknown or configs!r}: choose from {', '.join(CONFIGS)}", param_hint="--configs")
    if timed_batches < 1:
        raise click.BadParameter(f"{timed_batches}: must be at least 1", param_hint="--timed-batches")
    names = sorted(dict.fromkeys(names), key=lambda c: CONFIGS[c][0] == "fp8")  # dense first: FP8 is in place
    use_fp8 = any(CONFIGS[c][0] == "fp8" for c in names)
    device = torch.device("cpu" if tiny else "cuda")
    root = claim_scratch_dir(cache_dir)  # before any work: a directory of the user's is refused, untouched
    work, cache_dir = fresh_folder(root, DATA), root / CACHE
    cfg_dict = tiny_config_dict() if tiny else qwen35_27b_config_dict(num_hidden_layers=layers)
    target = TargetConfig.from_hf_dict(cfg_dict)
    taps = target.default_tap_layer_ids(5) if layers >= 8 else list(range(1, layers))
    median, max_len = (40.0, 200) if tiny else (1450.0, 8192)
    lengths = length_mix(num_samples, median, 0.75, max_len, seed=0)
    data = work / "mix.parquet"
    write_mix(data, lengths, target.vocab_size, seed=0)
    index = scan_dataset(data, vocab_size=target.vocab_size, token_budget=token_budget)
    plan = plan_batches(index, PackingConfig(token_budget=token_budget))
    log.info(
        "length mix: median %d, mean %d, max %d; %s", np.median(lengths), lengths.mean(), lengths.max(), plan.summary()
    )
    warm = 2  # two batch lengths: torch.compile specialises on the first, goes dynamic on the second
    need = warm + timed_batches
    if len(plan.batches) < need:
        raise click.UsageError(
            f"the mix packs into {len(plan.batches)} batches, need {need}: raise --num-samples or lower --timed-batches"
        )
    t0 = time.perf_counter()
    clock = StartupClock(device)  # start-up per phase: the first configuration's, as a run's
    compile_cache = use_compile_cache(build_config(CompileCacheConfig, compile_options)) if not tiny else None
    dtype = torch.bfloat16 if use_fp8 or not tiny else torch.float32  # FP8 compute runs on bf16
    state = random_weights(target, seed=0, device=device, with_head=False, dtype=dtype, last_layer=taps[-1])
    kernels = select_kernels(device)
    model = TargetModel.from_state_dict(target, state, kernels, dtype=dtype, last_layer=taps[-1])
    log.info("built a random %d-layer 27B-width target in %.0fs", taps[-1] + 1, time.perf_counter() - t0)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "layers_built": taps[-1] + 1,
        "taps": taps,
        "token_budget": token_budget,
        "padding_efficiency": plan.padding_efficiency,
        "median_len": float(np.median(lengths)),
        "mean_len": float(lengths.mean()),
        "max_len": int(lengths.max()),
        "configs": names,
        "timed_batches": timed_batches,
        "compile_cache": compile_cache,
    }
    clock.mark("weights")  # random weights built on the device: a run loads them from disk instead
    _save(out_path, result)
    # ExtractConfig wants a checkpoint directory: give it the config alone (weights live on the GPU).
    config_dir = work / "target"
    config_dir.mkdir(exist_ok=True)
    (config_dir / "config.json").write_text(json.dumps(cfg_dict))
    timed = plan.batches[warm:need]
    warmed: set[str] = set()
    projection = None  # (P, D) of the *_pca configurations, estimated at the first of them
    for name in names:
        mode, storage, write, off = CONFIGS[name]
        options = ForwardOptions(**{f.name: f.name not in off for f in dataclasses.fields(ForwardOptions)})
        if mode == "fp8" and not model.pw.fp8 and startup_only:
            model.use_fp8_compute()
            clock.mark("fp8_conversion")
        if mode == "fp8" and not model.pw.fp8:  # the first FP8 configuration: convert, measure the error
            t1 = time.perf_counter()
            model.set_forward_options(ForwardOptions())
            dense_nKH = _forward_batch(model, index, plan.batches[warm], taps, device, token_budget)
            model.use_fp8_compute()  # in place: the linear layers' weights quantised once
            fp8_nKH = _forward_batch(model, index, plan.batches[warm], taps, device, token_budget)
            stored = decode_hidden(**encode_hidden(dense_nKH, "fp8"))
            result["fp8_vs_dense_rel_err_per_tap"] = _rel_err_per_tap(fp8_nKH, dense_nKH, taps)
            result["fp8_storage_rel_err_per_tap"] = _rel_err_per_tap(stored, dense_nKH, taps)
            result["fp8_error_tokens"] = int(dense_nKH.shape[0])
            result["fp8_conversion_and_error_s"] = time.perf_counter() - t1
            del dense_nKH, fp8_nKH, stored
            _save(out_path, result)
            log.info("FP8 compute vs dense, relative L2 per tap: %s", result["fp8_vs_dense_rel_err_per_tap"])
        remove_folder(root, CACHE)
        cfg = ExtractConfig(
            target=str(config_dir),
            data=str(data),
            out_dir=str(cache_dir),
            tap_layer_ids=taps,
            storage_dtype="fp8" if storage == "pca" else storage,
            pca_rank=pca_rank if storage == "pca" else 0,
            pca_sample_tokens=pca_sample_tokens if storage == "pca" else None,
            token_budget=token_budget,
            progress_interval_s=5.0,
            compute=mode,
            dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        )
        cache_cfg = build_cache_config(cfg, target, taps, plan, index)
        create_cache(cache_dir, cache_cfg, _zero_head(target))
        model.set_forward_options(options)
        if storage == "pca":
            if projection is None:
                projection = _estimate(model, cache_cfg, index, plan, device, token_budget, result)
                _save(out_path, result)
            cache_cfg.projection.checksum = write_projection(cache_dir, *projection)
            write_cache_config(cache_dir, cache_cfg)
        copy_stream = "copy_stream" not in off
        variant = f"{mode} {options}"
        if variant not in warmed:  # compile and allocator warm-up, once per compute mode and options
            warm_sink = _sink(cfg, cache_cfg, device, write, copy_stream)
            first = clock if not warmed else None
            s = extract_batches(model, cfg, cache_cfg, index, plan.batches[:warm], device, warm_sink, clock=first)
            if first is not None:
                result["startup"] = {"config": name, **s.startup}
                _save(out_path, result)
            warmed.add(variant)
        sink = _sink(cfg, cache_cfg, device, write, copy_stream)
        s = extract_batches(model, cfg, cache_cfg, index, timed, device, sink)
        steady = steady_tokens_per_s([b.num_tokens for b in timed], sink.done_s)
        result[name] = {
            "tokens_per_s": s.tokens_per_s,
            "steady_tokens_per_s": steady,
            "seconds": s.seconds,
            "tokens": s.tokens,
            "gb_written": s.bytes_written / 1e9,
            "write_gb_per_s": s.bytes_written / 1e9 / s.seconds,
            "wait_for_disk_s": sink.wait_s,
            "cuts_off": sorted(off),
        }
        _save(out_path, result)
        log.info(
            "%s: %.0f tok/s end to end, %s steady", name, s.tokens_per_s, f"{steady:.0f} tok/s" if steady else "no"
        )
    long_lengths = [int(x) for x in long_samples.split(",") if x.strip()]
    if long_lengths:
        model.set_forward_options(ForwardOptions())
        base = dataclasses.replace(cfg, piece_context=min(2048, token_budget // 4), piece_label_reach=15)
        write, pca = CONFIGS[names[-1]][2], CONFIGS[names[-1]][1] == "pca"
        result["long_samples"] = {
            str(n): long_sample_run(model, target, taps, base, n, write, root, device, projection if pca else None)
            for n in long_lengths
        }
        _save(out_path, result)
    remove_folder(root, CACHE)
    if profile:
        result["profile"] = {"config": names[-1], **kernel_profile(model, index, timed[0], taps, device, token_budget)}
        _save(out_path, result)
    if hf_layers:
        del model
        torch.cuda.empty_cache()
        rows = [r for b in plan.batches[warm : warm + 3] for r in b.rows]  # HF is slow: three batches' samples
        result.update(hf_padded_tokens_per_s(cfg_dict, state, index, rows, token_budget, hf_layers, device))
        _save(out_path, result)
    print(f"\n{'configuration':<34} {'end to end tok/s':>16} {'steady tok/s':>12} {'write GB/s':>10}")
    for name in names:
        r = result[name]
        steady = f"{r['steady_tokens_per_s']:,.0f}" if r["steady_tokens_per_s"] else "-"
        print(f"{name:<34} {r['tokens_per_s']:>16,.0f} {steady:>12} {r['write_gb_per_s']:>10.2f}")
    if hf_layers:
        print(
            f"{'HF+fla padded (projected to 64)':<34} {result['hf_real_tokens_per_s_full_depth']:>16,.0f}   fill {result['hf_fill']:.2f}"
        )
    if "fp8_vs_dense_rel_err_per_tap" in result:
        for key, what in (
            ("fp8_vs_dense_rel_err_per_tap", "FP8 compute vs dense"),
            ("fp8_storage_rel_err_per_tap", "fp8 storage alone"),
        ):
            errs = ", ".join(f"layer {t}: {e:.2e}" for t, e in result[key].items())
            print(f"{what}, relative L2 per tap (one batch): {errs}")
    if profile:
        prof = result["profile"]
        print(
            f"\none forward of {prof['tokens']} tokens in {prof['config']}'s settings: {prof['total_ms']:.1f} ms of "
            f"kernels, GEMMs {prof['matmul_ms']:.1f} ms, the rest {prof['total_ms'] - prof['matmul_ms']:.1f} ms; "
            "by kernel name:"
        )
        for row in prof["top"]:
            print(f"{row['ms']:>9.2f} ms {100 * row['share']:>5.1f}%  {row['name'][:110]}")
    for n, r in result.get("long_samples", {}).items():
        print(
            f"one {n}-token sample whole, {r['pieces']} pieces: {r['sample_tokens_per_s']:,.0f} tok/s, peak {r['peak_gib']:.1f} GiB"
        )
    print(
        f"packing efficiency {result['padding_efficiency']:.4f}, median {result['median_len']:.0f}, max {result['max_len']}"
    )


if __name__ == "__main__":
    main()
