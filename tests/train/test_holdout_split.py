"""The held-out split on a pieced cache falls on a sample boundary: training's --eval-shards and
`dflash-train eval`'s --eval-shards / --holdout-frac never put pieces of one long sample on both sides,
hold out the count nearest the one asked, refuse a cache that is one long sample, and leave an unpieced
cache's split as it was (the last N shards)."""

import logging
import shutil

import pytest
from click.testing import CliRunner

from shards import ShardReader, read_manifest, shard_path
from tests.helpers.extract import PIECE_CONTEXT, extract_pieced_cache
from tests.helpers.train import tiny_cache, tiny_cli_args, tiny_config
from train.cli import main as train_cli
from train.eval.run import select_eval_shards
from train.resolve import planned_batch_ids, resolve_run

# Short samples of one shard each, then two long ones stored as pieces (the plan puts them last).
LENGTHS = {**{f"short-{i}": 100 for i in range(6)}, "long-a": 300, "long-b": 420}
# A drafter the pieces serve: sliding layers within a piece's context, blocks within its label reach.
SLIDING = dict(layer_types=["sliding"], sliding_window=PIECE_CONTEXT)


@pytest.fixture(scope="module")
def pieced(target, tmp_path_factory):
    return extract_pieced_cache(target, tmp_path_factory.mktemp("split"), LENGTHS)[0]


def _samples_of(cache, ids) -> set[str]:
    """The sample ids the shard headers list for these batch ids."""
    reader = ShardReader(cache)
    return {s.sample_id for b in ids for s in reader.info(b).samples}


def _whole_sample_boundaries(cache) -> list[int]:
    """Every held-out count whose split leaves no sample on both sides and some shards on each, by brute
    force over the shard headers."""
    ids = ShardReader(cache).batch_ids()
    return [len(ids) - k for k in range(1, len(ids)) if not _samples_of(cache, ids[:k]) & _samples_of(cache, ids[k:])]


def test_training_and_eval_hold_out_whole_samples_nearest_the_count_asked(pieced, tmp_path):
    all_ids = ShardReader(pieced).batch_ids()
    valid = _whole_sample_boundaries(pieced)
    assert 1 not in valid, "the cache must have a long sample last, cut by --eval-shards 1"
    config = ShardReader(pieced).config
    for asked in range(1, len(all_ids)):
        run = resolve_run(tiny_config(pieced, tmp_path / "run", eval_shards=asked, **SLIDING))
        assert run.train_ids + run.eval_ids == all_ids
        assert not _samples_of(pieced, run.train_ids) & _samples_of(pieced, run.eval_ids), asked
        nearest = min(valid, key=lambda n: (abs(n - asked), -n))  # a tie holds the sample out whole
        assert len(run.eval_ids) == nearest, asked
        chosen = select_eval_shards(
            planned_batch_ids(config, pieced), config, shards=None, eval_shards=asked, holdout_frac=None, cache=pieced
        )
        assert chosen == run.eval_ids, f"dflash-train eval --eval-shards {asked} must split as training does"


def test_a_moved_split_is_announced(pieced, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        run = resolve_run(tiny_config(pieced, tmp_path / "run", eval_shards=1, **SLIDING))
    assert len(run.eval_ids) > 1
    assert "--eval-shards 1 would split long sample 'long-b'" in caplog.text
    assert f"holding out {len(run.eval_ids)} shards instead of 1" in caplog.text


def test_a_piece_missing_at_the_boundary_still_keeps_its_sample_on_one_side(pieced, tmp_path):
    """Under --skip-bad-shards a missing shard names no sample: the pieces either side of it still do."""
    cache = tmp_path / "cache"
    shutil.copytree(pieced, cache)
    all_ids = ShardReader(cache).batch_ids()
    shard_path(cache, all_ids[-2]).unlink()
    sample_of = dict(zip(read_manifest(cache)["batch_id"].to_pylist(), read_manifest(cache)["sample_id"].to_pylist()))
    run = resolve_run(tiny_config(cache, tmp_path / "run", eval_shards=2, skip_bad_shards=True, **SLIDING))
    assert len(run.eval_ids) > 2
    assert not {sample_of[b] for b in run.train_ids} & {sample_of[b] for b in run.eval_ids}


def test_eval_holdout_frac_holds_out_whole_samples(pieced):
    config = ShardReader(pieced).config
    all_ids = planned_batch_ids(config, pieced)
    for frac in (0.05, 0.3, 0.5, 1.0):
        held = select_eval_shards(all_ids, config, shards=None, eval_shards=None, holdout_frac=frac, cache=pieced)
        trained = [b for b in all_ids if b not in held]
        assert held and held == all_ids[len(trained) :]
        assert not _samples_of(pieced, trained) & _samples_of(pieced, held), frac


def test_a_cache_of_one_long_sample_is_refused_for_training_and_held_out_whole_by_eval(target, tmp_path):
    cache, _ = extract_pieced_cache(target, tmp_path, {"long": 420})
    args = tiny_cli_args(cache, tmp_path / "run", "--eval-shards", "1", "--layer-types", "sliding")
    result = CliRunner().invoke(train_cli, [*args, "--sliding-window", str(PIECE_CONTEXT)])
    assert result.exit_code == 1, result.output
    assert "--eval-shards 1 would split long sample 'long'" in result.output
    assert "pass --eval-shards 0" in result.output
    config = ShardReader(cache).config
    all_ids = planned_batch_ids(config, cache)
    held = select_eval_shards(all_ids, config, shards=None, eval_shards=1, holdout_frac=None, cache=cache)
    assert held == all_ids


def test_an_unpieced_cache_holds_out_the_last_shards_as_asked(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=5)
    config = ShardReader(cache).config
    for asked in range(1, 5):
        run = resolve_run(tiny_config(cache, tmp_path / "run", eval_shards=asked))
        assert run.eval_ids == [5 - asked + i for i in range(asked)] and run.train_ids == list(range(5 - asked))
        chosen = select_eval_shards(
            list(range(5)), config, shards=None, eval_shards=asked, holdout_frac=None, cache=str(cache)
        )
        assert chosen == run.eval_ids
