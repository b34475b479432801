"""Benchmark of the decoding-walk evaluation: walk blocks (drafter steps) per second, on one GPU or
on CPU.

Random drafter and data of fixed shapes held in memory (no cache on disk), the same code as
`dflash-train eval` (train.eval.walk.walk_shard over a BlockAttentionLayout: flex on the GPU, sdpa on
CPU; bf16 weights and activations unless --dtype; the shard's context K/V computed once per walk,
inside the timing). The drafter is the 27B-width one, or with --cache the one dflash-train builds by
default on that cache (the demo's: --cache demo/cache --token-budget 1024 --device cpu). One packed batch of `--token-budget` context tokens holding `--responses` responses
of `--response-len` supervised tokens after a 64-token prompt. A random drafter rejects almost every
draft, so each response takes about response-len steps: the worst case for the walk (one step per
token). Reported per rule (chain, tree@budget): steps, rounds, seconds, blocks/s, rounds/s.

Usage: python -m tools.bench.eval --out bench_eval.json [--token-budget 49152] [--responses 64]
       [--response-len 128] [--lanes 64] [--budgets 16] [--cache DIR] [--device cuda|cpu]
       [--dtype bfloat16|float32]
"""

from __future__ import annotations

import json
import logging
import time

import click
import torch

from shards.common.cli_options import CONTEXT_SETTINGS
from train.drafter.attention import BlockAttentionLayout
from train.drafter.config import QWEN36_27B_TARGET, DrafterConfig
from train.drafter.model import DFlashDrafter, TargetHead
from train.eval.walk import Response, walk_shard

log = logging.getLogger("bench_eval")


def synthetic_batch(
    token_budget: int, responses: int, response_len: int, vocab: int, prompt_len: int = 64, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor, list[Response]]:
    """Packed ids and positions; one response per sequence, prompt then response_len supervised tokens."""
    seq_len = prompt_len + response_len
    if responses * seq_len > token_budget:
        raise click.UsageError(
            f"--responses {responses} x (64 + --response-len {response_len}) exceeds --token-budget {token_budget}"
        )
    gen = torch.Generator(device).manual_seed(0)
    ids_T = torch.randint(0, vocab - 1, (token_budget,), generator=gen, device=device, dtype=torch.int32)
    pos_T = (torch.arange(token_budget, device=device) % seq_len).to(torch.int32)
    spans = [Response(i * seq_len, i * seq_len + prompt_len, (i + 1) * seq_len - 1) for i in range(responses)]
    return ids_T, pos_T, spans


