"""Short- vs long-trained drafters, evaluated per context-length bucket on long held-out samples (issue 31).

From a token dataset (--data: rows of input_ids, e.g. the testbed's prepared pairs for the proxy target)
the rows are concatenated into long documents of --sample-len tokens, all supervised; the last
--heldout-samples documents are held out. Then, with the real CLIs (in this process, as the acceptance
table runs them; logs under --work):
  short   dflash-extract at --token-budget, the long documents cut to it (what a cache held before
          --max-seq-len), then dflash-train
  long    dflash-extract --max-seq-len --sample-len (whole documents, stored as pieces), then dflash-train
with the same drafter (every layer sliding, --sliding-window), steps and seed; the held-out documents are
extracted whole too, and `dflash-train eval` walks them with both drafters, by context-length bucket.
Prints one row per drafter and bucket, and writes every eval JSON into --out.

    python -m tools.bench.long_context --target tools/testbed/proxy_target --data pairs.parquet \
        --work /tmp/longctx --out long_context.json --sample-len 65536 --token-budget 16384 --steps 400
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click
import numpy as np

from extract.cli import main as extract_cli
from extract.dataset.index import Sample, load_samples, scan_dataset, write_parquet
from extract.target.config import TargetConfig
from tools.cli.dflash_train import entry_point
from tools.testbed.table.clis import run_cli
from train.cli import main as train_cli

log = logging.getLogger("bench_long_context")


def long_documents(data: str, vocab_size: int, sample_len: int, num_docs: int) -> list[Sample]:
    """`num_docs` documents of `sample_len` tokens: the dataset's rows back to back, in order, all supervised."""
    index = scan_dataset(data, vocab_size=vocab_size)
    need = sample_len * num_docs
    if int(index.lengths.sum()) < need:
        raise click.UsageError(
            f"--data {data} holds {int(index.lengths.sum())} tokens, {num_docs} documents of {sample_len} need {need}"
        )
    tokens, rows = [], 0
    while sum(len(t) for t in tokens) < need:
        tokens.append(load_samples(index, [rows])[0].input_ids)
        rows += 1
    flat = np.concatenate(tokens)[:need].reshape(num_docs, sample_len)
    return [Sample(f"doc-{i}", ids, np.ones(sample_len, np.uint8)) for i, ids in enumerate(flat)]


@click.command()
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False), help="Target checkpoint.")
@click.option("--data", required=True, help="Token rows (input_ids) to build long documents from.")
@click.option("--work", required=True, type=click.Path(file_okay=False), help="New directory for caches and runs.")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="JSON results.")
@click.option("--sample-len", default=65536, show_default=True, help="Tokens per long document.")
@click.option("--train-samples", default=8, show_default=True, help="Long documents to train on.")
@click.option("--heldout-samples", default=2, show_default=True, help="Long documents held out for eval.")
@click.option("--token-budget", default=16384, show_default=True, help="Shard size (the short drafter's cut).")
@click.option("--sliding-window", default=2048, show_default=True, help="Window of every drafter layer.")
@click.option("--num-layers", default=5, show_default=True)
@click.option("--steps", default=400, show_default=True, help="Training steps of each drafter.")
@click.option("--device", default="auto", show_default=True)
@click.option("--context-buckets", default="0,2048,8192,32768", show_default=True)
@click.option("--mask-token-id", default=None, type=int, help="The drafter's MASK id. Default: the target's last id.")
def main(
    target,
    data,
    work,
    out_path,
    sample_len,
    train_samples,
    heldout_samples,
    token_budget,
    sliding_window,
    num_layers,
    steps,
    device,
    context_buckets,
    mask_token_id,
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    work = Path(work)
    if work.exists():
        raise click.UsageError(f"--work {work} exists; name a new directory")
    work.mkdir(parents=True)
    vocab = TargetConfig.from_dir(target).vocab_size
    mask = vocab - 1 if mask_token_id is None else mask_token_id  # as the acceptance table's default
    docs = long_documents(data, vocab, sample_len, train_samples + heldout_samples)
    write_parquet(work / "train.parquet", docs[:train_samples])
    write_parquet(work / "heldout.parquet", docs[train_samples:])
    common = ["--target", target, "--token-budget", str(token_budget), "--device", device]
    common += ["--piece-context", str(sliding_window), "--max-seqs", "8", "--mask-token-id", str(mask)]
    whole = ["--max-seq-len", str(sample_len)]
    caches = {"short": [], "long": whole, "heldout": whole}
    for name, extra in caches.items():
        source = work / ("heldout.parquet" if name == "heldout" else "train.parquet")
        args = [*common, "--data", str(source), "--out", str(work / f"cache-{name}"), *extra]
        log.info("extracting %s", name)
        run_cli("dflash-extract", extract_cli, args, work / f"extract-{name}.log")
    layers = ",".join(["sliding"] * num_layers)
    results = {}
    for name in ("short", "long"):
        run = work / f"run-{name}"
        args = ["train", "--cache", str(work / f"cache-{name}"), "--out", str(run), "--max-steps", str(steps)]
        args += ["--epochs", str(steps), "--layer-types", layers, "--sliding-window", str(sliding_window)]
        args += ["--num-layers", str(num_layers), "--device", device, "--fp8", "off"]  # bf16, as the table trains
        log.info("training the %s-context drafter", name)
        run_cli("dflash-train", train_cli, args, work / f"train-{name}.log")
        out = work / f"eval-{name}.json"
        args = ["eval", "--drafter", str(run), "--cache", str(work / "cache-heldout"), "--holdout-frac", "1"]
        args += ["--budgets", "", "--context-buckets", context_buckets, "--device", device, "--out", str(out)]
        run_cli("dflash-train", train_cli, args, work / f"eval-{name}.log", entry_point())
        results[name] = json.loads(out.read_text())
    Path(out_path).write_text(json.dumps(results, indent=2))
    print(f"{'drafter':<8} {'bucket':>8} {'acceptance':>10} {'steps':>8}")
    for name, r in results.items():
        for bucket, value in r["acceptance_by_context"].items():
            print(f"{name:<8} {bucket:>8} {value:>10.3f} {r['steps_by_context'][bucket]:>8}")


if __name__ == "__main__":
    main()
