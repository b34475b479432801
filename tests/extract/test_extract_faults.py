"""Fault injection, extraction side: a killed, starved or poisoned dflash-extract loses nothing and resumes.

Cases (tiny random target, 24 samples packed into 5 batches of token budget 256, CPU):
  1. SIGKILL at a seed-chosen point of a subprocess extraction, 8 seeds, no two at the same point: while
     writing cache.json, in the middle of shard k's bytes, with shard k complete but not yet renamed, right
     after shard k's rename, in the forward of batch k, in the middle of the manifest write (seeds 0-5, one
     each), then two more per-batch points with random k. The same command then resumes: same samples,
     byte-identical tensors and manifest as an uninterrupted run, no temporaries left.
  2. Disk full (OSError ENOSPC from the durable-write path) while writing shard 0, shard 3, the manifest or
     cache.json: nothing partial under a final name, no temporaries, earlier shards intact; once space
     exists the same command completes the cache and it equals the reference.
  3. Disk full as the user sees it (dflash-extract CLI): one line naming the shard file, its batch, the space
     a shard needs and what is free.
  4. NaN / Inf hidden states from the target at batch k > 0: the run stops naming the batch and exactly
     its samples; the shards before it are kept, and the rerun (target fixed) equals the reference.
  5. A finished cache with one damaged shard (flipped bit, truncated): the same command redoes that shard only.
  6. Resuming an extraction with other settings (target, token budget, max seqs, long-seqs policy, target
     top-k, dtype, MASK id, reordered data): refused naming the field; the cache is left byte-identical.
  7. A shard copied in from a cache of another dataset (same shapes): verify and the resumed extraction
     name it and leave it in place.
Elsewhere: --overwrite and nesting, locks, impossible settings, unwritable --out, SIGTERM during
extraction: test_extract_ownership.py; bad rows and damaged Parquet pages: dataset/test_dataset_faults.py;
damaged targets: target/test_target_checkpoint.py; damaged caches under dflash-shards verify:
tests/tools/cli/test_dflash_shards.py; a shard outside the plan: tests/shards/test_format.py; training
faults: tests/train/ (test_train_faults.py, test_train_damaged_cache.py, test_distributed_faults.py,
checkpoint/test_export_faults.py).
"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from extract.cache_dir import CacheMismatchError
from extract.cli import main as extract_cli
from extract.dataset.index import write_jsonl
from extract.runner import run_extract
from extract.target.model import TargetModel
from extract.writer import NonFiniteHiddenError
from shards import ShardReader, shard_path
from shards.common.cli_options import to_options
from shards.common.owned import OwnershipError
from shards.inspect import verify_cache
from tests.helpers.extract import (
    REPO,
    VOCAB,
    assert_equals_reference,
    cli_args,
    copy_cache,
    extract_cfg,
    make_samples,
    snapshot,
    temporaries,
)
from tools.fixtures.tiny_target import write_random_checkpoint

KILL_EXIT = -signal.SIGKILL


# ---- 1. SIGKILL at random points, then resume ------------------------------------------------------------

# The child runs run_extract with one hook that records where it is and SIGKILLs its own process there.
KILL_SCRIPT = textwrap.dedent("""
    import io, json, os, signal, sys
    cfg_json, point, k, marker = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    import shards.common.durable, shards.manifest, shards.writer
    from extract.config import ExtractConfig
    from extract.target.model import TargetModel
    from shards.common.cli_options import from_options
    from extract.runner import run_extract

    calls = [0]

    def nth():
        calls[0] += 1
        return calls[0] == k

    def die():
        with open(marker, "w") as f:
            f.write(f"{point} {k}")
        os.kill(os.getpid(), signal.SIGKILL)

    def in_shards_dir(path, dir_fd=None):
        # Durable writes rename relative to their directory's descriptor (shards/common/owned).
        where = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.path.dirname(str(path))
        return os.path.basename(where) == "shards"

    if point == "cache_config":  # after target_head.safetensors, before cache.json
        def dying_config(cache_dir, cfg):
            def half(f):
                text = cfg.to_json().encode()
                f.write(text[: len(text) // 2])
                f.flush()
                die()
            shards.common.durable.atomic_write(os.path.join(str(cache_dir), "cache.json"), half)
        shards.writer.write_cache_config = dying_config
    elif point == "mid_shard_write":  # half of shard k's bytes on disk under the temporary name
        real_container = shards.writer.write_container
        def dying_container(f, tensors, meta):
            if "batch_id" in meta and nth():
                buf = io.BytesIO()
                real_container(buf, tensors, meta)
                f.write(buf.getvalue()[: buf.tell() // 2])
                f.flush()
                die()
            real_container(f, tensors, meta)
        shards.writer.write_container = dying_container
    elif point in ("before_rename", "after_rename"):  # shard k complete and fsynced, (not) yet renamed
        real_replace = os.replace
        def dying_replace(src, dst, **kw):
            hit = in_shards_dir(dst, kw.get("dst_dir_fd")) and nth()
            if hit and point == "before_rename":
                die()
            real_replace(src, dst, **kw)
            if hit:
                die()
        os.replace = dying_replace
    elif point == "forward":  # in the main thread while the writer thread may be writing batch k-1
        real_forward = TargetModel.forward_packed
        def dying_forward(self, *a, **kw):
            if nth():
                die()
            return real_forward(self, *a, **kw)
        TargetModel.forward_packed = dying_forward
    elif point == "manifest":  # every shard written, manifest half written
        def dying_manifest(path, data):
            def half(f):
                f.write(data[: len(data) // 2])
                f.flush()
                die()
            shards.common.durable.atomic_write(path, half)
        shards.manifest.atomic_write_bytes = dying_manifest
    else:
        raise SystemExit(f"unknown kill point {point}")
    run_extract(from_options(ExtractConfig, json.loads(cfg_json)))
    raise SystemExit("the run finished without reaching its kill point")
""")

KILL_POINTS = ["cache_config", "mid_shard_write", "before_rename", "after_rename", "forward", "manifest"]
PER_BATCH_POINTS = KILL_POINTS[1:5]  # the points that take a batch number k
KILL_SEEDS = list(range(8))


def kill_plan(seed, num_batches):
    """(point, k) of a seed: seeds 0-5 visit every point once, later seeds draw a per-batch point; k is drawn
    from the seed (1-based: the k-th shard or forward), re-drawn until no lower seed has the same plan."""
    rng = np.random.default_rng(seed)
    earlier = {kill_plan(s, num_batches) for s in range(seed)}
    while True:
        k = int(rng.integers(1, num_batches + 1))
        point = KILL_POINTS[seed] if seed < len(KILL_POINTS) else PER_BATCH_POINTS[int(rng.integers(4))]
        if (point, k) not in earlier or seed < len(KILL_POINTS):
            return point, k


def kill_extraction(cfg, point, k, tmp_path):
    marker = tmp_path / f"killed-{point}-{k}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, json.dumps(to_options(cfg)), point, str(k), str(marker)],
        capture_output=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == KILL_EXIT, f"exit {proc.returncode}, expected SIGKILL:\n{proc.stderr.decode()[-3000:]}"
    assert marker.read_text() == f"{point} {k}", "killed, but not at the injected point"


@pytest.mark.slow
@pytest.mark.parametrize("seed", KILL_SEEDS)
def test_sigkill_at_random_point_then_resume_gives_identical_cache(target, data, reference, tmp_path, seed):
    n = reference["num_batches"]
    point, k = kill_plan(seed, n)
    assert len({kill_plan(s, n) for s in KILL_SEEDS}) == len(KILL_SEEDS), "two seeds kill at the same point"
    out = tmp_path / "cache"
    cfg = extract_cfg(target, data, out)
    kill_extraction(cfg, point, k, tmp_path)

    present = ShardReader(out).batch_ids() if (out / "cache.json").exists() else []
    print(f"seed {seed}: SIGKILL at {point}, k={k}; shards present after the kill: {present}")
    assert not (out / "manifest.parquet").exists(), "a killed run must not leave a manifest"
    if point == "cache_config":
        assert not (out / "cache.json").exists() and present == []
    elif point in ("mid_shard_write", "before_rename"):
        assert k - 1 not in present and not shard_path(out, k - 1).exists(), "a partial shard under its final name"
        assert list((out / "shards").glob(".tmp-*")), "the killed writer should have left its temporary"
    elif point == "after_rename":
        assert k - 1 in present
    elif point == "forward":
        assert len(present) < n
    elif point == "manifest":
        assert present == list(range(n))
    for b in present:  # whatever carries a final name is complete
        ShardReader(out).verify(b)

    summary = run_extract(extract_cfg(target, data, out))
    assert summary.resumed == len(present), "complete shards must be kept, not extracted again"
    assert summary.written == n - len(present)
    assert_equals_reference(out, reference)


# ---- 2-3. disk full ---------------------------------------------------------------------------------------


def inject_disk_full(monkeypatch, file_name):
    """The durable write of `file_name` runs out of space after 4 KB, as a real full disk fails a write.

    Every durable file (shards, target head, cache.json, manifest) is written by Dir.write_atomic
    (shards/common/owned), so the fault enters below the library's own cleanup, which is part of what is tested.
    """
    from shards.common.owned import Dir

    real = Dir.write_atomic
    failed = []

    def write_atomic(self, name, write, *args):
        def fill_disk(f):
            if name == file_name:
                failed.append(str(self.path / name))
                f.write(b"\0" * 4096)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            write(f)

        real(self, name, fill_disk, *args)

    monkeypatch.setattr(Dir, "write_atomic", write_atomic)
    return failed


def errno_in_chain(exc, code):
    while exc is not None:
        if getattr(exc, "errno", None) == code:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# (file that fills the disk, shards expected on disk afterwards: None = all of them)
DISK_FULL_AT = {
    "shard 0": ("b00000000.safetensors", []),
    "shard 3": ("b00000003.safetensors", [0, 1, 2]),
    "manifest": ("manifest.parquet", None),
    "cache creation": ("cache.json", []),
}


@pytest.mark.parametrize("where", list(DISK_FULL_AT))
def test_disk_full_leaves_no_partial_file_and_rerun_completes(target, data, reference, tmp_path, monkeypatch, where):
    file_name, kept = DISK_FULL_AT[where]
    kept = list(range(reference["num_batches"])) if kept is None else kept
    out = tmp_path / "cache"
    failed = inject_disk_full(monkeypatch, file_name)
    with pytest.raises(Exception) as e:
        run_extract(extract_cfg(target, data, out))
    assert failed, f"the run never wrote {file_name}"
    assert errno_in_chain(e.value, errno.ENOSPC), f"the disk-full error was lost: {e.value!r}"
    assert not os.path.exists(failed[0]), f"{failed[0]}: a partial file under its final name"
    assert temporaries(out) == [], "the failed write left its temporary behind"
    present = ShardReader(out).batch_ids() if (out / "cache.json").exists() else []
    assert present == kept, f"disk full at {file_name}: expected shards {kept} to be kept, found {present}"
    for b in present:
        ShardReader(out).verify(b)
    assert not (out / "manifest.parquet").exists()

    monkeypatch.undo()  # space again: the same command completes the cache
    summary = run_extract(extract_cfg(target, data, out))
    assert summary.resumed == len(kept) and summary.written == reference["num_batches"] - len(kept)
    assert_equals_reference(out, reference)


def test_disk_full_error_names_the_batch_and_its_file(target, data, tmp_path, monkeypatch):
    out = tmp_path / "cache"
    inject_disk_full(monkeypatch, "b00000001.safetensors")
    result = CliRunner().invoke(extract_cli, cli_args(target, data, out))
    assert result.exit_code == 1
    shown = result.output
    print(f"dflash-extract output on a full disk:\n{shown}\nexception: {result.exception!r}")
    assert "No space left on device" in shown, "the user must see why the run stopped, not a bare traceback"
    shard = shard_path(out, 1)
    assert f"Error: writing {shard} failed: No space left on device (needs " in shown, shown
    assert "free there); batch 1 was not written, the shards before it are kept" in shown, shown
    assert "Traceback" not in shown and shown.count("Error: ") == 1, shown


# ---- 4. non-finite hidden states --------------------------------------------------------------------------


@pytest.mark.parametrize("value,batch", [(float("nan"), 2), (float("inf"), 1), (float("-inf"), 4)])
def test_non_finite_batch_stops_naming_it_and_keeps_earlier_shards(
    target, data, reference, tmp_path, monkeypatch, value, batch
):
    real = TargetModel.forward_packed
    calls = [0]

    def poisoned(self, ids, pos, cu, taps):
        hidden = real(self, ids, pos, cu, taps)
        calls[0] += 1
        if calls[0] == batch + 1:  # batches run in id order on one rank
            hidden = hidden.clone()
            hidden[int(ids.shape[0]) - 1, -1, 3] = value
        return hidden

    monkeypatch.setattr(TargetModel, "forward_packed", poisoned)
    out = tmp_path / "cache"
    with pytest.raises(NonFiniteHiddenError) as e:
        run_extract(extract_cfg(target, data, out))
    msg = str(e.value)
    assert f"batch {batch}:" in msg and "NaN/Inf" in msg, msg
    assert str(reference["samples_of"][batch]) in msg, f"the message must list batch {batch}'s samples: {msg}"
    present = ShardReader(out).batch_ids()
    assert present == list(range(batch)), f"shards before batch {batch} must be kept, found {present}"
    assert temporaries(out) == []

    monkeypatch.undo()
    summary = run_extract(extract_cfg(target, data, out))
    assert summary.resumed == batch
    assert_equals_reference(out, reference)


# ---- 5. a damaged shard in a finished cache is redone by the same command ---------------------------------


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_rerun_redoes_a_damaged_shard_only(target, data, reference, tmp_path, how):
    out = tmp_path / "cache"
    shutil.copytree(reference["dir"], out)
    path = shard_path(out, 2)
    raw = bytearray(path.read_bytes())
    if how == "flip":
        raw[-20] ^= 0x01  # one bit in the data section: only the checksum sees it
    else:
        del raw[-100:]
    path.write_bytes(bytes(raw))
    assert not verify_cache(out).ok
    summary = run_extract(extract_cfg(target, data, out))
    assert (summary.written, summary.resumed) == (1, reference["num_batches"] - 1), "only batch 2 is redone"
    assert_equals_reference(out, reference)


# ---- 6. resuming an extraction with other settings --------------------------------------------------------


def _reordered(tmp_path):
    path = tmp_path / "reordered.jsonl"
    samples = make_samples()
    samples[0], samples[1] = samples[1], samples[0]
    write_jsonl(path, samples)
    return {"data": str(path)}


def _other_target(tmp_path):
    return {"target": str(write_random_checkpoint(tmp_path / "other", seed=2, dtype=torch.float32))}


RESUME_CHANGES = [
    ("target", _other_target, "target.name"),
    ("token_budget", lambda t: {"token_budget": 512}, "token_budget: cache has 256, this run has 512"),
    ("max_seqs", lambda t: {"max_seqs": 4}, "max_seqs: cache has 8, this run has 4"),
    ("long_seqs", lambda t: {"long_seqs": "skip"}, "packing.long_seqs: cache has 'truncate', this run has 'skip'"),
    ("target_topk", lambda t: {"target_topk": 2}, "target_topk: cache has 0, this run has 2"),
    ("dtype", lambda t: {"dtype": "bfloat16"}, "target.dtype: cache has 'float32', this run has 'bfloat16'"),
    ("mask_token_id", lambda t: {"mask_token_id": 7}, f"mask_token_id: cache has {VOCAB - 1}, this run has 7"),
    ("reordered data", _reordered, "dataset.fingerprint"),
]


@pytest.mark.parametrize("name,change,field", RESUME_CHANGES, ids=[c[0] for c in RESUME_CHANGES])
def test_resume_with_other_settings_is_refused_and_cache_untouched(
    target, data, reference, tmp_path, name, change, field
):
    cache = copy_cache(reference, tmp_path)
    before = snapshot(cache)
    kw = {"target": target, "data": data, **change(tmp_path)}
    with pytest.raises(CacheMismatchError) as e:
        run_extract(extract_cfg(kw.pop("target"), kw.pop("data"), cache, **kw))
    assert field in str(e.value) and "--overwrite" in str(e.value), str(e.value)
    assert snapshot(cache) == before, "a refused resume must leave the cache as it was"


# ---- 7. a shard of another dataset ------------------------------------------------------------------------


def test_a_shard_of_another_dataset_is_refused_on_resume_and_by_verify(target, data, reference, tmp_path):
    cache = copy_cache(reference, tmp_path)
    samples = make_samples()
    samples[0], samples[1] = samples[1], samples[0]  # same samples, other order: another dataset fingerprint
    other_data = tmp_path / "other.jsonl"
    write_jsonl(other_data, samples)
    other = tmp_path / "other"
    run_extract(extract_cfg(target, other_data, other))
    shutil.copy(shard_path(other, 3), shard_path(cache, 3))
    foreign = shard_path(cache, 3).read_bytes()
    bad = verify_cache(cache).bad
    assert [b["file"] for b in bad if b["batch_id"] == 3] == [str(shard_path(cache, 3))], bad
    assert "belongs to another cache" in next(b["reason"] for b in bad if b["batch_id"] == 3)
    with pytest.raises(OwnershipError, match="b00000003.safetensors: belongs to another cache"):
        run_extract(extract_cfg(target, data, cache))
    assert shard_path(cache, 3).read_bytes() == foreign, "a shard that is not this cache's is left for the user"
