"""dflash-extract --pca-rank on the tiny target: codes against the taps' projection, P against an
independent SVD, resume, verify, the refusals, and version 2 caches still read."""

import shutil
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import extract.runner
from extract.cache_dir import CacheMismatchError
from extract.cli import main as extract_cli
from extract.dataset.packing import PackedBatch
from extract.projection import sample_batches
from extract.runner import run_extract
from extract.target.config import TargetConfig
from extract.target.model import TargetModel
from shards import (
    CacheFormatError,
    ShardReader,
    decode_context,
    read_cache_config,
    shard_path,
    write_cache_config,
    write_shard,
)
from shards.common.errors import UserError
from shards.format import PROJECTION_FILE
from shards.inspect import summarize_cache, verify_cache
from shards.projection import applied_matrix, load_projection, write_projection
from tests.helpers.extract import all_tensors, cli_args, extract_cfg, make_samples
from tools.cli.dflash_shards import main as shards_cli
from tools.fixtures.tiny_target import tiny_config_dict, write_random_checkpoint

RANK = 40  # of 5 taps x 64 = 320 dims: 1/8
ALL_TOKENS = 10**6  # a sample larger than the dataset: the estimate sees every token


def projected(target, data, out, **kw):
    return extract_cfg(target, data, out, **{"pca_rank": RANK, "pca_sample_tokens": ALL_TOKENS, **kw})


def sample_taps(target, taps):
    """Every sample's taps [n, K, H] from a direct float32 forward of that sample alone."""
    model = TargetModel.from_pretrained(target, "cpu", dtype=torch.float32)
    out = {}
    for s in make_samples():
        n = len(s)
        ids = torch.from_numpy(s.input_ids.astype(np.int64))
        out[s.sample_id] = model.forward_packed(ids, torch.arange(n), torch.tensor([0, n], dtype=torch.int32), taps)
    return out


@pytest.mark.parametrize(("storage", "normalize"), [("bf16", "none"), ("fp8", "per-tap")])
def test_codes_are_the_projection_of_each_samples_taps(target, data, tmp_path, storage, normalize):
    out = tmp_path / "cache"
    run_extract(projected(target, data, out, storage_dtype=storage, pca_normalize=normalize))
    assert verify_cache(out).ok
    cfg = read_cache_config(out)
    P, D = load_projection(out, cfg)
    torch.testing.assert_close(P @ P.T, torch.eye(RANK), atol=1e-5, rtol=0)  # orthonormal rows
    taps = sample_taps(target, cfg.tap_layer_ids)
    h_NF = torch.cat([taps[s.sample_id] for s in make_samples()]).flatten(1).double()
    # An independent estimate: the top right singular vectors of every token's scaled taps, NOT centred.
    if normalize == "per-tap":
        rms_K = h_NF.view(len(h_NF), cfg.num_taps, -1).pow(2).mean((0, 2)).sqrt()
        torch.testing.assert_close(D.double(), (1 / rms_K).repeat_interleave(64), rtol=1e-4, atol=0)
    else:
        assert torch.equal(D, torch.ones_like(D))
    _, sv, Vt = torch.linalg.svd(h_NF * D.double(), full_matrices=False)
    want_projector = Vt[:RANK].T @ Vt[:RANK]
    got_projector = P.double().T @ P.double()
    assert (got_projector - want_projector).abs().max() < 1e-3
    kept = (sv[:RANK] ** 2).sum() / (sv**2).sum()
    assert cfg.projection.variance_kept == pytest.approx(kept.item(), abs=1e-5)
    # The stored codes are A h of the direct forward's taps, up to the storage's rounding.
    A = applied_matrix(P, D).double()
    reader = ShardReader(out)
    for b in reader.batch_ids():
        tensors, info = reader.read(b)
        codes = decode_context(tensors, cfg).float()
        assert codes.shape == (cfg.token_budget, 1, RANK)
        for entry in info.samples:
            want = taps[entry.sample_id].flatten(1).double() @ A.T
            got = codes[entry.offset : entry.offset + entry.length, 0].double()
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < (0.006 if storage == "bf16" else 0.04), (entry.sample_id, rel)
        assert torch.count_nonzero(codes[info.num_tokens :]) == 0
    s = summarize_cache(out)
    assert s["projection"]["rank"] == RANK
    assert (
        s["bytes_per_token"] == (RANK * 2 if storage == "bf16" else RANK + 4) + 4 + 4 + 1 + 1 + 4 * 9 / 256
    )  # ids, positions, loss and anchor masks, cu_seqlens
    text = CliRunner().invoke(shards_cli, ["info", str(out)]).output
    assert f"pca: {RANK} of 320 dims" in text and f"{100 * kept:.2f}% of the variance kept" in text, text
    shown = CliRunner().invoke(shards_cli, ["show", str(out), "doc-3"])
    assert shown.exit_code == 0 and "\n codes " in shown.output, shown.output


