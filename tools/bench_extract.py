"""Benchmark dflash-extract end to end at 27B width on a realistic length mix.

A random-weight target at the full 64-layer 27B shape is built on the GPU (no checkpoint on disk:
54 GB would not fit the machine's disk beside the cache), then the real extraction loop
(`extract.runner.extract_batches`: dataset loading, packing, forward, pinned copies, writer thread,
durable shards) runs over a lognormal length mix (median ~1.5K tokens, max 8K). Reports, per GPU:
  - tokens/s end to end writing the cache to local disk, bf16 and fp8 storage, with the write rate
    and the time the forward loop waited for the disk;
  - the same loop without writing (compute only);
  - with --compute fp8, the same again after switching the model's linear layers to FP8 matmuls
    (compute only, and writing an fp8 cache), plus the per-tap relative error of FP8 compute
    against dense compute on one full batch (the same weights, bf16 activations);
  - HF transformers' qwen3_5 (fla when installed) on the same samples in length-sorted, padded
    batches of the same token count with an attention mask, on a layer subset projected to 64.
Prints a table and writes JSON to --out.

    python -m tools.bench_extract --out bench_extract.json --cache-dir /tmp/bench_cache [--compute fp8]
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import click
import numpy as np
import torch

from extract.config import ExtractConfig
from extract.data import Sample, SampleLoader, scan_dataset, write_parquet
from extract.kernels import select_kernels
from extract.model import TargetModel
from extract.packing import PackingConfig, load_batch, plan_batches
from extract.runner import build_cache_config, extract_batches
from extract.target_config import TargetConfig
from extract.writer import AsyncShardWriter
from shards import create_cache
from tools.tiny_target import qwen35_27b_config_dict, random_weights, tiny_config_dict

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


class DiscardingSink:
    """A ShardSink that drops every batch: the extraction loop timed without the copy-out and disk."""

    def __init__(self) -> None:
        self.bytes_written, self.shards_written, self.wait_s = 0, 0, 0.0

    def submit(self, batch_id, arrays, hidden_nKH, topk, samples) -> None:
        pass

    def close(self) -> None:
        pass

    def close_quietly(self) -> None:
        pass


def _sink(cfg: ExtractConfig, cache_cfg, device: torch.device, write: bool) -> AsyncShardWriter | DiscardingSink:
    return AsyncShardWriter(cfg.out_dir, cache_cfg, device, num_buffers=cfg.writer_buffers) if write else DiscardingSink()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_padded_tokens_per_s(cfg_dict, state, index, loader_rows, token_budget, layers, device) -> dict:
    """HF on length-sorted padded batches of ~token_budget tokens (rows x max_len), with attention_mask."""
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    from extract.data import load_samples

    sub = dict(cfg_dict, num_hidden_layers=layers, layer_types=cfg_dict["layer_types"][:layers])
    hf_cfg = Qwen3_5TextConfig(**{k: v for k, v in sub.items() if k not in ("architectures", "model_type", "dtype")})
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = Qwen3_5TextModel(hf_cfg)
    # Same weights as ours; the final norm (never reached by our taps) is zero-centred: zeros.
    params = {n: state[n] if n in state else torch.zeros(p.shape, dtype=torch.bfloat16, device=device) for n, p in hf.named_parameters()}
    hf.load_state_dict(params, strict=True, assign=True)
    hf.rotary_emb = type(hf.rotary_emb)(hf_cfg).to(device)
    hf = hf.eval()
    samples = sorted(load_samples(index, loader_rows), key=len)
    batches, cur = [], []
    for s in samples:  # rows of equal padded length until the padded batch reaches the budget
        if cur and (len(cur) + 1) * len(s) > token_budget:
            batches.append(cur)
            cur = []
        cur.append(s)
    if cur:
        batches.append(cur)
    real = padded = 0
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i, rows in enumerate(batches):
            width = max(len(s) for s in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, s in enumerate(rows):
                ids[r, : len(s)] = torch.from_numpy(s.input_ids)
                mask[r, : len(s)] = 1
            hf(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True, use_cache=False)
            if i == 0:  # first batch: autotune and allocator warm-up, not timed
                _sync(device)
                t0 = time.perf_counter()
                continue
            real += sum(len(s) for s in rows)
            padded += ids.numel()
    _sync(device)
    seconds = time.perf_counter() - t0
    del hf
    return {"hf_layers": layers, "hf_real_tokens_per_s_full_depth": real / seconds * layers / 64,
            "hf_fill": real / max(padded, 1), "hf_batches_timed": len(batches) - 1}


def _forward_batch(model: TargetModel, index, batch, taps: list[int], device: torch.device,
                   token_budget: int) -> torch.Tensor:
    """The taps [n, K, H] of one packed batch's real tokens (for the FP8-vs-dense error)."""
    arrays = load_batch(SampleLoader(index), batch, PackingConfig(token_budget=token_budget))
    n = batch.num_tokens
    ids = torch.from_numpy(arrays["input_ids"][:n]).to(device)
    pos = torch.from_numpy(arrays["position_ids"][:n]).to(device)
    cu = torch.from_numpy(arrays["cu_seqlens"][: len(batch.sample_ids) + 1])
    return model.forward_packed(ids, pos, cu, taps)


