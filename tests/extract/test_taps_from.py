"""`dflash-extract --taps-from DRAFTER`: the cache holds the taps the drafter's config.json names (ours,
or a published layout's dflash_config.target_layer_ids), with --taps refused beside it and a config that
does not name usable taps refused naming the file and the field."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from extract.cli import main as extract_cli
from extract.dataset.index import write_parquet
from shards import ShardReader
from tests.helpers.extract import cli_args, extract_cfg, make_samples


def drafter_dir(tmp_path, config: dict):
    path = tmp_path / "drafter"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_cache_holds_the_drafters_taps(target, tmp_path):
    data = tmp_path / "data.parquet"
    write_parquet(data, make_samples(n=4))
    published = {"architectures": ["DFlashDraftModel"], "dflash_config": {"target_layer_ids": [0, 2]}}
    args = cli_args(target, data, tmp_path / "cache", "--taps-from", str(drafter_dir(tmp_path, published)))
    result = CliRunner().invoke(extract_cli, args)
    assert result.exit_code == 0, result.output
    assert ShardReader(tmp_path / "cache").config.tap_layer_ids == [0, 2]


def test_top_level_target_layer_ids_are_read_too(target, tmp_path):
    cfg = extract_cfg(
        target, "d.parquet", tmp_path / "c", taps_from=str(drafter_dir(tmp_path, {"target_layer_ids": [1, 3]}))
    )
    assert cfg.tap_layer_ids == [1, 3]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"dflash_config": {"target_layer_ids": "1,3"}}, "dflash_config.target_layer_ids must be an array"),
        ({"dflash_config": {"target_layer_ids": [3, 1]}}, r"target_layer_ids \[3, 1\] must be strictly increasing"),
        ({"dflash_config": {"mask_token_id": 5}}, "neither dflash_config.target_layer_ids nor target_layer_ids"),
        ({"dflash_config": []}, "dflash_config must be"),
    ],
)
def test_a_config_without_usable_taps_is_refused_naming_the_field(target, tmp_path, config, message):
    with pytest.raises(ValueError, match=message) as refusal:
        extract_cfg(target, "d.parquet", tmp_path / "c", taps_from=str(drafter_dir(tmp_path, config)))
    assert "config.json" in str(refusal.value)


def test_taps_and_taps_from_together_are_refused(target, tmp_path):
    drafter = drafter_dir(tmp_path, {"dflash_config": {"target_layer_ids": [0, 2]}})
    args = cli_args(target, tmp_path / "d.parquet", tmp_path / "c", "--taps", "1,3", "--taps-from", str(drafter))
    result = CliRunner().invoke(extract_cli, args)
    assert result.exit_code == 2 and "--taps 1,3 and --taps-from" in result.output, result.output
    result = CliRunner().invoke(
        extract_cli, cli_args(target, tmp_path / "d.parquet", tmp_path / "c", "--taps-from", str(tmp_path))
    )
    assert result.exit_code == 2 and "no config.json" in result.output, result.output
