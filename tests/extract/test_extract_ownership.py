"""Fault injection, ownership side: dflash-extract never deletes or overwrites what it did not write,
one job at a time holds a cache, settings that can never work are refused before any work, SIGTERM
stops an extraction cleanly.

Cases (the tiny target, dataset and reference cache of tests/conftest.py):
  1. --overwrite on a folder of user files, on a cache holding a user file, on a cache of ours (only our
     files go, the rebuilt cache equals the reference); the refusal without --overwrite does not
     suggest --overwrite for a folder that is not a cache.
  2. --out equal to or inside --target / --data, and --target / --data inside --out: refused, untouched.
  3. A second job on a locked cache: refused naming host and pid; a lock left by a SIGKILLed holder does
     not block the next run.
  4. Settings that can never work, refused before cache.json: MASK / pad id outside the vocabulary,
     target top-k above the vocabulary, more taps than distinct layers, no supervised tokens (all-zero
     masks, 1-token samples).
  5. SIGTERM delivered in the forward of batch k (a deterministic point): the shards handed to the
     writer are complete, nothing partial remains, exit code 143, the same command completes the cache.
  6. An --out that cannot be written (under a file, in /sys, on a read-only file system; see
     tests/helpers/faults.py): refused before any work with one message naming the directory and the fix,
     nothing written anywhere.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from click.testing import CliRunner

from extract.cli import main as extract_cli
from extract.dataset.index import Sample, write_jsonl
from extract.runner import run_extract
from extract.target.model import TargetModel
from shards import ShardReader
from shards.common.lock import LOCK_FILE, DirectoryLock, DirectoryLockedError
from tests.helpers.extract import (
    REPO,
    VOCAB,
    assert_equals_reference,
    cli_args,
    copy_cache,
    extract_cfg,
    snapshot,
    temporaries,
)
from tests.helpers.faults import HOWS, expect_refusal, unwritable


def user_folder(path):
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("years of work")
    (path / "shards").mkdir()
    (path / "shards" / "figure.png").write_bytes(b"\x89PNG")
    return path


# ---- 1. --overwrite removes only a cache of ours, only our files ------------------------------------------


@pytest.mark.parametrize("flag", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_a_folder_of_user_files_is_never_deleted(target, data, tmp_path, flag):
    out = user_folder(tmp_path / "mine")
    before = snapshot(out)
    result = CliRunner().invoke(extract_cli, cli_args(target, data, out, *flag))
    assert result.exit_code == 1, result.output
    assert "not a dflash-extract cache" in result.output and "thesis.tex" in result.output, result.output
    assert "--overwrite" not in result.output.replace("--out", ""), "never suggest deleting a user's folder"
    assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == ["shards", "thesis.tex"]


def test_overwrite_refuses_a_cache_holding_a_user_file(target, data, reference, tmp_path):
    cache = copy_cache(reference, tmp_path)
    (cache / "shards" / "notes.txt").write_text("mine")
    before = snapshot(cache)
    result = CliRunner().invoke(extract_cli, cli_args(target, data, cache, "--overwrite"))
    assert result.exit_code == 1, result.output
    assert "notes.txt" in result.output and "nothing was deleted" in result.output, result.output
    assert snapshot(cache) == before


def test_overwrite_replaces_a_cache_of_ours(target, data, reference, tmp_path):
    cache = copy_cache(reference, tmp_path)
    (cache / "quarantine").mkdir()
    os.replace(cache / "shards" / "b00000001.safetensors", cache / "quarantine" / "b00000001.safetensors")
    result = CliRunner().invoke(extract_cli, cli_args(target, data, cache, "--overwrite"))
    assert result.exit_code == 0, result.output
    assert f"{reference['num_batches']} shards written" in result.output and "kept" not in result.output, result.output
    assert not (cache / "quarantine").exists(), "quarantined shards of ours go with the cache"
    assert_equals_reference(cache, reference)


def _tmp_folder(cache):
    (cache / ".tmp-bak" / "sub").mkdir(parents=True)
    (cache / ".tmp-bak" / "important.txt").write_text("precious")


# Files of the user's that carry one of our names: a name is not proof that dflash-extract wrote it.
LOOKALIKES = {
    "a .tmp- folder": _tmp_folder,
    "a .tmp- file of another shape": lambda c: (c / "shards" / ".tmp-notes.txt").write_text("mine"),
    "a log of another name": lambda c: (c / "logs" / "extract-notes.txt").write_text("mine"),
    "junk under a shard name": lambda c: (c / "shards" / "b00000009.safetensors").write_bytes(b"abc"),
    "a container of a shard name for another batch": lambda c: shutil.copy(
        c / "shards" / "b00000000.safetensors", c / "quarantine" / "b00000005.safetensors"
    ),
}


@pytest.mark.parametrize("case", list(LOOKALIKES))
def test_overwrite_refuses_user_files_that_carry_our_names(target, data, reference, tmp_path, case):
    cache = copy_cache(reference, tmp_path)
    (cache / "logs").mkdir(exist_ok=True)
    (cache / "quarantine").mkdir(exist_ok=True)
    LOOKALIKES[case](cache)
    before = snapshot(cache)
    result = CliRunner().invoke(extract_cli, cli_args(target, data, cache, "--overwrite"))
    assert result.exit_code == 1, result.output
    assert "nothing was deleted" in result.output and "Traceback" not in result.output, result.output
    assert snapshot(cache) == before and (cache / "cache.json").exists()


def test_resume_never_replaces_a_file_it_did_not_write(target, data, reference, tmp_path):
    cache = copy_cache(reference, tmp_path)
    junk = cache / "shards" / "b00000001.safetensors"
    junk.write_bytes(b"my own bytes, not a shard")
    result = CliRunner().invoke(extract_cli, cli_args(target, data, cache))
    assert result.exit_code == 1 and "not recognisably a shard" in result.output, result.output
    assert str(junk) in result.output and junk.read_bytes() == b"my own bytes, not a shard"
    junk.write_bytes(b"")  # empty: nothing to lose, so the resume writes the batch again
    result = CliRunner().invoke(extract_cli, cli_args(target, data, cache))
    assert result.exit_code == 0, result.output
    assert_equals_reference(cache, reference)


def test_a_cache_without_cache_json_needs_overwrite(target, data, reference, tmp_path):
    cache = copy_cache(reference, tmp_path)
    (cache / "cache.json").unlink()
    before = snapshot(cache)
    result = CliRunner().invoke(extract_cli, cli_args(target, data, cache))
    assert result.exit_code == 1 and "pass --overwrite" in result.output, result.output
    assert snapshot(cache) == before


# ---- 2. --out nested with --target or --data --------------------------------------------------------------

NESTINGS = {
    "out is target": lambda t, d, tmp: (t, t, d),
    "out inside target": lambda t, d, tmp: (t / "cache", t, d),
    "target inside out": lambda t, d, tmp: (t.parent, t, d),
    "out is the data folder": lambda t, d, tmp: (d.parent, t, d.parent),
    "data file inside out": lambda t, d, tmp: (d.parent, t, d),
    "out inside the data folder": lambda t, d, tmp: (d.parent / "cache", t, d.parent),
}


@pytest.mark.parametrize("case", list(NESTINGS))
def test_out_nested_with_target_or_data_is_refused(target, data, tmp_path, case):
    out, tgt, dat = NESTINGS[case](target, data, tmp_path)
    before = {p: snapshot(p) for p in (target, data.parent)}
    result = CliRunner().invoke(extract_cli, cli_args(tgt, dat, out, "--overwrite"))
    assert result.exit_code == 1, result.output
    assert "one lies inside the other" in result.output, result.output
    assert {p: snapshot(p) for p in (target, data.parent)} == before, "the target and the dataset stay untouched"


def test_resume_keeps_user_files_of_a_temporary_like_name(target, data, reference, tmp_path):
    cache = copy_cache(reference, tmp_path)
    notes = [cache / ".tmp-notes.markdown", cache / "shards" / ".tmp-backup.20261201"]
    for p in notes:
        p.write_text("mine")
    ours = cache / "shards" / ".tmp-b00000001.safetensors.abcd1234"  # what a killed writer of ours leaves
    ours.write_bytes(b"partial")
    result = CliRunner().invoke(extract_cli, cli_args(target, data, cache))
    assert result.exit_code == 0, result.output
    assert [p.read_text() for p in notes] == ["mine", "mine"] and not ours.exists()


def test_a_probe_of_another_rank_does_not_make_out_foreign(target, data, reference, tmp_path):
    out = tmp_path / "cache"
    out.mkdir()
    (out / ".tmp-probe.abcd1234").write_bytes(b"")  # check_writable's, of a rank that is a moment ahead
    result = CliRunner().invoke(extract_cli, cli_args(target, data, out))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("damage", ["cache.json not JSON", "manifest cut", "shard header cut"])
def test_damaged_files_of_ours_stay_ours(target, data, reference, tmp_path, damage):
    cache = copy_cache(reference, tmp_path)
    if damage == "cache.json not JSON":
        (cache / "cache.json").write_text("{ not json")
        args = ("--overwrite",)  # the resume refuses it and says to pass --overwrite: which must then work
    elif damage == "manifest cut":
        (cache / "manifest.parquet").write_bytes((cache / "manifest.parquet").read_bytes()[:20])
        args = ("--overwrite",)
    else:
        shard = cache / "shards" / "b00000001.safetensors"
        shard.write_bytes(shard.read_bytes()[:100])  # inside the header: only our header's start is left
        args = ()  # a resume redoes it
    result = CliRunner().invoke(extract_cli, cli_args(target, data, cache, *args))
    assert result.exit_code == 0, result.output
    assert_equals_reference(cache, reference)


def test_overwrite_counts_the_old_cache_as_free_space(target, data, reference, tmp_path, monkeypatch):
    import shutil as real

    cache = copy_cache(reference, tmp_path)
    shards = sum(p.stat().st_size for p in (cache / "shards").iterdir())
    free = real.disk_usage(tmp_path)._replace(free=shards // 2)
    monkeypatch.setattr("extract.refusals.shutil.disk_usage", lambda path: free)
    result = CliRunner().invoke(extract_cli, cli_args(target, data, cache, "--overwrite"))
    assert result.exit_code == 0, result.output


def test_a_glob_beside_out_is_no_nesting_but_one_that_would_read_the_cache_is(target, data, reference, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(data, work / f"part-0{data.suffix}")
    cwd = os.getcwd()
    os.chdir(work)
    try:  # a glob in the current directory, --out beside the data: the cache's files never match it
        result = CliRunner().invoke(extract_cli, cli_args(target, f"part-*{data.suffix}", "cache"))
        assert result.exit_code == 0, result.output
        result = CliRunner().invoke(extract_cli, cli_args(target, "**/*", "cache2"))
        assert result.exit_code == 1 and "would match the files --out" in result.output, result.output
        assert not (work / "cache2").exists()
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("damage", ["missing", "flipped"])
def test_resume_writes_a_missing_or_damaged_target_head_again(target, data, reference, tmp_path, damage):
    cache = copy_cache(reference, tmp_path)
    head = cache / "target_head.safetensors"
    good = head.read_bytes()
    if damage == "missing":
        head.unlink()
    else:
        raw = bytearray(good)
        raw[-3] ^= 0xFF
        head.write_bytes(bytes(raw))
    result = CliRunner().invoke(extract_cli, cli_args(target, data, cache))
    assert result.exit_code == 0, result.output
    assert head.read_bytes() == good
    assert_equals_reference(cache, reference)


# ---- 3. one job at a time ---------------------------------------------------------------------------------


def test_a_second_job_on_a_locked_cache_is_refused_naming_the_holder(target, data, reference, tmp_path):
    cache = copy_cache(reference, tmp_path)
    before = snapshot(cache)
    with DirectoryLock(cache, "dflash-extract"):  # another open file description: flock conflicts
        with pytest.raises(DirectoryLockedError) as e:
            run_extract(extract_cfg(target, data, cache))
    msg = str(e.value)
    assert f"pid {os.getpid()}" in msg and "host " in msg and str(cache) in msg, msg
    assert snapshot(cache) == before
    summary = run_extract(extract_cfg(target, data, cache))  # released: the next run proceeds
    assert summary.resumed == reference["num_batches"]


def test_a_lock_left_by_a_killed_holder_does_not_block(target, data, reference, tmp_path):
    cache = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import os, signal
        from shards.common.lock import DirectoryLock
        DirectoryLock({str(cache)!r}, "dflash-extract").acquire()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    cache.mkdir()
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == -signal.SIGKILL and '"pid"' in (cache / LOCK_FILE).read_text()
    run_extract(extract_cfg(target, data, cache))
    assert_equals_reference(cache, reference)


# ---- 4. refuse what can never work ------------------------------------------------------------------------


def _write(tmp_path, samples):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, samples)
    return path


def _samples(n, length, mask_value):
    rng = np.random.default_rng(0)
    return [Sample(f"s{i}", rng.integers(0, VOCAB, size=length), np.full(length, mask_value)) for i in range(n)]


IMPOSSIBLE = [
    ("mask id outside vocab", None, ["--mask-token-id", str(VOCAB)], f"--mask-token-id {VOCAB} is outside"),
    ("pad id outside vocab", None, ["--pad-token-id", "-1"], "--pad-token-id -1 is outside"),
    ("top-k above vocab", None, ["--target-topk", str(VOCAB + 1)], f"--target-topk {VOCAB + 1} is more than"),
    ("more taps than layers", None, ["--num-taps", "20"], "--num-taps 20 asks for more taps than the target's 8"),
    (
        "a tap on the last layer",  # no engine can capture it: vLLM and SGLang would fail only at serving time
        None,
        ["--taps", "1,4,7"],
        "--taps 1,4,7: layer 7 is the target's last layer, which vLLM and SGLang cannot tap",
    ),
    ("all-zero masks", lambda t: _write(t, _samples(6, 20, 0)), [], "no supervised tokens in 6 samples"),
    ("1-token samples", lambda t: _write(t, _samples(5, 1, 1)), [], "no supervised tokens in 5 samples"),
    (
        "every sample skipped",
        lambda t: _write(t, _samples(6, 40, 1)),
        ["--token-budget", "16", "--long-seqs", "skip"],
        "no sample fits a 16-token batch",
    ),
    (
        "truncation keeps no reply",
        lambda t: _write(
            t, [Sample(f"s{i}", np.arange(40) % VOCAB, np.r_[np.zeros(20), np.ones(20)]) for i in range(4)]
        ),
        ["--token-budget", "16", "--long-seqs", "truncate"],
        "at --token-budget 16 packing keeps no supervised tokens a drafter can learn from (all 76 anchor positions",
    ),
    ("shard above host memory", None, ["--token-budget", str(10**11)], "more than this machine's"),
]


@pytest.mark.parametrize("name,make_data,extra,message", IMPOSSIBLE, ids=[c[0] for c in IMPOSSIBLE])
def test_settings_that_can_never_work_are_refused_before_any_work(
    target, data, tmp_path, name, make_data, extra, message
):
    path = make_data(tmp_path) if make_data else data
    out = tmp_path / "cache"
    args = cli_args(target, path, out)
    if "--mask-token-id" in extra:  # replace the default MASK id of cli_args
        i = args.index("--mask-token-id")
        del args[i : i + 2]
    result = CliRunner().invoke(extract_cli, [*args, *extra])
    assert result.exit_code == 1, result.output
    assert message in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), "no raw traceback"
    assert not (out / "cache.json").exists(), "refused before cache.json is written"


def test_a_cache_too_large_for_the_free_space_is_refused_before_any_work(target, data, tmp_path, monkeypatch):
    import shutil as real

    free = real.disk_usage(tmp_path)._replace(free=1000)
    monkeypatch.setattr("extract.refusals.shutil.disk_usage", lambda path: free)
    out = tmp_path / "cache"
    result = CliRunner().invoke(extract_cli, cli_args(target, data, out))
    assert result.exit_code == 1 and "still to write" in result.output and "1.00 KB free" in result.output, (
        result.output
    )
    assert not out.exists()


def test_a_failure_before_the_first_shard_takes_the_new_cache_away(target, data, reference, tmp_path, monkeypatch):
    def damaged(*args, **kwargs):
        raise ValueError("model-00001.safetensors: w holds NaN e4m3 codes: the checkpoint is damaged")

    monkeypatch.setattr(TargetModel, "from_pretrained", damaged)
    out = tmp_path / "cache"
    result = CliRunner().invoke(extract_cli, cli_args(target, data, out))
    assert result.exit_code == 1 and "NaN e4m3 codes" in result.output, result.output
    assert not out.exists(), "the empty cache it created went again, lock and directory included"
    existing = tmp_path / "made-by-the-user"
    existing.mkdir()
    result = CliRunner().invoke(extract_cli, cli_args(target, data, existing))
    assert result.exit_code == 1 and existing.is_dir() and not (existing / "cache.json").exists(), result.output
    monkeypatch.undo()
    result = CliRunner().invoke(extract_cli, cli_args(target, data, out))  # the corrected command starts afresh
    assert result.exit_code == 0, result.output
    assert_equals_reference(out, reference)


# ---- 5. SIGTERM --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3])
def test_sigterm_finishes_the_shards_in_flight_and_resumes(target, data, reference, tmp_path, monkeypatch, k):
    real = TargetModel.forward_packed
    calls = [0]

    def terminated(self, *a, **kw):
        calls[0] += 1
        if calls[0] == k:  # the signal arrives while batch k-1 is in the forward
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *a, **kw)

    monkeypatch.setattr(TargetModel, "forward_packed", terminated)
    out = tmp_path / "cache"
    result = CliRunner().invoke(extract_cli, cli_args(target, data, out))
    assert result.exit_code == 143, result.output
    assert "SIGTERM" in result.output and "run the same command again" in result.output, result.output
    present = ShardReader(out).batch_ids()
    assert present == list(range(k)), f"batches 0..{k - 1} were in flight and must be complete, found {present}"
    for b in present:
        ShardReader(out).verify(b)
    assert temporaries(out) == [] and not (out / "manifest.parquet").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the handler is removed after the run"

    monkeypatch.undo()
    summary = run_extract(extract_cfg(target, data, out))
    assert summary.resumed == k
    assert_equals_reference(out, reference)


# ---- 6. an --out that cannot be written -------------------------------------------------------------------


@pytest.mark.parametrize("how", HOWS)
def test_extract_out_that_cannot_be_written_is_refused_before_any_work(
    target, data, tmp_path, monkeypatch, no_work, how
):
    out, where = unwritable(how, tmp_path, monkeypatch)
    before = snapshot(tmp_path)
    result = CliRunner().invoke(extract_cli, cli_args(target, data, out))
    expect_refusal(result, "--out", out, where, how)
    assert snapshot(tmp_path) == before, "nothing is written anywhere"
