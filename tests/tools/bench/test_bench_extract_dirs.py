"""tools/bench/extract.py's --cache-dir (tools/bench/scratch.py): the benchmark deletes and rewrites only a
directory it made; one of the user's, a real dflash-extract cache included, is refused before any work and
left as it was."""

import json
import os

import pytest
from click.testing import CliRunner

from tests.helpers.extract import copy_cache, snapshot
from tools.bench.extract import main
from tools.bench.scratch import MARKER

TINY = ["--tiny", "--hf-layers", "0", "--num-samples", "40", "--token-budget", "256", "--timed-batches", "1"]


def bench(tmp_path, cache_dir):
    return CliRunner().invoke(main, ["--out", str(tmp_path / "bench.json"), "--cache-dir", str(cache_dir), *TINY])


@pytest.mark.parametrize("kind", ["notes", "a dflash-extract cache"])
def test_a_directory_the_benchmark_did_not_make_is_refused_and_kept(reference, tmp_path, kind):
    if kind == "notes":
        mine = tmp_path / "mine"
        mine.mkdir()
        (mine / "notes.txt").write_text("mine")
    else:  # a cache's files are the extractor's own, but this one is the user's, not the benchmark's
        mine = copy_cache(reference, tmp_path)
    before = snapshot(mine)
    result = bench(tmp_path, mine)
    assert result.exit_code == 1, result.output
    assert f"--cache-dir {mine} holds files the benchmark did not make" in result.output
    assert snapshot(mine) == before and not (tmp_path / "bench.json").exists()


def test_a_link_at_the_cache_dir_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "link")
    result = bench(tmp_path, tmp_path / "link")
    assert result.exit_code == 1 and "a link or a file, not a directory" in result.output
    assert list(elsewhere.iterdir()) == []


@pytest.mark.slow
def test_the_benchmark_runs_again_in_the_directory_it_made(tmp_path):
    scratch = tmp_path / "scratch"
    for _ in range(2):  # the second run recognises its marker and replaces what the first wrote
        result = bench(tmp_path, scratch)
        assert result.exit_code == 0, result.output
        assert sorted(p.name for p in scratch.iterdir()) == [MARKER, "data"], "each cache is deleted after use"


@pytest.mark.slow
def test_long_samples_after_a_projected_configuration_store_the_projection(tmp_path):
    """--long-samples takes the last configuration's storage: after write_pca, its pieces go into a projected
    cache, which needs the estimated projection written beside it (the benchmark once failed there)."""
    args = ["--out", str(tmp_path / "bench.json"), "--cache-dir", str(tmp_path / "scratch"), *TINY]
    args += ["--configs", "write_pca", "--pca-rank", "32", "--pca-sample-tokens", "512", "--long-samples", "600"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    long_run = json.loads((tmp_path / "bench.json").read_text())["long_samples"]["600"]
    assert long_run["pieces"] >= 2 and long_run["sample_tokens_per_s"] > 0
