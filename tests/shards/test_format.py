"""The cache format through the shards API: round trips, corruption (a shard outside the plan of an extracted
cache too), durability, manifest, order."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner

from shards import (
    FORMAT_VERSION,
    CacheFormatError,
    ShardError,
    ShardLoader,
    ShardReader,
    allocate_shard_buffers,
    decode_hidden,
    encode_hidden,
    epoch_shard_order,
    load_target_head,
    read_cache_config,
    read_manifest,
    rebuild_manifest,
    shard_path,
    write_shard,
)
from shards.inspect import verify_cache
from tests.helpers.extract import copy_cache, corrupt_shard
from tools.cli.dflash_shards import main as shards_cli
from tools.fixtures.synthetic_cache import _random_batch, write_synthetic_cache


@pytest.fixture(params=["bf16", "fp8"])
def cache(tmp_path, request):
    cfg = write_synthetic_cache(tmp_path / "cache", storage_dtype=request.param, target_topk=4, num_batches=3)
    return tmp_path / "cache", cfg


def _batch(cfg, batch_id):
    import numpy as np

    return _random_batch(cfg, batch_id, np.random.default_rng(batch_id), torch.Generator().manual_seed(batch_id))


def test_round_trip_every_tensor(tmp_path, cache):
    cache_dir, cfg = cache
    tensors, samples = _batch(cfg, 7)
    write_shard(cache_dir, cfg, 7, tensors, samples)
    reader = ShardReader(cache_dir)
    got, info = reader.read(7, verify_checksum=True)
    assert set(got) == set(tensors)
    for name in tensors:
        assert got[name].dtype == tensors[name].dtype
        assert torch.equal(got[name].view(torch.uint8), tensors[name].view(torch.uint8)), name
    assert info.samples == samples
    # Into caller-provided buffers, reused across reads.
    out = allocate_shard_buffers(cfg)
    got2, _ = reader.read(7, out=out)
    assert got2 is out and torch.equal(out["input_ids"], tensors["input_ids"])


def test_fp8_round_trip_error_is_small():
    torch.manual_seed(0)
    # Rows of very different magnitude, as deep layers have: per-row scales keep relative error flat.
    hidden = torch.randn(512, 5, 256) * torch.logspace(-2, 3, 5).view(1, 5, 1)
    enc = encode_hidden(hidden.to(torch.bfloat16), "fp8")
    dec = decode_hidden(enc["hidden"], enc["hidden_scale"]).float()
    rel = ((dec - hidden).norm() / hidden.norm()).item()
    per_tap = [((dec[:, j] - hidden[:, j]).norm() / hidden[:, j].norm()).item() for j in range(5)]
    print(f"fp8 e4m3 round trip: relative L2 error {rel:.4f}, per tap {[f'{e:.4f}' for e in per_tap]}")
    assert max(per_tap) < 0.04  # e4m3 has 3 mantissa bits: measured 2.6% relative L2 on Gaussian rows
    assert encode_hidden(hidden, "bf16")["hidden"].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_encoding_is_the_plain_per_row_formula_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(1)
    hidden = (torch.randn(64, 3, 96, generator=gen) * torch.logspace(-3, 4, 64).view(64, 1, 1)).to(dtype)
    hidden[5, 1] = 0.0  # an all-zero row: scale 1
    x64 = hidden.double()
    amax = x64.abs().amax(-1).float()  # exact: a max of values already in fp32
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    want = (x64.float() / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    enc = encode_hidden(hidden, "fp8")
    assert torch.equal(enc["hidden_scale"], scale) and enc["hidden_scale"][5, 1] == 1.0
    assert torch.equal(enc["hidden"].view(torch.uint8), want.view(torch.uint8))


def test_checksum_crc_is_zlibs_crc32():
    """The fast CRC in use (ISA-L's, a dependency) gives zlib's values, chained across pieces too, so
    caches written with either verify with the other."""
    import zlib

    from shards.common.crc import crc32

    assert crc32 is pytest.importorskip("isal.isal_zlib").crc32
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    raw = data.numpy().tobytes()
    for begin, end in ((0, 0), (0, 1), (5, 4099), (0, len(raw))):
        assert crc32(raw[begin:end]) == zlib.crc32(raw[begin:end])
    assert crc32(raw[1000:], crc32(raw[:1000], 7)) == zlib.crc32(raw, 7)


@pytest.mark.parametrize(
    "how,expect",
    [("truncate", "truncated"), ("flip", "checksum mismatch"), ("version", "format version"), ("shape", "input_ids")],
)
def test_corruption_is_caught_by_reader_and_verify(cache, how, expect):
    cache_dir, cfg = cache
    path = shard_path(cache_dir, 1)
    corrupt_shard(path, how)
    reader = ShardReader(cache_dir)
    with pytest.raises(ShardError) as e:
        reader.read(1, verify_checksum=True)
    assert str(path) in str(e.value) and expect in str(e.value)
    result = CliRunner().invoke(shards_cli, ["verify", str(cache_dir), "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert [b["file"] for b in report["bad"]] == [str(path)]
    assert expect in report["bad"][0]["reason"]
    # Good shards still read.
    reader.read(0, verify_checksum=True)


def test_verify_quarantine_moves_bad_shard(cache):
    cache_dir, _ = cache
    corrupt_shard(shard_path(cache_dir, 2), "flip")
    report = verify_cache(cache_dir, quarantine=True)
    assert not report.ok and not shard_path(cache_dir, 2).exists()
    assert (cache_dir / "quarantine" / shard_path(cache_dir, 2).name).exists()
    assert ShardReader(cache_dir).batch_ids() == [0, 1]


@pytest.mark.parametrize("command", [["verify", "--quarantine"], ["index"]])
def test_a_read_only_cache_gives_one_line_not_a_traceback(cache, monkeypatch, command):
    cache_dir, _ = cache
    corrupt_shard(shard_path(cache_dir, 2), "flip")

    def read_only(path, *args, **kwargs):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr("shards.common.owned.Dir.replace", read_only)  # the quarantine's move
    monkeypatch.setattr("shards.manifest.atomic_write_bytes", read_only)
    result = CliRunner().invoke(shards_cli, [command[0], str(cache_dir), *command[1:]])
    assert result.exit_code == 1 and "Read-only file system" in result.output, result.output
    assert isinstance(result.exception, SystemExit), "a one-line error, no traceback"


def test_wrong_cache_format_version_is_refused(cache):
    cache_dir, _ = cache
    p = cache_dir / "cache.json"
    p.write_text(p.read_text().replace(f'"format_version": {FORMAT_VERSION}', '"format_version": 99'))
    with pytest.raises(CacheFormatError, match="format version 99"):
        ShardReader(cache_dir)
    result = CliRunner().invoke(shards_cli, ["verify", str(cache_dir)])
    assert result.exit_code != 0 and "format version 99" in result.output
    # A version-1 cache (before shard headers named their cache) is refused with the way out.
    p.write_text(p.read_text().replace('"format_version": 99', '"format_version": 1'))
    with pytest.raises(CacheFormatError, match="version 1 .*re-run dflash-extract"):
        ShardReader(cache_dir)


@pytest.mark.slow
def test_killed_writer_leaves_no_shard(cache, tmp_path):
    cache_dir, cfg = cache
    # A child process starts writing a shard and is SIGKILLed half way through the data.
    script = textwrap.dedent(f"""
        import os, signal, sys
        import numpy as np, torch
        sys.path.insert(0, {os.getcwd()!r})
        import shards.container as c
        from shards import read_cache_config, write_shard
        from tools.fixtures.synthetic_cache import _random_batch
        cfg = read_cache_config({str(cache_dir)!r})
        tensors, samples = _random_batch(cfg, 9, np.random.default_rng(9), torch.Generator().manual_seed(9))
        real = c.raw_bytes
        def dying(t):
            b = real(t)
            if b.nbytes > 1000:
                os.kill(os.getpid(), signal.SIGKILL)
            return b
        c.raw_bytes = dying
        write_shard({str(cache_dir)!r}, cfg, 9, tensors, samples)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert not shard_path(cache_dir, 9).exists()
    assert 9 not in ShardReader(cache_dir).batch_ids()
    leftovers = list((cache_dir / "shards").glob(".tmp-*"))
    assert leftovers, "the killed writer should have left only a temporary"
    assert verify_cache(cache_dir).ok


def test_write_error_leaves_no_shard(cache, monkeypatch):
    cache_dir, cfg = cache
    tensors, samples = _batch(cfg, 5)
    import shards.writer as w

    def full_disk(f, tensors, metadata):
        f.write(b"x" * 10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(w, "write_container", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_shard(cache_dir, cfg, 5, tensors, samples)
    assert not shard_path(cache_dir, 5).exists()
    assert not list((cache_dir / "shards").glob(".tmp-*"))


def test_writer_rejects_wrong_shapes(cache):
    cache_dir, cfg = cache
    tensors, samples = _batch(cfg, 4)
    tensors["input_ids"] = tensors["input_ids"][:-1]
    with pytest.raises(ValueError, match="input_ids"):
        write_shard(cache_dir, cfg, 4, tensors, samples)


def test_index_rebuilds_equal_manifest(cache):
    cache_dir, _ = cache
    original = read_manifest(cache_dir)
    (cache_dir / "manifest.parquet").unlink()
    result = CliRunner().invoke(shards_cli, ["index", str(cache_dir)])
    assert result.exit_code == 0, result.output
    assert read_manifest(cache_dir).equals(original)
    assert original.num_rows == sum(len(ShardReader(cache_dir).info(b).samples) for b in range(3))


def test_stale_manifest_is_reported(cache):
    cache_dir, cfg = cache
    tensors, samples = _batch(cfg, 3)
    write_shard(cache_dir, cfg, 3, tensors, samples)
    report = verify_cache(cache_dir)
    assert [b["reason"] for b in report.bad] == ["out of date with the shards"]
    assert report.remedy() == f"rebuild the manifest from the shards with `dflash-shards index {cache_dir}`"
    rebuild_manifest(cache_dir)
    assert verify_cache(cache_dir).ok


def test_a_shard_outside_the_plan_is_named_by_verify(reference, tmp_path):
    cache = copy_cache(reference, tmp_path)
    n = reference["num_batches"]
    shutil.copy(shard_path(cache, 0), shard_path(cache, n + 4))
    bad = verify_cache(cache).bad
    reasons = [b["reason"] for b in bad if b["batch_id"] == n + 4]
    assert reasons and f"outside the plan of {n} batches" in reasons[0], bad


def test_target_head_round_trip(cache):
    cache_dir, cfg = cache
    head = load_target_head(cache_dir)
    assert head["embed_tokens"].shape == (cfg.target.vocab_size, cfg.target.hidden_size)
    assert head["final_norm"].shape == (cfg.target.hidden_size,)


def test_epoch_order_deterministic_and_disjoint():
    ids = list(range(103))
    world = 4
    per_rank = [epoch_shard_order(ids, epoch=2, seed=7, rank=r, world_size=world) for r in range(world)]
    again = [epoch_shard_order(ids, epoch=2, seed=7, rank=r, world_size=world) for r in range(world)]
    assert per_rank == again
    flat = [b for r in per_rank for b in r]
    assert len(flat) == len(set(flat)) == 100  # 103 // 4 * 4: equal step counts on every rank
    assert {len(r) for r in per_rank} == {25}
    assert epoch_shard_order(ids, 3, 7, 0, world) != per_rank[0]
    assert epoch_shard_order(ids, 2, 8, 0, world) != per_rank[0]


def test_loader_reads_ahead_and_skips_bad_shards(cache):
    cache_dir, _ = cache
    corrupt_shard(shard_path(cache_dir, 1), "truncate")
    reader = ShardReader(cache_dir)
    strict = ShardLoader(reader, [0, 1, 2], num_buffers=2)
    with pytest.raises(ShardError, match="b00000001"):
        for shard in strict:
            shard.release()
    strict.close()
    loader = ShardLoader(reader, [0, 1, 2], num_buffers=2, skip_bad_shards=True)
    seen = []
    for shard in loader:
        seen.append((shard.batch_id, int(shard.tensors["input_ids"][0])))
        shard.release()
    loader.close()
    assert [b for b, _ in seen] == [0, 2]
    assert [b for b, _ in loader.skipped] == [1]
    expected0 = reader.read(0)[0]["input_ids"][0]
    assert seen[0][1] == int(expected0)


def test_cli_info_ls_show_json(cache):
    cache_dir, cfg = cache
    runner = CliRunner()
    info = json.loads(runner.invoke(shards_cli, ["info", str(cache_dir), "--json"]).output)
    assert info["num_shards"] == 3 and info["storage_dtype"] == cfg.storage_dtype
    assert 0 < info["padding_efficiency"] <= 1
    rows = json.loads(runner.invoke(shards_cli, ["ls", str(cache_dir), "--json"]).output)
    assert [r["batch_id"] for r in rows] == [0, 1, 2]
    sample = ShardReader(cache_dir).info(2).samples[1]
    shown = json.loads(runner.invoke(shards_cli, ["show", str(cache_dir), sample.sample_id, "--json"]).output)
    assert shown["length"] == sample.length and len(shown["input_ids"]) == sample.length
    assert len(shown["hidden"]) == cfg.num_taps and all(t["finite"] for t in shown["hidden"])
    missing = runner.invoke(shards_cli, ["show", str(cache_dir), "no-such-sample"])
    assert missing.exit_code != 0 and "no-such-sample" in missing.output
    text = runner.invoke(shards_cli, ["info", str(cache_dir)]).output
    assert "padding eff." in text


def test_swapped_target_head_is_refused(cache, tmp_path):
    cache_dir, _ = cache
    other = write_synthetic_cache(tmp_path / "other", seed=5)  # same shapes, other weights
    assert other.target_head_checksum != read_cache_config(cache_dir).target_head_checksum
    (cache_dir / "target_head.safetensors").write_bytes((tmp_path / "other" / "target_head.safetensors").read_bytes())
    with pytest.raises(CacheFormatError, match="another target's head"):
        load_target_head(cache_dir)
    assert not verify_cache(cache_dir).ok


def test_packing_and_dataset_are_typed_records_with_the_same_json_keys(tmp_path):
    from shards.format import CacheConfig, DatasetRecord, PackingRecord, TargetInfo

    packing = dict(
        algorithm="bfd/1",
        long_seqs="skip",
        num_batches=4,
        padding_efficiency=0.9,
        num_truncated=0,
        num_skipped=1,
        num_empty=2,
    )
    dataset = dict(path="d.jsonl", fingerprint="abc", num_samples=9, num_tokens=900, prepared=None, longest_response=7)
    raw = json.loads(
        CacheConfig(
            target=TargetInfo(name="t", config_hash="h", hidden_size=8, num_layers=4, vocab_size=16, dtype="bfloat16"),
            tap_layer_ids=[1],
            token_budget=32,
            max_seqs=2,
        ).to_json()
    )
    cfg = CacheConfig.from_json(json.dumps({**raw, "packing": packing, "dataset": dataset}))
    assert cfg.packing == PackingRecord(**packing) and cfg.dataset == DatasetRecord(**dataset)
    assert cfg.planned_batches == 4
    again = json.loads(cfg.to_json())
    assert (again["packing"], again["dataset"]) == (packing, dataset)
    assert CacheConfig.from_json(json.dumps({**raw, "packing": {}})).planned_batches is None
    older = {k: v for k, v in dataset.items() if k != "prepared"}  # caches written before `prepared` existed
    assert CacheConfig.from_json(json.dumps({**raw, "packing": packing, "dataset": older})).dataset == cfg.dataset
    # Nor before `longest_response`: it reads as unknown, and the cache keeps its identity and cache_id.
    oldest = {k: v for k, v in older.items() if k != "longest_response"}
    was = CacheConfig.from_json(json.dumps({**raw, "packing": packing, "dataset": oldest}))
    assert was.dataset.longest_response is None and was.identity() == cfg.identity()
    was.target_head_checksum = cfg.target_head_checksum = "crc32:00000000"
    assert was.cache_id() == cfg.cache_id()
    with pytest.raises(CacheFormatError, match=r"cache.json: unknown field packing.extra"):
        CacheConfig.from_json(json.dumps({**raw, "packing": {**packing, "extra": 1}}))


def test_the_repair_hint_never_repeats_overwrite_or_fast_resume():
    from shards.inspect import resume_command

    recorded = "dflash-extract --target /m --data 'my data.jsonl' --out /c --overwrite --fast-resume --compute fp8"
    assert resume_command(recorded) == "dflash-extract --target /m --data 'my data.jsonl' --out /c --compute fp8"
    assert resume_command("dflash-extract --out /c --overwrite 'unbalanced") == "dflash-extract --out /c 'unbalanced"
