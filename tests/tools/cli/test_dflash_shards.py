"""dflash-shards as a user reads it: verify gives one remedy, info leaves quarantined files out, show
prints a whole sample and the stored target top-k, and every option's help says its default.

verify on an extracted cache (the tiny target's reference cache of tests/conftest.py) damaged in each
way: exit code 1, each problem named by file: a shard deleted after extraction (named as missing), the
manifest out of date, the manifest unreadable, cache.json of another format version, the target head
with a flipped byte, the target head deleted."""

import json
import math

import click
import pytest
from click.testing import CliRunner

from shards import ShardReader, shard_path, write_manifest
from shards.inspect import QUARANTINE_DIR, _extract_command
from tests.helpers.extract import copy_cache
from tests.helpers.faults import flip_byte
from tools.cli.dflash_shards import main as shards_cli
from tools.fixtures.synthetic_cache import write_synthetic_cache


@pytest.fixture
def cache(tmp_path):
    write_synthetic_cache(tmp_path / "cache", target_topk=4, num_batches=3, token_budget=256)
    return tmp_path / "cache"


def _invoke(*args):
    return CliRunner().invoke(shards_cli, [str(a) for a in args])


def test_verify_gives_one_remedy_before_and_after_quarantine(cache):
    flip_byte(shard_path(cache, 1))
    res = _invoke("verify", cache)
    assert res.exit_code == 1
    remedies = [line for line in res.output.splitlines() if line.startswith("to repair:")]
    assert len(remedies) == 1 and "--quarantine" in remedies[0] and "dflash-extract" in remedies[0], res.output
    assert "checked 3 shards: 1 problem\n" in res.output

    res = _invoke("verify", cache, "--quarantine")
    assert res.exit_code == 1
    remedies = [line for line in res.output.splitlines() if line.startswith("to repair:")]
    assert len(remedies) == 1 and "re-run the dflash-extract command" in remedies[0], res.output
    assert "--quarantine" not in remedies[0]
    assert f"moved to {cache / QUARANTINE_DIR / shard_path(cache, 1).name}" in res.output

    # Afterwards the shard is missing, and the manifest that still lists it is no second remedy:
    # re-running the extraction rewrites it.
    res = _invoke("verify", cache, "--json")
    report = json.loads(res.output)
    assert [(b["batch_id"], b["reason"]) for b in report["bad"]] == [(1, "missing")]
    assert "re-run the dflash-extract command" in report["remedy"] and "index" not in report["remedy"]


def test_a_stale_manifest_alone_is_repaired_by_index(cache):
    from shards import write_manifest

    reader = ShardReader(cache)
    write_manifest(cache, [reader.info(0), reader.info(1)])  # leaves batch 2 out
    report = json.loads(_invoke("verify", cache, "--json").output)
    assert [b["reason"] for b in report["bad"]] == ["out of date with the shards"]
    assert report["remedy"] == f"rebuild the manifest from the shards with `dflash-shards index {cache}`"


def test_the_recorded_extract_command_is_quoted_for_a_shell():
    argv = ["/venv/bin/dflash-extract", "--target", "t", "--out", "my cache"]
    assert _extract_command({"argv": argv}) == "dflash-extract --target t --out 'my cache'"
    assert _extract_command({"argv": ["/usr/bin/pytest", "-q"]}) is None  # not an extraction: no command
    assert _extract_command({}) is None


def test_the_repair_command_runs_from_anywhere_for_the_cache_where_it_is_now(tmp_path):
    recorded = {"argv": ["dflash-extract", "--target", "t", "--data", "/d/x.jsonl", "--out", "cache"], "cwd": "/work"}
    moved = tmp_path / "copy of cache"
    assert _extract_command(recorded, moved) == (f"dflash-extract --target /work/t --data /d/x.jsonl --out '{moved}'")


