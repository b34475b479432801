"""Benchmark what one shard costs the extraction writer thread at 27B width: the checksum and the
durable write.

Every shard is checksummed (crc32 over all its bytes) and written with flush + fsync before it gets
its final name; for the last batch of a run that is the time from the forward finishing to the cache
being complete (the pipeline's drain), and in steady state it bounds how fast the disk side keeps up.
Times, per storage encoding, on buffers of one full 49152-token batch of random bytes:
  checksum with zlib's crc32 and with the crc32 shards/common/crc.py uses (ISA-L's when installed)
  write_shard: checksum + container write + fsync + rename, into --dir (the disk under test)

    python -m tools.bench.shard_write --out bench_shard_write.json --dir /tmp/bench_shard_write
"""

from __future__ import annotations

import json
import statistics
import time
import zlib
from pathlib import Path

import click
import torch

from shards import CacheConfig, SampleEntry, TargetInfo, allocate_shard_buffers, write_shard
from shards.common.crc import crc32
from shards.common.durable import check_writable, remove_stale_temporaries
from shards.format import raw_bytes, shard_path


def shard_config(storage_dtype: str, hidden_size: int, num_taps: int, token_budget: int) -> CacheConfig:
    return CacheConfig(
        target=TargetInfo(
            name="bench",
            config_hash="bench",
            hidden_size=hidden_size,
            num_layers=64,
            vocab_size=248320,
            dtype="bfloat16",
        ),
        tap_layer_ids=list(range(1, 1 + num_taps)),
        token_budget=token_budget,
        max_seqs=256,
        storage_dtype=storage_dtype,
        mask_token_id=0,
        target_head_checksum="crc32:00000000",
    )


def random_buffers(cfg: CacheConfig, seed: int) -> dict[str, torch.Tensor]:
    """The shard's tensors filled with random bytes (incompressible; the values never matter here)."""
    gen = torch.Generator().manual_seed(seed)
    buffers = allocate_shard_buffers(cfg)
    for t in buffers.values():
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
    return buffers


def checksum_seconds(crc, buffers: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    value = 0
    for name in sorted(buffers):
        value = crc(raw_bytes(buffers[name]), value)
    return time.perf_counter() - t0


@click.command()
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False))
@click.option("--dir", "shard_dir", default="/tmp/bench_shard_write", show_default=True, help="Where to write.")
@click.option("--repeats", default=3, show_default=True, help="Timed repetitions of each measurement.")
@click.option("--storage", default="fp8,bf16", show_default=True, help="Storage encodings to time.")
@click.option("--hidden-size", default=5120, show_default=True)
@click.option("--num-taps", default=5, show_default=True)
@click.option("--token-budget", default=49152, show_default=True)
def main(out_path, shard_dir, repeats, storage, hidden_size, num_taps, token_budget) -> None:
    if repeats < 1:
        raise click.BadParameter(f"{repeats}: must be at least 1", param_hint="--repeats")
    cache_dir = Path(shard_dir)
    if cache_dir.exists() and (not cache_dir.is_dir() or any(cache_dir.iterdir())):
        raise click.UsageError(f"--dir {shard_dir}: exists and is not an empty directory; name a new one")
    try:
        check_writable(shard_dir, f"--dir {shard_dir}")
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    made = not cache_dir.exists()
    (cache_dir / "shards").mkdir(parents=True, exist_ok=True)
    result: dict = {"crc32_in_use": crc32.__module__, "repeats": repeats}
    try:
        for storage_dtype in [s.strip() for s in storage.split(",") if s.strip()]:
            cfg = shard_config(storage_dtype, hidden_size, num_taps, token_budget)
            result[storage_dtype] = time_one_shard(cfg, cache_dir, repeats)
            Path(out_path).write_text(json.dumps(result, indent=2))
    finally:  # leave --dir as it was found: only what this run made goes
        shard = shard_path(cache_dir, 0)
        if shard.exists():
            shard.unlink()
        remove_stale_temporaries(cache_dir / "shards")
        (cache_dir / "shards").rmdir()
        if made:
            cache_dir.rmdir()


def time_one_shard(cfg: CacheConfig, cache_dir: Path, repeats: int) -> dict[str, float]:
    buffers = random_buffers(cfg, seed=0)
    gb = sum(t.numel() * t.element_size() for t in buffers.values()) / 1e9
    samples = [SampleEntry("bench-0", 0, cfg.token_budget, cfg.token_budget)]
    zlib_s = [checksum_seconds(zlib.crc32, buffers) for _ in range(repeats)]
    fast_s = [checksum_seconds(crc32, buffers) for _ in range(repeats)]
    write_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        path = write_shard(cache_dir, cfg, 0, buffers, samples)
        write_s.append(time.perf_counter() - t0)
        path.unlink()  # written just now: the next repeat writes into an empty directory again
    row = {
        "gb": gb,
        "checksum_zlib_s": statistics.median(zlib_s),
        "checksum_fast_s": statistics.median(fast_s),
        "write_shard_s": statistics.median(write_s),
    }
    print(
        f"{cfg.storage_dtype}: {gb:.2f} GB shard | checksum zlib {row['checksum_zlib_s']:.3f} s "
        f"({gb / row['checksum_zlib_s']:.1f} GB/s), {crc32.__module__} {row['checksum_fast_s']:.3f} s "
        f"({gb / row['checksum_fast_s']:.1f} GB/s) | write_shard (checksum, write, fsync) "
        f"{row['write_shard_s']:.3f} s ({gb / row['write_shard_s']:.2f} GB/s), median of {repeats}"
    )
    return row


if __name__ == "__main__":
    main()