def random_drafter(cfg: DrafterConfig, device: str, dtype: torch.dtype) -> tuple[DFlashDrafter, TargetHead]:
    """A random drafter and target head built straight in `dtype` on `device` (no fp32 twin at 27B width)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = DFlashDrafter(cfg).to(dtype)
    model = model.to_empty(device=device)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.ndim > 1 else torch.nn.init.ones_(p)
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    head = TargetHead(
        torch.randn(vocab, hidden, device=device, dtype=dtype),
        torch.randn(vocab, hidden, device=device, dtype=dtype) / hidden**0.5,
    )
    return model, head


def bench_drafter(cache: str | None) -> DrafterConfig:
    """The drafter dflash-train builds by default on `cache` (its width, taps, vocab, MASK id), or the
    published 27B-width drafter without one."""
    if cache is not None:
        from train.config import TrainConfig
        from train.resolve import resolve_run

        # out_dir is never created: resolve_run only reads the cache.
        return resolve_run(TrainConfig(cache=cache, out_dir=f"{cache}/bench-eval-unused")).drafter
    return DrafterConfig.for_target(**QWEN36_27B_TARGET)


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--out", "out_json", required=True, type=click.Path(dir_okay=False), help="JSON file to write.")
@click.option("--token-budget", default=49152, show_default=True, help="Context tokens of the packed batch.")
@click.option("--responses", default=64, show_default=True, help="Responses in the batch.")
@click.option("--response-len", default=128, show_default=True, help="Supervised tokens per response.")
@click.option("--lanes", default=64, show_default=True, help="Responses walked at once (blocks per forward).")
@click.option(
    "--budgets", default="16", show_default=True, help="DDTree budgets also walked, comma-separated ('' = none)."
)
@click.option(
    "--cache",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="Take the drafter's shape from this cache as dflash-train's defaults do (e.g. the demo's); "
    "default: the 27B-width drafter.",
)
@click.option(
    "--device", default="cuda", show_default=True, type=click.Choice(["cuda", "cpu"]), help="cpu: sdpa attention."
)
@click.option(
    "--dtype",
    default="bfloat16",
    show_default=True,
    type=click.Choice(["bfloat16", "float32"]),
    help="Weights and activations.",
)
def main(
    out_json: str,
    token_budget: int,
    responses: int,
    response_len: int,
    lanes: int,
    budgets: str,
    cache: str | None,
    device: str,
    dtype: str,
) -> None:
    """Walk blocks/s of a random drafter: the 27B width (5 layers, hidden 5120, MLP 17408, 32/8 heads of
    128, vocab 248320) by default, or the shape dflash-train gives a drafter on --cache."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("no CUDA device here: pass --device cpu")
    cfg = bench_drafter(cache)
    torch_dtype = getattr(torch, dtype)
    model, head = random_drafter(cfg, device, torch_dtype)
    model.eval()
    hidden_TKH = torch.randn(token_budget, cfg.num_taps, cfg.hidden_size, device=device, dtype=torch_dtype)
    ids_T, pos_T, spans = synthetic_batch(token_budget, responses, response_len, cfg.vocab_size, device=device)
    layout = BlockAttentionLayout(
        num_ctx=token_budget,
        num_blocks=lanes,
        block_size=cfg.block_size,
        backend="flex" if device == "cuda" else "sdpa",
        device=device,
    )
    rules = [None] + [int(b) for b in budgets.replace(",", " ").split()]

    def walk(rule: int | None, spans: list[Response]):
        # The shard's context K/V are part of its cost: computed once per walk, as evaluate_drafter does per shard.
        with torch.no_grad():
            context = model.context(hidden_TKH, pos_T, torch_dtype)
        return walk_shard(model, head, context, ids_T, pos_T, spans, layout, budget=rule)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    results = []
    walk(None, spans[:lanes])  # compile + warm-up
    for rule in rules:
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        counts = walk(rule, spans)
        sync()
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        name = "chain" if rule is None else f"tree@{rule}"
        rounds = -(-counts.steps // lanes)  # lower bound: lanes stay full while responses remain
        rec = {
            "rule": name,
            "steps": counts.steps,
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,  # process CPU time: on a shared CPU machine steadier than wall time
            "blocks_per_s": counts.steps / seconds,
            "blocks_per_cpu_s": counts.steps / cpu_seconds,
            "approx_rounds": rounds,
            "rounds_per_s": rounds / seconds,
            "acceptance_length": counts.acceptance_length,
        }
        log.info(
            "%s: %d blocks in %.2f s = %.0f blocks/s (%.0f per CPU second; %.1f rounds/s of %d lanes)",
            name,
            counts.steps,
            seconds,
            rec["blocks_per_s"],
            rec["blocks_per_cpu_s"],
            rec["rounds_per_s"],
            lanes,
        )
        results.append(rec)
    out = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "drafter": {
            "hidden": cfg.hidden_size,
            "mlp": cfg.intermediate_size,
            "layers": cfg.num_layers,
            "heads": [cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim],
            "taps": cfg.num_taps,
            "vocab": cfg.vocab_size,
            "block_size": cfg.block_size,
        },
        "token_budget": token_budget,
        "responses": responses,
        "response_len": response_len,
        "lanes": lanes,
        "dtype": dtype,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "results": results,
    }
    with open(out_json, "w") as f:
        json.dump(out, f, indent=1)
    click.echo(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