def test_an_edited_cache_json_is_named_not_the_good_shards(cache):
    path = cache / "cache.json"
    record = json.loads(path.read_text())
    record["mask_token_id"] = record["mask_token_id"] - 1  # not part of the shards' cache id: still matches
    record["target_head_checksum"] = "crc32:00000000"  # part of it: every shard now names another cache
    path.write_text(json.dumps(record))
    report = json.loads(_invoke("verify", cache, "--json").output)
    assert "cache.json was edited or replaced" in report["remedy"], report["remedy"]
    assert "quarantine" not in report["remedy"]


def test_info_does_not_count_quarantined_files(cache):
    before = json.loads(_invoke("info", cache, "--json").output)
    size = shard_path(cache, 1).stat().st_size
    flip_byte(shard_path(cache, 1))
    _invoke("verify", cache, "--quarantine")
    after = json.loads(_invoke("info", cache, "--json").output)
    assert after["num_shards"] == 2 and after["num_quarantined"] == 1 and after["bytes_quarantined"] == size
    lock = (cache / ".dflash.lock").stat().st_size  # --quarantine holds the cache's lock while it moves files
    assert after["bytes_on_disk"] == before["bytes_on_disk"] - size + lock
    text = _invoke("info", cache).output
    assert "not counting 1 quarantined file" in text


def test_show_prints_a_whole_sample_and_the_stored_top_k(cache):
    reader = ShardReader(cache)
    tensors, info = reader.read(0)
    entry = max(info.samples, key=lambda s: s.length)
    assert entry.length > 64
    ids = tensors["input_ids"][entry.offset : entry.offset + entry.length].tolist()

    short = _invoke("show", cache, entry.sample_id).output
    shown = next(line for line in short.splitlines() if line.startswith("input_ids"))
    assert shown.split()[1:65] == [str(i) for i in ids[:64]] and f"({entry.length - 64} more" in shown

    full = _invoke("show", cache, entry.sample_id, "--max-tokens", 0).output
    shown = next(line for line in full.splitlines() if line.startswith("input_ids"))
    assert shown.split()[1:] == [str(i) for i in ids]

    p = 5
    res = _invoke("show", cache, entry.sample_id, "--position", p)
    assert res.exit_code == 0, res.output
    row = entry.offset + p
    want_ids = tensors["target_topk_ids"][row].tolist()
    want_lp = tensors["target_topk_logprobs"][row].float().tolist()
    table = res.output.split("target top-4 at position 5", 1)[1].splitlines()[2:]
    assert [int(line.split()[1]) for line in table] == want_ids
    assert [float(line.split()[2]) for line in table] == pytest.approx(want_lp, abs=1e-4)
    assert [float(line.split()[3]) for line in table] == pytest.approx([math.exp(x) for x in want_lp], abs=1e-4)
    nxt = ids[p + 1]
    rank = next((r for r, i in enumerate(want_ids, start=1) if i == nxt), None)
    assert (f"rank {rank} of the top-4" if rank else "not in the top-4") in res.output

    as_json = json.loads(_invoke("show", cache, entry.sample_id, "--position", p, "--json").output)
    assert as_json["target_topk"]["ids"] == want_ids and as_json["target_topk"]["next_token_id"] == nxt

    outside = _invoke("show", cache, entry.sample_id, "--position", entry.length)
    assert outside.exit_code == 1 and f"--position {entry.length} is outside" in outside.output


def test_ls_samples_lists_every_id_show_takes_and_show_proposes_the_nearest(cache):
    reader = ShardReader(cache)
    want = [(b, s.sample_id, s.length, s.loss_tokens) for b in reader.batch_ids() for s in reader.info(b).samples]
    res = _invoke("ls", cache, "--samples")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].split() == ["batch", "tokens", "supervised", "sample", "id"]
    assert [(int(b), i, int(n), int(k)) for b, n, k, i in (line.split() for line in lines[1:])] == want
    as_json = json.loads(_invoke("ls", cache, "--samples", "--json").output)
    assert [(r["batch_id"], r["sample_id"], r["length"], r["loss_tokens"]) for r in as_json] == want
    assert _invoke("show", cache, want[-1][1]).exit_code == 0, "an id ls lists is one show takes"

    typo = want[4][1].replace("synthetic-", "synthetic_")  # as `chats:17` is to the demo's `chat-17`
    res = _invoke("show", cache, typo)
    assert res.exit_code == 1 and f"sample {typo!r} is not in {cache}; nearest ids: {want[4][1]}, " in res.output
    assert f"`dflash-shards ls {cache} --samples` lists all {len(want)})" in res.output, res.output


