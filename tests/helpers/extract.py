"""Helpers shared by the extraction and fault tests (no tests here): a tiny target, a dataset, the
uninterrupted reference extraction that faulted runs must reproduce, and ways to damage a shard."""

import json
import shutil
import struct

import numpy as np
import torch
from click.testing import CliRunner

from extract.cli import main as extract_cli
from extract.config import ExtractConfig
from extract.dataset.index import Sample, write_jsonl
from extract.runner import run_extract
from shards import ShardReader, read_manifest
from shards.inspect import verify_cache
from tests.helpers.process import REPO as REPO  # re-exported: the fault tests take it from here
from tools.fixtures.tiny_target import write_random_checkpoint

NUM_SAMPLES = 24
VOCAB = 512  # tiny_target's vocabulary


def rel_l2(a, b) -> float:
    """Relative L2 error of a against the reference b, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def two_sequences_27b(device, first_len: int):
    """3072 random tokens of the 4096-token test vocabulary in two packed sequences (the GPU tests'
    27B-width input); taps on all 4 layers."""
    gen = torch.Generator().manual_seed(first_len)
    ids = torch.randint(0, 4096, (3072,), generator=gen).to(device)
    pos = torch.cat([torch.arange(first_len), torch.arange(3072 - first_len)]).to(device)
    return ids, pos, torch.tensor([0, first_len, 3072]), [0, 1, 2, 3]


def make_samples(n=NUM_SAMPLES, seed=0, max_len=90):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(3, max_len))
        mask = (np.arange(length) >= length // 3).astype(np.uint8)
        out.append(Sample(f"doc-{i}", rng.integers(0, VOCAB, size=length), mask))
    return out


def extract_cfg(target, data, out, **kw):
    base = dict(
        target=str(target),
        data=str(data),
        out_dir=str(out),
        token_budget=256,
        max_seqs=8,
        dtype="float32",
        mask_token_id=VOCAB - 1,
        progress_interval_s=0.0,
    )
    base.update(kw)
    return ExtractConfig(**base)


def cli_args(target, data, out, *extra, token_budget=256, max_seqs=8):
    """dflash-extract's arguments for the settings of extract_cfg, then `extra`."""
    return [
        "--target",
        str(target),
        "--data",
        str(data),
        "--out",
        str(out),
        "--token-budget",
        str(token_budget),
        "--max-seqs",
        str(max_seqs),
        "--dtype",
        "float32",
        "--mask-token-id",
        str(VOCAB - 1),
        *extra,
    ]


def all_tensors(cache):
    reader = ShardReader(cache)
    return {b: reader.read(b, verify_checksum=True)[0] for b in reader.batch_ids()}


def temporaries(cache):
    return sorted(str(p) for p in cache.rglob(".tmp-*"))


def assert_equals_reference(out, reference):
    """Same shards, byte-identical tensors, same manifest, verifies, no temporaries anywhere."""
    report = verify_cache(out)
    assert report.ok, report.bad
    got, want = all_tensors(out), reference["tensors"]
    assert sorted(got) == sorted(want), f"batch ids {sorted(got)}, reference {sorted(want)}"
    for b in want:
        for name in want[b]:
            same = torch.equal(got[b][name].view(torch.uint8), want[b][name].view(torch.uint8))
            assert same, f"batch {b} tensor {name} differs from the uninterrupted run"
    manifest = read_manifest(out)
    assert sorted(manifest.column("sample_id").to_pylist()) == sorted(f"doc-{i}" for i in range(NUM_SAMPLES))
    assert manifest.equals(reference["manifest"])
    assert temporaries(out) == []


def tiny_target_dir(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("target") / "tiny", seed=1, dtype=torch.float32)


def dataset_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    write_jsonl(path, make_samples())
    return path


def extract_reference(target, data, tmp_path_factory):
    """The uninterrupted run every faulted run must reproduce byte for byte."""
    out = tmp_path_factory.mktemp("reference") / "cache"
    summary = run_extract(extract_cfg(target, data, out))
    manifest = read_manifest(out)
    by_batch = {}
    for sid, b in zip(manifest.column("sample_id").to_pylist(), manifest.column("batch_id").to_pylist()):
        by_batch.setdefault(b, []).append(sid)
    return {
        "dir": out,
        "num_batches": summary.num_batches,
        "tensors": all_tensors(out),
        "manifest": manifest,
        "samples_of": by_batch,
    }


def corrupt_shard(path, how: str) -> None:
    """Damage a shard file: truncate, flip one data bit, bump the format version, or change a shape."""
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) - 100]))
    elif how == "flip":
        data[-50] ^= 0x40
        path.write_bytes(bytes(data))
    elif how in ("version", "shape"):
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        if how == "version":
            header["__metadata__"]["format_version"] = "99"
        else:
            # Same byte count, another shape: only a shape check can catch it.
            t = header["input_ids"]["shape"][0]
            header["input_ids"]["shape"] = [t // 2, 2]
        blob = json.dumps(header, separators=(",", ":")).encode()
        path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n :])


def copy_cache(reference, tmp_path):
    out = tmp_path / "cache"
    shutil.copytree(reference["dir"], out)
    return out


def snapshot(cache):
    """Every file's bytes, except the lock file (its holder record changes with every run)."""
    return {
        str(p.relative_to(cache)): p.read_bytes()
        for p in sorted(cache.rglob("*"))
        if p.is_file() and p.name != ".dflash.lock"
    }


# A pieced cache's settings (dflash-extract --max-seq-len): shards of PIECE_BUDGET tokens, pieces keeping
# PIECE_CONTEXT tokens before their own part and PIECE_REACH after it.
PIECE_BUDGET, PIECE_CONTEXT, PIECE_REACH = 128, 24, 7


def extract_pieced_cache(target, tmp, lengths: dict[str, int], *extra: str):
    """dflash-extract by the tiny target of random samples of the given lengths (those over PIECE_BUDGET
    stored as pieces) into tmp/cache, with its top-4 stored; returns (cache, {sample id: Sample})."""
    rng = np.random.default_rng(7)
    samples = {
        sid: Sample(sid, rng.integers(0, VOCAB - 1, n), (np.arange(n) % 11 > 2).astype(np.uint8))
        for sid, n in lengths.items()
    }
    write_jsonl(tmp / "d.jsonl", list(samples.values()))
    args = cli_args(target, tmp / "d.jsonl", tmp / "cache", token_budget=PIECE_BUDGET)
    args += ["--max-seq-len", "4096", "--piece-context", str(PIECE_CONTEXT), "--piece-label-reach", str(PIECE_REACH)]
    result = CliRunner().invoke(extract_cli, [*args, "--target-topk", "4", *extra])
    assert result.exit_code == 0, result.output
    return tmp / "cache", samples
