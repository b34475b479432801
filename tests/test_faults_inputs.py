"""Fault injection, inputs and cache side: bad data, damaged caches, mismatched settings, killed training.

Cases (the tiny target and reference cache of test_faults.py; training through the dflash-train CLI):
  1. A damaged extracted cache under `dflash-shards verify` (exit code 1, each problem named by file): shard
     deleted after extraction (named as missing), manifest out of date, manifest unreadable, cache.json of
     another format version, target head with a flipped byte, target head deleted.
  2. Training on a damaged cache: a truncated shard, a shard of another format version, a deleted shard;
     refused naming the shard file, or skipped with --skip-bad-shards and counted (summary line, metrics
     event, data/skipped_shards). A damaged target head is refused naming target_head.safetensors.
  3. Bad dataset rows through the dflash-extract CLI (the message the user sees names file, row and reason;
     nothing is written): ids outside the vocabulary (JSONL, Parquet), negative ids, mask/ids length
     mismatch (JSONL, Parquet), malformed JSON line, missing input_ids, a file that is not Parquet, a
     Parquet column of the wrong type, a null token, an over-long sample under --long-seqs error.
  4. Empty and over-long samples under --long-seqs truncate / skip: extracted, skipped and counted in
     cache.json and the log, never silently.
  4b. A Parquet page damaged inside a row group (its page header, or its body under page checksums), in a
     one-file dataset and in one of three files: one message naming file, row group and rows and the
     fix, exit 1, no traceback, no cache written.
  5. Resuming an extraction with other settings (target, token budget, max seqs, long-seqs policy, target
     top-k, dtype, MASK id, reordered data): refused naming the field; the cache is left byte-identical.
  6. Resuming training with a cache of another target: refused naming the target config hash.
  7. Training SIGKILLed in a subprocess in the middle of writing a checkpoint: the partial checkpoint is
     ignored, the resume starts from the previous one and continues exactly (losses equal to 1e-6).
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from extract.cli import main as extract_cli
from extract.dataset.index import Sample, write_jsonl, write_parquet
from extract.runner import CacheMismatchError, run_extract
from shards import ShardReader, shard_path, write_manifest
from tests.helpers.extract import REPO, VOCAB, cli_args, copy_cache, corrupt_shard, extract_cfg, make_samples, snapshot
from tests.helpers.train import read_records, tiny_cache, tiny_cli_args, tiny_config
from tools.cli.dflash_shards import main as shards_cli
from tools.fixtures.tiny_target import write_random_checkpoint
from train.checkpoint.store import latest_checkpoint
from train.cli import main as train_cli
from train.loop import run_training


def flip_byte(path, offset=-10):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


# ---- 1. dflash-shards verify on a damaged cache -----------------------------------------------------------


def _missing_shard(cache):
    shard_path(cache, 2).unlink()
    return shard_path(cache, 2), "missing"


# A deleted shard also leaves the manifest listing its samples, but the re-extraction that restores the
# shard rewrites the manifest: verify reports the shard only, with that one remedy.
ALSO_BAD: dict[str, list[str]] = {}


def _stale_manifest(cache):
    reader = ShardReader(cache)
    write_manifest(cache, [reader.info(b) for b in reader.batch_ids()[:-1]])  # as before the last shard
    return cache / "manifest.parquet", "out of date with the shards"


def _unreadable_manifest(cache):
    (cache / "manifest.parquet").write_bytes(b"PAR1 not parquet")
    return cache / "manifest.parquet", "unreadable"


def _head_flipped(cache):
    flip_byte(cache / "target_head.safetensors")
    return cache / "target_head.safetensors", "checksum mismatch"


def _head_missing(cache):
    (cache / "target_head.safetensors").unlink()
    return cache / "target_head.safetensors", "not found"


@pytest.mark.parametrize(
    "damage",
    [_missing_shard, _stale_manifest, _unreadable_manifest, _head_flipped, _head_missing],
    ids=lambda f: f.__name__.strip("_"),
)
def test_verify_names_each_damage(reference, tmp_path, damage):
    cache = copy_cache(reference, tmp_path)
    path, reason = damage(cache)
    result = CliRunner().invoke(shards_cli, ["verify", str(cache), "--json"])
    assert result.exit_code == 1, result.output
    bad = json.loads(result.output)["bad"]
    also = [str(cache / name) for name in ALSO_BAD.get(damage.__name__, [])]
    assert [b["file"] for b in bad] == [str(path), *also], bad
    assert reason in bad[0]["reason"], bad
    assert json.loads(result.output)["remedy"], "every damage comes with its remedy"
    text = CliRunner().invoke(shards_cli, ["verify", str(cache)])
    assert text.exit_code == 1 and f"BAD {path}" in text.output, text.output


def test_verify_refuses_another_cache_format_version(reference, tmp_path):
    cache = copy_cache(reference, tmp_path)
    config = cache / "cache.json"
    config.write_text(config.read_text().replace('"format_version": 2', '"format_version": 7'))
    result = CliRunner().invoke(shards_cli, ["verify", str(cache)])
    assert result.exit_code == 1
    assert str(config) in result.output and "format version 7" in result.output, result.output


# ---- 2. training on a damaged cache -----------------------------------------------------------------------

BAD_SHARD = 2


def _damage_shard(cache, how):
    path = shard_path(cache, BAD_SHARD)
    if how == "missing":
        path.unlink()
        return path, "missing"
    corrupt_shard(path, how)
    return path, {"truncate": "truncated", "version": "format version"}[how]


def train_args(cache, run, *extra):
    return tiny_cli_args(cache, run, "--epochs", "1", "--mask-token-id", str(VOCAB - 1), *extra)


@pytest.mark.parametrize("how", ["truncate", "version", "missing"])
def test_training_refuses_a_bad_shard_naming_it(reference, tmp_path, how):
    cache = copy_cache(reference, tmp_path)
    path, reason = _damage_shard(cache, how)
    result = CliRunner().invoke(train_cli, train_args(cache, tmp_path / "run"))
    assert result.exit_code != 0, f"training on a cache with a {how} shard must stop:\n{result.output}"
    assert str(path) in result.output and reason in result.output, result.output
    assert latest_checkpoint(tmp_path / "run") is None
    if how == "missing":  # seen from the file listing before any set-up: no run directory is made
        assert "1 of its" in result.output and "planned shards are missing" in result.output, result.output
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("how", ["truncate", "version", "missing"])
def test_training_skips_a_bad_shard_and_counts_it(reference, tmp_path, how):
    cache = copy_cache(reference, tmp_path)
    _damage_shard(cache, how)
    run = tmp_path / "run"
    result = CliRunner().invoke(train_cli, train_args(cache, run, "--skip-bad-shards"))
    assert result.exit_code == 0, result.output
    assert "1 shard skipped" in result.output, result.output
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["batch_id"] for e in events if e.get("event") == "skipped_shard"] == [BAD_SHARD]
    records = read_records(run)
    assert records[-1]["data/skipped_shards"] == 1
    assert len(records) == reference["num_batches"] - 1, "one step per good shard"


def test_training_refuses_a_damaged_target_head_naming_it(reference, tmp_path):
    cache = copy_cache(reference, tmp_path)
    flip_byte(cache / "target_head.safetensors")
    result = CliRunner().invoke(train_cli, train_args(cache, tmp_path / "run"))
    assert result.exit_code != 0
    assert str(cache / "target_head.safetensors") in result.output and "checksum" in result.output, result.output


# ---- 3-4. bad inputs to dflash-extract --------------------------------------------------------------------


def _good_rows(n=5):
    return [{"id": f"g{i}", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]} for i in range(n)]


def _jsonl(tmp_path, bad_row, row=2):
    rows = [json.dumps(r) for r in _good_rows()]
    rows[row] = bad_row if isinstance(bad_row, str) else json.dumps(bad_row)
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def _parquet(tmp_path, columns):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table(columns), path, row_group_size=2)
    return path


def _garbage(path):
    path.write_bytes(b"PAR1 truncated")
    return path


def _ids(n=5):
    return [[1, 2, 3, 4] for _ in range(n)]


BAD_INPUTS = [
    (
        "jsonl id outside vocab",
        lambda t: _jsonl(t, {"input_ids": [1, VOCAB]}),
        rf"bad.jsonl, row 2 \(line 3\): input_ids\[1\] = {VOCAB} is outside \[0, {VOCAB}\)",
    ),
    (
        "jsonl negative id",
        lambda t: _jsonl(t, {"input_ids": [-3, 1]}),
        r"bad.jsonl, row 2 \(line 3\): input_ids\[0\] = -3 is outside",
    ),
    (
        "jsonl mask length",
        lambda t: _jsonl(t, {"input_ids": [1, 2, 3], "loss_mask": [1, 1]}),
        r"bad.jsonl, row 2 \(line 3\): loss_mask has 2 values, input_ids has 3",
    ),
    ("jsonl malformed", lambda t: _jsonl(t, '{"input_ids": [1, 2'), r"bad.jsonl, row 2 \(line 3\): malformed JSON"),
    ("jsonl no input_ids", lambda t: _jsonl(t, {"tokens": [1]}), r"bad.jsonl, row 2 \(line 3\): missing input_ids"),
    (
        "parquet id outside vocab",
        lambda t: _parquet(t, {"input_ids": _ids(3) + [[1, VOCAB + 7]] + _ids(1)}),
        rf"bad.parquet, row 3: input_ids\[1\] = {VOCAB + 7} is outside",
    ),
    (
        "parquet mask length",
        lambda t: _parquet(t, {"input_ids": _ids(), "loss_mask": [[1] * 4] * 4 + [[1]]}),
        r"bad.parquet, row 4: loss_mask has 1 values, input_ids has 4",
    ),
    (
        "parquet null token",
        lambda t: _parquet(t, {"input_ids": _ids(1) + [[1, None]] + _ids(3)}),
        r"bad.parquet, row 1: input_ids contains a null value",
    ),
    (
        "parquet float ids",
        lambda t: _parquet(t, {"input_ids": [[1.0, 2.0]] * 5}),
        r"bad.parquet: column input_ids has type list<.*double>, expected a list of integers",
    ),
    ("not parquet", lambda t: _garbage(t / "bad.parquet"), r"bad.parquet: not a readable Parquet file"),
    (
        "long sample, --long-seqs error",
        lambda t: _jsonl(t, {"id": "big", "input_ids": [5] * 300}),
        r"bad.jsonl, row 2 \(line 3\): sample 'big' has 300 tokens, more than token_budget 256",
    ),
]


@pytest.mark.parametrize("name,make,reason", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_extract_cli_rejects_bad_rows_naming_file_row_and_reason(target, tmp_path, name, make, reason):
    path = make(tmp_path)
    out = tmp_path / "cache"
    result = CliRunner().invoke(extract_cli, cli_args(target, path, out, "--long-seqs", "error"))
    assert result.exit_code == 1, result.output
    assert str(path) in result.output and re.search(reason, result.output), result.output
    assert not out.exists(), "a refused dataset must not leave a cache behind"


@pytest.mark.parametrize("policy", ["truncate", "skip"])
def test_empty_and_long_samples_are_counted_never_silent(target, tmp_path, caplog, policy):
    samples = make_samples(n=8, seed=3)
    samples[1] = Sample("empty-a", [], [])
    samples[5] = Sample("empty-b", [], [])
    samples[6] = Sample("long", [7] * 300, [1] * 300)
    path = tmp_path / "data.jsonl"
    write_jsonl(path, samples)
    out = tmp_path / "cache"
    caplog.set_level("INFO")
    result = CliRunner().invoke(extract_cli, cli_args(target, path, out, "--long-seqs", policy))
    assert result.exit_code == 0, result.output
    packing = json.loads((out / "cache.json").read_text())["packing"]
    assert packing["num_empty"] == 2
    assert (packing["num_truncated"], packing["num_skipped"]) == ((1, 0) if policy == "truncate" else (0, 1))
    assert "2 empty samples skipped (e.g. empty-a, empty-b)" in caplog.text
    counted = "1 truncated (-44 tokens)" if policy == "truncate" else "1 long skipped (-300 tokens)"
    assert counted in caplog.text, caplog.text
    reader = ShardReader(out)
    lengths = {s.sample_id: s.length for b in reader.batch_ids() for s in reader.info(b).samples}
    want = {s.sample_id for s in samples if len(s)} - ({"long"} if policy == "skip" else set())
    assert set(lengths) == want
    if policy == "truncate":
        assert lengths["long"] == 256


# ---- 4b. a damaged Parquet page ---------------------------------------------------------------------------


def damage_page(path, row_group: int, where: str) -> int:
    """Flip 4 bytes of the input_ids data page of `row_group`, found from the file's own metadata (the
    footer stays intact): at the page's first byte ("page header": its Thrift header no longer parses)
    or half way through the page ("page body": only its CRC checksum can tell). Returns the offset."""
    meta = pq.ParquetFile(path).metadata.row_group(row_group)
    col = next(meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema.startswith("input_ids"))
    end = (col.dictionary_page_offset or col.data_page_offset) + col.total_compressed_size  # the chunk's end
    offset = col.data_page_offset if where == "page header" else (col.data_page_offset + end) // 2
    raw = bytearray(path.read_bytes())
    raw[offset : offset + 4] = bytes(b ^ 0xFF for b in raw[offset : offset + 4])
    path.write_bytes(bytes(raw))
    return offset


@pytest.mark.parametrize("files", [1, 3], ids=["one file", "one of three files"])
@pytest.mark.parametrize("where", ["page header", "page body"])
def test_a_damaged_parquet_page_names_file_and_row_group(target, tmp_path, files, where):
    samples = make_samples()  # 24 samples: 8 per file, row groups of 4 (or 24 in one file, row groups of 8)
    per_file, group = len(samples) // files, 8 if files == 1 else 4
    folder = tmp_path / "data"
    folder.mkdir()
    paths = [folder / f"part-{i}.parquet" for i in range(files)]
    for i, path in enumerate(paths):
        part = samples[i * per_file : (i + 1) * per_file]
        if where == "page header":  # a file written without page checksums, as most writers do
            rows = {"id": [s.sample_id for s in part], "input_ids": [s.input_ids.tolist() for s in part]}
            pq.write_table(pa.table(rows), path, row_group_size=group)
        else:
            write_parquet(path, part, row_group_size=group)  # with page checksums
    bad = paths[len(paths) // 2]
    damage_page(bad, 1, where)
    assert pq.ParquetFile(bad).metadata.num_rows == per_file, "the footer must still read: the damage is in a page"
    out = tmp_path / "cache"
    result = CliRunner().invoke(extract_cli, cli_args(target, bad if files == 1 else folder, out))
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), f"raw traceback: {result.exception!r}"
    assert f"{bad}, row group 1 (rows {group}-{2 * group - 1}): damaged Parquet data" in result.output, result.output
    assert "restore it from its source or write it again" in result.output
    assert all(str(p) not in result.output for p in paths if p != bad), "only the damaged file is named"
    assert not out.exists(), "no cache.json and no shard for a dataset that cannot be read"


# ---- 5. resuming an extraction with other settings --------------------------------------------------------


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


# ---- 6-7. training resume faults --------------------------------------------------------------------------


def test_training_resume_on_a_cache_of_another_target_is_refused(tmp_path):
    run = tmp_path / "run"
    first = tiny_cache(tmp_path / "a", num_batches=2, seed=0)
    result = CliRunner().invoke(train_cli, tiny_cli_args(first, run, "--max-steps", "2"))
    assert result.exit_code == 0, result.output
    other = tiny_cache(tmp_path / "b", num_batches=2, seed=1)  # config_hash synthetic-1
    result = CliRunner().invoke(train_cli, tiny_cli_args(other, run, "--max-steps", "4", "--resume"))
    assert result.exit_code != 0
    assert "cache target config_hash: checkpoint 'synthetic-0', now 'synthetic-1'" in result.output, result.output


# The child trains through the CLI and SIGKILLs itself half way through writing its second checkpoint's
# optimizer state, so a .tmp-step-* folder with a partial optimizer.pt is all that is left of it.
TRAIN_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    marker = sys.argv[1]
    real_save = torch.save
    calls = [0]

    def dying_save(obj, f, *a, **kw):
        calls[0] += 1
        if calls[0] == 2:
            with open(f, "wb") as out:
                out.write(b"partial optimizer state")
            with open(marker, "w") as m:
                m.write(str(f))
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *a, **kw)

    torch.save = dying_save
    from train.cli import main
    main(sys.argv[2:])
""")