def test_show_position_without_stored_top_k_says_how_to_get_it(tmp_path):
    write_synthetic_cache(tmp_path / "c", target_topk=0, num_batches=1)
    sample = ShardReader(tmp_path / "c").info(0).samples[0].sample_id
    res = _invoke("show", tmp_path / "c", sample, "--position", 0)
    assert res.exit_code == 1 and "--target-topk" in res.output and "Traceback" not in res.output


def _commands():
    from extract.cli import main as extract_cli
    from train.cli import main as train_cli

    yield "dflash-extract", extract_cli
    for group_name, group in (("dflash-train", train_cli), ("dflash-shards", shards_cli)):
        for name, command in group.commands.items():
            yield f"{group_name} {name}", command


def test_every_option_says_its_default_or_the_rule_that_derives_it():
    missing = []
    for name, command in _commands():
        ctx = click.Context(command)
        for p in command.params:
            if not isinstance(p, click.Option) or p.name in ("help", "as_json") or p.required:
                continue
            default = p.get_default(ctx)
            if p.is_flag and not p.secondary_opts and not default:
                continue  # a plain on-switch: off unless given
            if p.show_default and default is not None:
                continue
            text = (p.help or "").lower()
            if "default" in text or "none = " in text:  # "None = <the rule>": what leaving it unset means
                continue
            missing.append(f"{name} {p.opts[0]}")
    assert not missing, f"options whose --help says no default: {missing}"


def test_quarantine_never_replaces_a_file_it_did_not_write(cache):
    flip_byte(shard_path(cache, 1))
    theirs = cache / QUARANTINE_DIR / shard_path(cache, 1).name
    theirs.parent.mkdir()
    theirs.write_text("my notes")
    res = _invoke("verify", cache, "--quarantine")
    assert res.exit_code == 1 and theirs.read_text() == "my notes", res.output
    assert shard_path(cache, 1).exists(), "the bad shard stays where it was"
    assert f"not quarantined: {theirs} is a file dflash-extract did not write" in res.output, res.output


def test_a_cache_a_job_is_writing_is_named_by_verify_and_not_changed_by_index(cache):
    from shards.common.lock import DirectoryLock
    from shards.format import MANIFEST_FILE

    shard_path(cache, 2).unlink()  # not written yet by the running job
    before = (cache / MANIFEST_FILE).read_bytes()
    with DirectoryLock(cache, "dflash-extract"):  # the running job
        res = _invoke("verify", cache)
        assert res.exit_code == 1 and "the cache is being written (dflash-extract, host" in res.output, res.output
        for args in (("index", cache), ("verify", cache, "--quarantine")):
            res = _invoke(*args)
            assert res.exit_code == 1 and "is in use by another dflash-extract" in res.output, res.output
        assert (cache / MANIFEST_FILE).read_bytes() == before
    res = _invoke("index", cache)  # the job ended
    assert res.exit_code == 0 and (cache / MANIFEST_FILE).read_bytes() != before, res.output


# ---- verify on a damaged extracted cache ------------------------------------------------------------------


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
    config.write_text(config.read_text().replace('"format_version": 3', '"format_version": 7'))
    result = CliRunner().invoke(shards_cli, ["verify", str(cache)])
    assert result.exit_code == 1
    assert str(config) in result.output and "format version 7" in result.output, result.output
