"""Benchmark of the training checkpoint: how long the step loop is blocked per save, and the write behind it.

Builds the drafter (train.drafter.model.DFlashDrafter, fp32 master weights) and its fused AdamW state
(train.optim.make_optimizer, moments filled with random values) on --device at the shape of a target of
width --hidden (5120: the published 27B drafter, 1.73B parameters, 20.8 GB of weights + moments), then
saves it through train.checkpoint.async_save.CheckpointWriter, the object dflash-train uses:
  async  --saves saves; each: a few timed stand-in steps, the save (stall = snapshot into the reused
         host buffers + wait for an earlier write), then stand-in steps until the background write is
         durable (their time against the idle ones shows what the writer costs the loop: GIL, memory
         bandwidth). The buffers are allocated once, before the first save (alloc_s).
  sync   one save written by the loop itself (stall = the whole write): the baseline.
A stand-in step is --step-matmuls square matmuls (bf16 8192 on CUDA, fp32 256 on CPU) and a synchronize.
Checkpoints go to a temporary folder under --dir, removed at the end (each is deleted once measured, so
the disk holds one at a time: 21 GB at 27B). Host memory at 27B: 21 GB of page-locked buffers (async).

Usage: python -m tools.bench.checkpoint --device cuda --out bench_checkpoint.json         (27B drafter)
       python -m tools.bench.checkpoint --device cpu --hidden 256 --mlp 768 --layers 2     (small, CPU)
"""

from __future__ import annotations

import json
import logging
import resource
import shutil
import tempfile
import time
from pathlib import Path

import click
import torch

from train.checkpoint.async_save import CheckpointWriter
from train.checkpoint.store import checkpoint_name
from train.distributed import FlatGrads
from train.drafter.config import DrafterConfig
from train.drafter.model import DFlashDrafter
from train.optim import WarmupCosine, make_optimizer

log = logging.getLogger("bench_checkpoint")