def test_the_sample_is_drawn_across_the_dataset_and_seeded():
    batches = [PackedBatch(i, [i], [f"s{i}"], [100]) for i in range(1000)]
    chosen = sample_batches(batches, sample_tokens=10_000, seed=3)
    ids = [b.batch_id for b in chosen]
    assert len(ids) == 100 and ids == sorted(ids)
    assert min(ids) < 100 and max(ids) > 900, "spread over the whole plan, not its first batches"
    assert ids == [b.batch_id for b in sample_batches(batches, 10_000, seed=3)]
    assert ids != [b.batch_id for b in sample_batches(batches, 10_000, seed=4)]


def test_resume_keeps_the_projection_and_redoes_a_lost_shard(target, data, tmp_path):
    out = tmp_path / "cache"
    cfg = projected(target, data, out, storage_dtype="fp8", pca_sample_tokens=300)
    run_extract(cfg)
    before = all_tensors(out)
    projection = (out / PROJECTION_FILE).read_bytes()
    shard_path(out, 1).unlink()
    summary = run_extract(cfg)
    assert (summary.written, summary.resumed) == (1, len(before) - 1)
    assert (out / PROJECTION_FILE).read_bytes() == projection, "a resume never estimates P again"
    after = all_tensors(out)
    for b, tensors in before.items():
        for name, t in tensors.items():
            assert torch.equal(after[b][name].view(torch.uint8), t.view(torch.uint8)), (b, name)
    assert verify_cache(out).ok
    with pytest.raises(CacheMismatchError, match="projection.rank"):
        run_extract(projected(target, data, out, storage_dtype="fp8", pca_sample_tokens=300, pca_rank=RANK // 2))
    with pytest.raises(CacheMismatchError, match="projection.normalize"):
        run_extract(projected(target, data, out, storage_dtype="fp8", pca_sample_tokens=300, pca_normalize="none"))


def test_start_up_records_the_weights_then_the_projection(target, data, tmp_path, monkeypatch):
    """Rank 0 loads the target for the estimate: its record shows that load and the estimate, each slowed
    by delay_s here so that leaving either out (or merging them) cannot pass."""
    delay_s = 0.3
    load, estimate = TargetModel.from_pretrained, extract.runner.estimate_projection

    def slow(fn):
        def wrapped(*args, **kw):
            time.sleep(delay_s)
            return fn(*args, **kw)

        return wrapped

    monkeypatch.setattr(TargetModel, "from_pretrained", slow(load))
    monkeypatch.setattr(extract.runner, "estimate_projection", slow(estimate))
    began = time.monotonic()
    summary = run_extract(projected(target, data, tmp_path / "cache", pca_sample_tokens=300))
    wall_s = time.monotonic() - began
    phases = {k: v for k, v in summary.startup.items() if k.endswith("_s") and k != "since_process_start_s"}
    assert list(phases) == ["weights_s", "projection_s", "first_batch_s", "second_batch_s"]
    assert phases["weights_s"] >= delay_s and phases["projection_s"] >= delay_s, phases
    # The phases are contiguous from the target's load: together they are the run's start-up, within its wall.
    assert 2 * delay_s <= sum(phases.values()) <= wall_s, (phases, wall_s)
    assert summary.startup["since_process_start_s"] > sum(phases.values())


def test_a_replaced_projection_is_refused(target, data, tmp_path):
    out = tmp_path / "cache"
    run_extract(projected(target, data, out))
    cfg = read_cache_config(out)
    P, D = load_projection(out, cfg)
    write_projection(out, P.flip(0), D)  # consistent in itself, not the P the codes were made with
    with pytest.raises(CacheFormatError, match="holds another projection"):
        load_projection(out, cfg)
    report = verify_cache(out)
    assert [b["file"] for b in report.bad] == [str(out / PROJECTION_FILE)]
    assert "restore the original projection.safetensors" in report.remedy()
    shard_path(out, 0).unlink()
    result = CliRunner().invoke(
        extract_cli, cli_args(target, data, out, "--pca-rank", str(RANK), "--pca-sample-tokens", str(ALL_TOKENS))
    )
    assert result.exit_code == 1 and "holds another projection" in result.output, result.output


def test_a_rank_not_below_the_taps_width_is_refused(target, data, tmp_path, no_work):
    result = CliRunner().invoke(extract_cli, cli_args(target, data, tmp_path / "cache", "--pca-rank", "320"))
    assert result.exit_code == 1 and "--pca-rank 320 is not below the taps' width" in result.output, result.output


def test_a_projection_setting_without_a_projection_is_refused(target, data, tmp_path, no_work):
    result = CliRunner().invoke(extract_cli, cli_args(target, data, tmp_path / "cache", "--pca-seed", "3"))
    assert result.exit_code == 2 and "--pca-seed 3: applies to projected caches only" in result.output, result.output
    assert not (tmp_path / "cache").exists()


def test_a_version_2_cache_still_reads(reference, tmp_path):
    """Version 2 wrote the shards version 3 writes for stored taps, less anchor_mask: rewritten as version 2
    by the shard writer, the cache verifies, reads the same tensors and keeps its cache_id."""
    out = tmp_path / "v2"
    shutil.copytree(reference["dir"], out, ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copy(reference["dir"] / "target_head.safetensors", out)
    config = read_cache_config(reference["dir"])
    config.format_version = 2
    write_cache_config(out, config)
    source = ShardReader(reference["dir"])
    for b in source.batch_ids():
        tensors, info = source.read(b)
        assert "anchor_mask" in tensors
        del tensors["anchor_mask"]
        write_shard(out, config, b, tensors, info.samples)
    assert verify_cache(out).ok
    got = all_tensors(out)
    for b, tensors in reference["tensors"].items():
        assert sorted(got[b]) == ["cu_seqlens", "hidden", "input_ids", "loss_mask", "position_ids"]
        for name, t in got[b].items():
            assert torch.equal(tensors[name], t), (b, name)
    assert read_cache_config(out).cache_id() == read_cache_config(reference["dir"]).cache_id()


def test_a_held_out_cache_takes_the_training_caches_projection(target, data, tmp_path):
    train = tmp_path / "train"
    run_extract(projected(target, data, train, pca_sample_tokens=300))
    heldout = tmp_path / "heldout"
    run_extract(extract_cfg(target, data, heldout, pca_from=str(train), storage_dtype="fp8"))
    want, got = read_cache_config(train).projection, read_cache_config(heldout).projection
    assert (got.rank, got.checksum, got.variance_kept) == (want.rank, want.checksum, want.variance_kept)
    assert (heldout / PROJECTION_FILE).read_bytes() == (train / PROJECTION_FILE).read_bytes()
    assert verify_cache(heldout).ok
    with pytest.raises(UserError, match="--pca-rank 8: --pca-from .* has rank 40"):
        run_extract(extract_cfg(target, data, tmp_path / "x", pca_from=str(train), pca_rank=8))
    unprojected = tmp_path / "unprojected"
    run_extract(extract_cfg(target, data, unprojected))
    with pytest.raises(UserError, match="not a projected cache"):
        run_extract(extract_cfg(target, data, tmp_path / "y", pca_from=str(unprojected)))


def _extract_from(target, data, out, source, *extra):
    return CliRunner().invoke(extract_cli, cli_args(target, data, out, "--pca-from", str(source), *extra))


def test_pca_from_refuses_settings_given_that_differ_from_the_sources(target, data, tmp_path):
    train = tmp_path / "train"  # estimated with rank 40, per-tap, 300 sample tokens, seed 0
    run_extract(projected(target, data, train, pca_sample_tokens=300))
    for flags, value, theirs in [
        (("--pca-sample-tokens", "262144"), "262144", "sample tokens 300"),  # the estimate's default, given
        (("--pca-normalize", "none"), "none", "normalize per-tap"),
        (("--pca-seed", "5"), "5", "seed 0"),
        (("--pca-rank", "8"), "8", "rank 40"),
    ]:
        out = tmp_path / f"refused{flags[0]}"
        result = _extract_from(target, data, out, train, *flags)
        assert result.exit_code == 1, result.output
        assert f"{flags[0]} {value}: --pca-from {train} has {theirs}; drop {flags[0]}" in result.output
        assert not out.exists()
    # The same values given explicitly are the source's: the same projection, byte for byte.
    same = ("--pca-rank", "40", "--pca-normalize", "per-tap", "--pca-sample-tokens", "300", "--pca-seed", "0")
    result = _extract_from(target, data, tmp_path / "heldout", train, *same)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "heldout" / PROJECTION_FILE).read_bytes() == (train / PROJECTION_FILE).read_bytes()
    assert read_cache_config(tmp_path / "heldout").projection == read_cache_config(train).projection
    again = _extract_from(target, data, tmp_path / "heldout", train)  # a resume, the settings left to the source
    assert again.exit_code == 0 and "nothing to extract" in again.output, again.output
    # --pca-seed 0 given is a seed like any other (only --pca-rank 0 means "not given").
    seeded = tmp_path / "seeded"
    run_extract(projected(target, data, seeded, pca_sample_tokens=300, pca_seed=7))
    result = _extract_from(target, data, tmp_path / "zero", seeded, "--pca-seed", "0")
    assert result.exit_code == 1 and f"--pca-seed 0: --pca-from {seeded} has seed 7" in result.output, result.output


def test_pca_from_refuses_another_targets_projection(target, data, tmp_path):
    other = write_random_checkpoint(
        tmp_path / "other", tiny_config_dict(partial_rotary_factor=0.5), dtype=torch.float32
    )
    elsewhere = tmp_path / "elsewhere"  # same width and taps, another architecture
    run_extract(projected(target=other, data=data, out=elsewhere, pca_sample_tokens=300))
    result = _extract_from(target, data, tmp_path / "a", elsewhere)
    theirs, mine = read_cache_config(elsewhere).target.config_hash, TargetConfig.from_dir(target).fingerprint()
    assert result.exit_code == 1 and f"config_hash {theirs}, --target {target} has {mine}" in result.output
    # Same config.json, other weights: the head checksums the caches recorded tell them apart.
    twin = write_random_checkpoint(tmp_path / "twin", seed=2, dtype=torch.float32)
    (twin / "config.json").write_bytes((target / "config.json").read_bytes())
    train = tmp_path / "train"
    run_extract(projected(target, data, train, pca_sample_tokens=300))
    result = _extract_from(twin, data, tmp_path / "b", train)
    theirs = read_cache_config(train).target_head_checksum
    assert result.exit_code == 1 and f"head checksum {theirs}, --target {twin}'s is " in result.output
    assert not (tmp_path / "b").exists(), "the refused run takes its empty cache away"


@pytest.mark.parametrize("name", [PROJECTION_FILE, "cache.json"])
def test_pca_from_follows_no_link_in_the_source(target, data, tmp_path, name):
    train = tmp_path / "train"
    run_extract(projected(target, data, train, pca_sample_tokens=300))
    linked = tmp_path / "linked"
    shutil.copytree(train, linked)
    (linked / name).unlink()
    (linked / name).symlink_to(train / name)  # the very same bytes: only the link is wrong
    result = _extract_from(target, data, tmp_path / "out", linked)
    assert result.exit_code == 1 and f"{linked / name} is a symbolic link" in result.output, result.output
    assert not (tmp_path / "out").exists()