@pytest.mark.slow
def test_training_killed_while_checkpointing_resumes_exactly(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=4)
    settings = dict(epochs=4, checkpoint_every=4, keep_checkpoints=3, metrics_every=3)
    full = tmp_path / "full"
    run_training(tiny_config(cache, full, **settings))
    reference = {r["step"]: r["loss/total"] for r in read_records(full)}
    assert sorted(reference) == list(range(1, 17))

    killed = tmp_path / "killed"
    marker = tmp_path / "killed-at"
    args = tiny_cli_args(
        cache, killed, "--epochs", "4", "--checkpoint-every", "4", "--keep-checkpoints", "3", "--metrics-every", "3"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, "-c", TRAIN_KILL_SCRIPT, str(marker), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    assert ".tmp-step-00000008" in marker.read_text(), marker.read_text()
    assert latest_checkpoint(killed).step == 4, "the half-written step 8 must not count as a checkpoint"
    assert list(killed.glob(".tmp-step-00000008-*")), "the kill should have left the partial checkpoint"

    run_training(tiny_config(cache, killed, resume=True, **settings))
    got = {r["step"]: r["loss/total"] for r in read_records(killed)}  # steps 5-8 logged twice: the later wins
    assert sorted(got) == list(range(1, 17))
    diffs = {s: abs(got[s] - reference[s]) for s in range(5, 17)}
    assert max(diffs.values()) <= 1e-6, f"max abs loss diff {max(diffs.values())} (per step: {diffs})"
    assert not list(killed.glob(".tmp-step-*")), "the partial checkpoint must be cleaned up"
    assert latest_checkpoint(killed).step == 16