@click.command()
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False))
@click.option("--cache-dir", default="/tmp/bench_extract_cache", show_default=True)
@click.option("--num-samples", default=400, show_default=True, help="Samples in the length mix (~2K tokens each).")
@click.option("--batches", default=8, show_default=True, help="Timed batches per configuration (after two warm-up batches).")
@click.option("--layers", default=64, show_default=True, help="Target layers (64 = the real 27B depth).")
@click.option("--hf-layers", default=4, show_default=True, help="Layers for the HF comparison (projected to 64); 0 = skip.")
@click.option("--token-budget", default=49152, show_default=True)
@click.option("--compute", type=click.Choice(["dense", "fp8"]), default="dense", show_default=True,
              help="fp8: after the dense configurations, also measure FP8 compute (and its per-tap error vs dense).")
@click.option("--tiny", is_flag=True, help="CPU smoke run on the tiny config (checks the script, measures nothing useful).")
def main(out_path, cache_dir, num_samples, batches, layers, hf_layers, token_budget, compute, tiny) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = torch.device("cpu" if tiny else "cuda")
    cache_dir = Path(cache_dir)
    work = cache_dir.parent / (cache_dir.name + "-data")
    work.mkdir(parents=True, exist_ok=True)
    cfg_dict = tiny_config_dict() if tiny else qwen35_27b_config_dict(num_hidden_layers=layers)
    target = TargetConfig.from_hf_dict(cfg_dict)
    taps = target.default_tap_layer_ids(5) if layers >= 8 else list(range(1, layers))
    median, max_len = (40.0, 200) if tiny else (1450.0, 8192)
    lengths = length_mix(num_samples, median, 0.75, max_len, seed=0)
    data = work / "mix.parquet"
    write_mix(data, lengths, target.vocab_size, seed=0)
    index = scan_dataset(data, vocab_size=target.vocab_size, token_budget=token_budget)
    plan = plan_batches(index, PackingConfig(token_budget=token_budget))
    log.info("length mix: median %d, mean %d, max %d; %s", np.median(lengths), lengths.mean(), lengths.max(), plan.summary())
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if compute == "fp8" or not tiny else torch.float32  # FP8 compute runs on bf16
    state = random_weights(target, seed=0, device=device, with_head=False, dtype=dtype, last_layer=taps[-1])
    kernels = select_kernels(device)
    model = TargetModel.from_state_dict(target, state, kernels, dtype=dtype, last_layer=taps[-1])
    log.info("built a random %d-layer 27B-width target in %.0fs", taps[-1] + 1, time.perf_counter() - t0)
    warm = 2  # two batch lengths: torch.compile specialises on the first, goes dynamic on the second
    need = warm + batches
    if len(plan.batches) < need:
        raise click.UsageError(f"the mix packs into {len(plan.batches)} batches, need {need}: raise --num-samples")
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "layers_built": taps[-1] + 1, "taps": taps,
              "token_budget": token_budget, "padding_efficiency": plan.padding_efficiency,
              "median_len": float(np.median(lengths)), "mean_len": float(lengths.mean()), "max_len": int(lengths.max())}
    # ExtractConfig wants a checkpoint directory: give it the config alone (weights live on the GPU).
    config_dir = work / "target"
    config_dir.mkdir(exist_ok=True)
    (config_dir / "config.json").write_text(json.dumps(cfg_dict))
    runs = [("dense", "none", False), ("dense", "bf16", True), ("dense", "fp8", True)]
    if compute == "fp8":
        runs += [("fp8", "none", False), ("fp8", "fp8", True)]
    reference_hidden = None
    for mode, storage, write in runs:
        if mode == "fp8" and reference_hidden is None:
            reference_hidden = _forward_batch(model, index, plan.batches[warm], taps, device, token_budget)
            model.use_fp8_compute()  # in place: the linear layers' weights quantised once
        shutil.rmtree(cache_dir, ignore_errors=True)
        cfg = ExtractConfig(target=str(config_dir), data=str(data), out_dir=str(cache_dir), tap_layer_ids=taps,
                            storage_dtype="bf16" if storage == "none" else storage, token_budget=token_budget,
                            progress_interval_s=5.0, compute=mode, dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
        cache_cfg = build_cache_config(cfg, target, taps, plan, index)
        vocab, hidden = target.vocab_size, target.hidden_size
        create_cache(cache_dir, cache_cfg, {"embed_tokens": torch.zeros(vocab, hidden, dtype=torch.bfloat16),
                                            "lm_head": torch.zeros(vocab, hidden, dtype=torch.bfloat16),
                                            "final_norm": torch.zeros(hidden, dtype=torch.bfloat16)})
        extract_batches(model, cfg, cache_cfg, index, plan.batches[:warm], device, _sink(cfg, cache_cfg, device, write))
        s = extract_batches(model, cfg, cache_cfg, index, plan.batches[warm:need], device,
                            _sink(cfg, cache_cfg, device, write))
        key = ("fp8_compute_" if mode == "fp8" else "") + (f"write_{storage}" if write else "no_write")
        result[key] = {"tokens_per_s": s.tokens_per_s, "seconds": s.seconds, "tokens": s.tokens,
                       "gb_written": s.bytes_written / 1e9, "write_gb_per_s": s.bytes_written / 1e9 / s.seconds}
        log.info("%s: %.0f tok/s", key, s.tokens_per_s)
    if reference_hidden is not None:
        fp8_hidden = _forward_batch(model, index, plan.batches[warm], taps, device, token_budget)
        result["fp8_vs_dense_rel_err_per_tap"] = {
            str(tap): ((fp8_hidden[:, j].float() - reference_hidden[:, j].float()).norm()
                       / reference_hidden[:, j].float().norm()).item() for j, tap in enumerate(taps)}
        del fp8_hidden, reference_hidden
    shutil.rmtree(cache_dir, ignore_errors=True)
    if hf_layers:
        del model
        torch.cuda.empty_cache()
        rows = [r for b in plan.batches[warm : warm + 3] for r in b.rows]  # HF is slow: three batches' samples
        result.update(hf_padded_tokens_per_s(cfg_dict, state, index, rows, token_budget, hf_layers, device))
    Path(out_path).write_text(json.dumps(result, indent=2))
    print(f"\n{'configuration':<34} {'tokens/s per GPU':>16} {'write GB/s':>10}")
    for key in ("no_write", "write_bf16", "write_fp8", "fp8_compute_no_write", "fp8_compute_write_fp8"):
        if key not in result:
            continue
        r = result[key]
        print(f"{key:<34} {r['tokens_per_s']:>16,.0f} {r['write_gb_per_s']:>10.2f}")
    if hf_layers:
        print(f"{'HF+fla padded (projected to 64)':<34} {result['hf_real_tokens_per_s_full_depth']:>16,.0f}   fill {result['hf_fill']:.2f}")
    if "fp8_vs_dense_rel_err_per_tap" in result:
        errs = ", ".join(f"layer {t}: {e:.2e}" for t, e in result["fp8_vs_dense_rel_err_per_tap"].items())
        print(f"FP8 compute vs dense, relative L2 per tap (one batch): {errs}")
    print(f"packing efficiency {result['padding_efficiency']:.4f}, median {result['median_len']:.0f}, max {result['max_len']}")


if __name__ == "__main__":
    main()