def build_state(cfg: DrafterConfig, device: torch.device) -> tuple[DFlashDrafter, torch.optim.Optimizer]:
    """The drafter and its AdamW state on `device`, as dflash-train holds them (moments non-zero)."""
    with torch.device(device):
        model = DFlashDrafter(cfg)
    params = list(model.parameters())
    FlatGrads(params)  # make_optimizer's zero step needs the .grad views
    schedule = WarmupCosine(peak_lr=6e-4, warmup_steps=10, total_steps=100, min_lr_ratio=0.0, device=device)
    optimizer = make_optimizer(params, schedule, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    gen = torch.Generator(device).manual_seed(0)
    for state in optimizer.state.values():
        state["exp_avg"].normal_(generator=gen)
        state["exp_avg_sq"].uniform_(generator=gen)
    return model, optimizer


class StandInStep:
    """A fixed amount of device work ending in a synchronize: the loop's steps while a write runs."""

    def __init__(self, device: torch.device, matmuls: int):
        n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (256, torch.float32)
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.b = torch.randn(n, n, device=device, dtype=dtype)
        self.matmuls, self.device = matmuls, device

    def __call__(self) -> float:
        """One step; returns its seconds."""
        t0 = time.perf_counter()
        for _ in range(self.matmuls):
            torch.mm(self.a, self.b)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0


def bench_mode(
    mode: str,
    saves: int,
    model: DFlashDrafter,
    optimizer: torch.optim.Optimizer,
    step: StandInStep,
    work_dir: Path,
    device: torch.device,
) -> list[dict]:
    records: list[dict] = []
    writer = CheckpointWriter(work_dir, keep=saves + 1, mode=mode, device=device, write_event=records.append)
    t0 = time.perf_counter()
    writer.allocate(model.state_dict(), optimizer.state_dict())
    alloc_s = time.perf_counter() - t0
    results = []
    try:
        for i in range(1, saves + 1):
            idle_ms = [1e3 * step() for _ in range(3)]
            stall = writer.save(i, model.state_dict(), optimizer.state_dict(), {"step": i})
            during_ms = []
            while writer.pending_step is not None:
                during_ms.append(1e3 * step())
                writer.poll()
            writer.wait()
            durable = next(r for r in records if r["event"] == "checkpoint_durable" and r["step"] == i)
            results.append(
                {
                    "mode": mode,
                    "save": i,
                    "stall_s": stall["checkpoint/stall_s"],
                    "snapshot_s": stall.get("checkpoint/snapshot_s"),
                    "wait_s": stall.get("checkpoint/wait_s"),
                    "write_s": durable["checkpoint/write_s"],
                    "bytes": durable["checkpoint/bytes"],
                    "host_buffer_bytes": writer.snapshot.nbytes if writer.snapshot is not None else 0,
                    "alloc_s": alloc_s if mode == "async" else None,
                    "step_ms_idle": sum(idle_ms) / len(idle_ms),
                    "step_ms_during_write": sum(during_ms) / len(during_ms) if during_ms else None,
                    "steps_during_write": len(during_ms),
                }
            )
            log.info("%s", _row(results[-1]))
            shutil.rmtree(work_dir / checkpoint_name(i))  # one checkpoint on disk at a time
    finally:
        writer.close()
    return results


def _row(r: dict) -> str:
    def fmt(v, spec):
        return format(v, spec) if v is not None else "-"

    return (
        f"{r['mode']:<5} save {r['save']}: stall {r['stall_s']:.3f} s (snapshot {fmt(r['snapshot_s'], '.3f')}, "
        f"wait {fmt(r['wait_s'], '.3f')}), write {r['write_s']:.1f} s for {r['bytes'] / 1e9:.2f} GB "
        f"({r['bytes'] / 1e9 / r['write_s']:.2f} GB/s); stand-in step {r['step_ms_idle']:.1f} ms idle, "
        f"{fmt(r['step_ms_during_write'], '.1f')} ms during the write ({r['steps_during_write']} steps)"
    )


@click.command()
@click.option("--device", default="cuda", show_default=True, help="cuda or cpu.")
@click.option("--hidden", default=5120, show_default=True, help="Target width (5120: the published 27B drafter).")
@click.option("--mlp", default=17408, show_default=True, help="Drafter MLP width.")
@click.option("--layers", default=5, show_default=True, help="Drafter layers.")
@click.option("--taps", default=5, show_default=True, help="Tapped target layers (fc input width = taps x hidden).")
@click.option("--modes", default="async,sync", show_default=True, help="Comma-separated: async, sync.")
@click.option("--saves", default=2, show_default=True, help="Asynchronous saves (sync always saves once).")
@click.option("--step-matmuls", default=40, show_default=True, help="Matmuls per stand-in step.")
@click.option("--dir", "base_dir", default=".", show_default=True, help="Where the temporary checkpoint folder goes.")
@click.option("--out", "out_path", default="bench_checkpoint.json", show_default=True, help="JSON results file.")
def main(
    device: str,
    hidden: int,
    mlp: int,
    layers: int,
    taps: int,
    modes: str,
    saves: int,
    step_matmuls: int,
    base_dir: str,
    out_path: str,
) -> None:
    """Checkpoint stall (step loop blocked) and background write time at a drafter's size."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise click.ClickException("--device cuda: CUDA is not available; use --device cpu")
        dev = torch.device("cuda", dev.index or 0)  # torch 2.11's set_device wants an index
        torch.cuda.set_device(dev)
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    if not mode_list or any(m not in ("async", "sync") for m in mode_list):
        raise click.BadParameter(f"entries must be async or sync, got {modes!r}", param_hint="--modes")
    if saves < 1:
        raise click.BadParameter(f"must be >= 1, got {saves}", param_hint="--saves")
    cfg = DrafterConfig.for_target(
        hidden_size=hidden,
        intermediate_size=mlp,
        vocab_size=248320,
        num_target_layers=64,
        tap_layer_ids=list(range(taps)),
        mask_token_id=248319,
        num_layers=layers,
    )
    t0 = time.perf_counter()
    model, optimizer = build_state(cfg, dev)
    num_params = sum(p.numel() for p in model.parameters())
    log.info(
        "drafter: %s parameters (hidden %d, MLP %d, %d layers) and AdamW state on %s, built in %.1f s",
        f"{num_params:,}",
        hidden,
        mlp,
        layers,
        dev,
        time.perf_counter() - t0,
    )
    step = StandInStep(dev, step_matmuls)
    work_dir = Path(tempfile.mkdtemp(prefix="bench_checkpoint-", dir=base_dir))
    results = []
    try:
        for mode in mode_list:
            results += bench_mode(mode, saves if mode == "async" else 1, model, optimizer, step, work_dir, dev)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    summary = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "params": num_params,
        "hidden": hidden,
        "mlp": mlp,
        "layers": layers,
        "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "results": results,
    }
    Path(out_path).write_text(json.dumps(summary, indent=1) + "\n")
    for r in results:
        click.echo(_row(r))
    click.echo(f"{num_params:,} parameters; peak RSS {summary['max_rss_gib']:.1f} GiB; results in {out_path}")


if __name__ == "__main__":
    main()
