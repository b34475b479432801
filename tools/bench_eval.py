"""Benchmark of the decoding-walk evaluation on one GPU: walk blocks (drafter steps) per second.

Random drafter and data of fixed shapes held in memory (no cache on disk), the same code as
`dflash-train eval` (train.walk.walk_shard over a flex BlockAttentionLayout, bf16 weights and
activations). One packed batch of `--token-budget` context tokens holding `--responses` responses
of `--response-len` supervised tokens after a 64-token prompt. A random drafter rejects almost every
draft, so each response takes about response-len steps: the worst case for the walk (one step per
token). Reported per rule (chain, tree@budget): steps, rounds, seconds, blocks/s, rounds/s.

Usage: python -m tools.bench_eval --out bench_eval.json [--token-budget 49152] [--responses 64]
       [--response-len 128] [--lanes 64] [--budgets 16]
"""

from __future__ import annotations

import json
import logging
import time

import click
import torch

from shards.cli_options import CONTEXT_SETTINGS
from train.attention import BlockAttentionLayout
from train.drafter_config import DrafterConfig
from train.model import DFlashDrafter, TargetHead
from train.walk import Response, walk_shard

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


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--out", "out_json", required=True, type=click.Path(dir_okay=False), help="JSON file to write.")
@click.option("--token-budget", default=49152, show_default=True, help="Context tokens of the packed batch.")
@click.option("--responses", default=64, show_default=True, help="Responses in the batch.")
@click.option("--response-len", default=128, show_default=True, help="Supervised tokens per response.")
@click.option("--lanes", default=64, show_default=True, help="Responses walked at once (blocks per forward).")
@click.option(
    "--budgets", default="16", show_default=True, help="DDTree budgets also walked, comma-separated ('' = none)."
)
def main(out_json: str, token_budget: int, responses: int, response_len: int, lanes: int, budgets: str) -> None:
    """Walk blocks/s of the 27B-width drafter (5 layers, hidden 5120, MLP 17408, 32/8 heads of 128, vocab 248320)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not torch.cuda.is_available():
        raise click.UsageError("bench_eval measures the GPU path; no CUDA device here")
    dtype, device, vocab, hidden, taps = torch.bfloat16, "cuda", 248320, 5120, 5
    cfg = DrafterConfig.for_target(
        hidden_size=hidden,
        intermediate_size=17408,
        vocab_size=vocab,
        num_target_layers=64,
        tap_layer_ids=[1, 16, 31, 46, 61],
        mask_token_id=248070,
    )
    model, head = random_drafter(cfg, device, dtype)
    model.eval()
    hidden_TKH = torch.randn(token_budget, taps, hidden, device=device, dtype=dtype)
    ids_T, pos_T, spans = synthetic_batch(token_budget, responses, response_len, vocab)
    layout = BlockAttentionLayout(
        num_ctx=token_budget, num_blocks=lanes, block_size=cfg.block_size, backend="flex", device=device
    )
    rules = [None] + [int(b) for b in budgets.replace(",", " ").split()]
    results = []
    walk_shard(model, head, hidden_TKH, ids_T, pos_T, spans[:lanes], layout, budget=None)  # compile + warm-up
    for rule in rules:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        counts = walk_shard(model, head, hidden_TKH, ids_T, pos_T, spans, layout, budget=rule)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        name = "chain" if rule is None else f"tree@{rule}"
        rounds = -(-counts.steps // lanes)  # lower bound: lanes stay full while responses remain
        rec = {
            "rule": name,
            "steps": counts.steps,
            "seconds": seconds,
            "blocks_per_s": counts.steps / seconds,
            "approx_rounds": rounds,
            "rounds_per_s": rounds / seconds,
            "acceptance_length": counts.acceptance_length,
        }
        log.info(
            "%s: %d blocks in %.2f s = %.0f blocks/s (%.1f rounds/s of %d lanes)",
            name,
            counts.steps,
            seconds,
            rec["blocks_per_s"],
            rec["rounds_per_s"],
            lanes,
        )
        results.append(rec)
    out = {
        "device": torch.cuda.get_device_name(),
        "token_budget": token_budget,
        "responses": responses,
        "response_len": response_len,
        "lanes": lanes,
        "dtype": "bfloat16",
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "results": results,
    }
    with open(out_json, "w") as f:
        json.dump(out, f, indent=1)
    click.echo(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
