"""shards.common.cli_options: options generated from the config dataclasses, refusals in flag words, -h everywhere."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Literal

import click
import pytest
from click.testing import CliRunner

from extract.cli import main as extract_cli
from extract.config import ExtractConfig
from shards.common.cli_options import (
    build_config,
    cli_field,
    config_error,
    config_options,
    field_docs,
    flag_name,
    from_options,
    option_fields,
    parse_number_list,
    to_options,
)
from tests.helpers.train import tiny_cache, tiny_cli_args
from tools.cli.dflash_shards import main as shards_cli
from train.cli import main as train_cli
from train.config import TrainConfig


@dataclass(kw_only=True)
class Toy:
    where: str = cli_field(path="existing_dir")
    """Somewhere."""
    size: int = 3
    """How many (units)."""
    ratio: float | None = None
    """A ratio. Default: derived."""
    mode: Literal["a", "b"] = "a"
    """One of two."""
    on: bool = False
    """Switch on."""
    keep: bool = True
    """Keep it."""
    auto: bool | None = None
    """On, off or decided later."""
    ids: list[int] | None = cli_field(None, flag="--ids-short")
    """Some ids."""
    pair: tuple[float, float] = (0.5, 0.25)
    """Two numbers."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise config_error(self, "size", "must be >= 1; pass --size 1 or more")


@click.command()
@config_options(Toy)
def toy(**options):
    click.echo(json.dumps(dataclasses.asdict(build_config(Toy, options))))


def run_toy(*args):
    return CliRunner().invoke(toy, list(args))


def test_options_follow_the_fields(tmp_path):
    res = run_toy("--where", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == {**dataclasses.asdict(Toy(where=str(tmp_path))), "pair": [0.5, 0.25]}
    res = run_toy(
        "--where",
        str(tmp_path),
        "--size",
        "7",
        "--ratio",
        "0.5",
        "--mode",
        "b",
        "--on",
        "--no-keep",
        "--no-auto",
        "--ids-short",
        "3, 1,2",
        "--pair",
        "0.1,0.2",
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == dict(
        where=str(tmp_path),
        size=7,
        ratio=0.5,
        mode="b",
        on=True,
        keep=False,
        auto=False,
        ids=[3, 1, 2],
        pair=[0.1, 0.2],
    )


def test_help_shows_docstring_and_defaults():
    text = CliRunner().invoke(toy, ["--help"], terminal_width=200).output
    assert "--size INTEGER" in text and "How many (units).  [default: 3]" in text
    assert "--mode [a|b]" in text and "--keep / --no-keep" in text and "--auto / --no-auto" in text
    assert "--pair NUMBERS" in text and "[default: 0.5,0.25]" in text
    assert "--where DIRECTORY" in text and "[required]" in text
    assert "A ratio. Default: derived." in text and "--ratio FLOAT" in text


def test_bad_values_are_usage_errors_naming_the_flag(tmp_path):
    res = run_toy("--where", str(tmp_path), "--size", "0")
    assert res.exit_code == 2 and "--size 0: must be >= 1; pass --size 1 or more" in res.output
    res = run_toy("--where", str(tmp_path), "--ids-short", "1,x")
    assert res.exit_code == 2 and "--ids-short" in res.output and "expected comma-separated integers" in res.output
    res = run_toy("--where", str(tmp_path / "missing"))
    assert res.exit_code == 2 and "--where" in res.output
    res = run_toy("--where", str(tmp_path), "--mode", "c")
    assert res.exit_code == 2 and "--mode" in res.output


@dataclass(kw_only=True)
class Inner:
    steps: int = cli_field(2, name="inner_steps")
    """Steps of the inner part."""
    cadence: int = cli_field(5, identity=False)
    """How often (a resume may change it)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise config_error(self, "steps", "must be >= 1")


@dataclass(kw_only=True)
class Outer:
    size: int = 3
    """How many."""
    inner: Inner = dataclasses.field(default_factory=Inner)
    """The inner part."""
    last: bool = False
    """Last option."""


@click.command()
@config_options(Outer)
def outer(**options):
    cfg = build_config(Outer, options)
    click.echo(json.dumps({"nested": dataclasses.asdict(cfg), "flat": to_options(cfg)}))


def test_nested_config_fields_are_top_level_options_in_place():
    assert [p.name for p in outer.params] == ["size", "inner_steps", "cadence", "last"]
    res = CliRunner().invoke(outer, ["--inner-steps", "4", "--cadence", "1"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["nested"] == {"size": 3, "inner": {"steps": 4, "cadence": 1}, "last": False}
    assert list(out["flat"].items()) == [("size", 3), ("inner_steps", 4), ("cadence", 1), ("last", False)]
    res = CliRunner().invoke(outer, ["--inner-steps", "0"])
    assert res.exit_code == 2 and "--inner-steps 0: must be >= 1" in res.output
    assert "Steps of the inner part.  [default: 2]" in CliRunner().invoke(outer, ["--help"], terminal_width=200).output
    assert flag_name(Outer, "inner_steps") == flag_name(Inner, "steps") == "--inner-steps"


def test_flat_options_round_trip_and_identity_is_declared_on_the_field(tmp_path):
    cfg = from_options(Outer, {"size": 7, "inner_steps": 3, "last": True})
    assert cfg == Outer(size=7, inner=Inner(steps=3), last=True)
    assert from_options(Outer, to_options(cfg)) == cfg
    assert to_options(cfg, identity_only=True) == {"size": 7, "inner_steps": 3, "last": True}
    with pytest.raises(TypeError, match="no option named steps"):
        from_options(Outer, {"steps": 3})
    train = TrainConfig(cache=str(tmp_path), out_dir=str(tmp_path / "r"))
    assert from_options(TrainConfig, train.to_dict()) == train
    assert {"gamma", "loss_chunk_blocks", "lr", "eval_shards", "tap_layer_ids"} <= set(train.identity())
    assert not {"fused_loss", "eval_every", "log_every", "cache", "out_dir"} & set(train.identity())


def test_number_list_parser():
    assert parse_number_list("1,16, 31 46") == [1, 16, 31, 46]
    assert parse_number_list("0.9,0.999", float) == [0.9, 0.999]
    with pytest.raises(ValueError, match="expected comma-separated integers, got '1,a'"):
        parse_number_list("1,a")


@pytest.mark.parametrize("cls, command", [(TrainConfig, train_cli.commands["train"]), (ExtractConfig, extract_cli)])
def test_every_config_field_is_an_option_with_help(cls, command):
    params = {p.name: p for p in command.params}
    for o in option_fields(cls):  # every leaf field, nested configs' included
        assert o.name in params, f"{cls.__name__}.{o.name} has no option"
        assert flag_name(cls, o.name) in params[o.name].opts
        assert field_docs(o.owner).get(o.field.name), f"{cls.__name__}.{o.name} has no docstring (its --help)"


def test_cli_defaults_are_the_config_defaults(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    ctx = extract_cli.make_context("dflash-extract", ["--target", str(tmp_path), "--data", "d", "--out", "o"])
    params = {k: v for k, v in ctx.params.items() if k != "gpus"}
    assert build_config(ExtractConfig, params) == ExtractConfig(target=str(tmp_path), data="d", out_dir="o")
    assert ExtractConfig(target=str(tmp_path), data="d", out_dir="o").token_budget == 49152
    ctx = train_cli.commands["train"].make_context("train", ["--cache", str(tmp_path), "--out", "r"])
    params = {k: v for k, v in ctx.params.items() if k != "gpus"}
    assert build_config(TrainConfig, params) == TrainConfig(cache=str(tmp_path), out_dir="r")


def test_fast_resume_means_fast_resume(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args = ["--target", str(tmp_path), "--data", "d", "--out", "o"]
    assert extract_cli.make_context("x", [*args, "--fast-resume"]).params["fast_resume"] is True
    assert extract_cli.make_context("x", args).params["fast_resume"] is False


@pytest.mark.parametrize(
    "cli, extra, expected",
    [
        ("extract", ["--token-budget", "0"], "--token-budget 0: must be >= 1"),
        ("extract", ["--taps", "5,3"], "--taps 5,3: must be strictly increasing"),
        ("extract", ["--taps", "1,b"], "Invalid value for '--taps': expected comma-separated integers, got '1,b'"),
        ("extract", ["--target-topk", "-1"], "--target-topk -1: must be >= 0"),
        ("extract", ["--storage", "fp4"], "Invalid value for '--storage'"),
        ("train", ["--lr", "0"], "--lr 0.0: must be > 0"),
        ("train", ["--betas", "0.9,1.5"], "--betas 0.9,1.5: must be two values in [0, 1)"),
        ("train", ["--block-size", "1"], "--block-size 1: must be >= 2"),
        ("train", ["--keep-checkpoints", "0"], "--keep-checkpoints 0: must be an integer >= 1"),
        (
            "train",
            ["--num-attention-heads", "4"],
            "--num-attention-heads 4, --num-key-value-heads None, --head-dim None: give the three together",
        ),
    ],
)
def test_refusals_name_the_flag_and_value(tmp_path, cli, extra, expected):
    if cli == "extract":
        (tmp_path / "config.json").write_text("{}")
        args = ["--target", str(tmp_path), "--data", "d", "--out", str(tmp_path / "o"), *extra]
        res = CliRunner().invoke(extract_cli, args)
    else:
        cache = tmp_path / "cache"
        cache.mkdir()
        res = CliRunner().invoke(train_cli, tiny_cli_args(cache, tmp_path / "run", *extra))
    assert res.exit_code == 2, res.output
    assert expected in res.output and "Traceback" not in res.output
    assert cli == "train" or "Usage:" in res.output


def test_extract_target_without_config_json_is_named(tmp_path):
    res = CliRunner().invoke(extract_cli, ["--target", str(tmp_path), "--data", "d", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and f"--target {tmp_path}: has no config.json" in res.output


def test_kl_lambda_without_stored_topk_names_both_flags_and_the_fix(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    res = CliRunner().invoke(train_cli, tiny_cli_args(cache, tmp_path / "run", "--kl-lambda", "0.5"))
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "--kl-lambda 0.5 needs a cache with --target-topk > 0" in res.output
    assert "re-extract with --target-topk 8 or pass --kl-lambda 0" in res.output


def _commands(group: click.Group, path: list[str]):
    yield path
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, [*path, name])
        else:
            yield [*path, name]


@pytest.mark.parametrize(
    "cli, path",
    [(extract_cli, [])]
    + [(train_cli, p) for p in _commands(train_cli, [])]
    + [(shards_cli, p) for p in _commands(shards_cli, [])],
)
def test_dash_h_works_on_every_entry_point(cli, path):
    res = CliRunner().invoke(cli, [*path, "-h"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("Usage:") and "-h, --help" in res.output


def test_gpus_takes_a_count_or_all(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    res = CliRunner().invoke(train_cli, tiny_cli_args(tmp_path, tmp_path / "run", "--gpus", "two"))
    assert res.exit_code == 2 and "--gpus two: expected a number of GPUs or 'all'" in res.output


@pytest.mark.parametrize("cli", ["train", "extract"])
def test_gpus_beyond_the_machines_gpus_is_refused_unless_device_cpu_asks_for_cpu_processes(
    tmp_path, monkeypatch, caplog, cli
):
    """`--gpus 2` on a machine without a GPU never silently starts two CPU ranks: refused, naming
    --device cpu; with --device cpu the two CPU processes start, and that is said."""
    import os

    import torch

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    started = []
    monkeypatch.setattr(os, "execv", lambda exe, cmd: started.append(cmd))
    command, args = {
        "train": (train_cli, ["train", "--cache", str(tmp_path), "--out", str(tmp_path / "run")]),
        "extract": (extract_cli, ["--target", str(tmp_path), "--data", "d.jsonl", "--out", str(tmp_path / "c")]),
    }[cli]
    res = CliRunner().invoke(command, [*args, "--gpus", "2"])
    assert res.exit_code == 2 and not started, res.output
    assert "--gpus 2: this machine has 0 CUDA devices" in res.output and "--device cpu" in res.output, res.output
    caplog.set_level(logging.INFO)
    res = CliRunner().invoke(command, [*args, "--gpus", "2", "--device", "cpu"])
    assert res.exit_code == 0 and len(started) == 1, res.output
    assert "--nproc-per-node=2" in started[0] and "--gpus" not in started[0]
    assert "--gpus 2 --device cpu: starting 2 processes on the CPU (gloo)" in caplog.text


def test_bad_drafter_heads_name_the_three_flags(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    res = CliRunner().invoke(
        train_cli,
        tiny_cli_args(
            cache, tmp_path / "run", "--num-attention-heads", "3", "--num-key-value-heads", "2", "--head-dim", "8"
        ),
    )
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "--num-attention-heads 3 --num-key-value-heads 2 --head-dim 8:" in res.output


def test_either_spelling_of_bf16_is_taken_and_the_canonical_one_kept(tmp_path):
    """Storage encodings are named bf16/fp8 (cache.json), compute dtypes bfloat16/float32 (torch's names):
    each flag and config takes the other spelling of bf16 and keeps its own, so caches stay comparable."""
    from train.eval.config import EvalConfig

    (tmp_path / "config.json").write_text("{}")
    args = ["--target", str(tmp_path), "--data", "d", "--out", "o"]
    params = extract_cli.make_context("x", [*args, "--storage", "bfloat16", "--dtype", "bf16"]).params
    assert (params["storage_dtype"], params["dtype"]) == ("bf16", "bfloat16")
    given = ExtractConfig(target=str(tmp_path), data="d", out_dir="o", storage_dtype="bfloat16", dtype="bf16")
    assert given == ExtractConfig(target=str(tmp_path), data="d", out_dir="o", storage_dtype="bf16", dtype="bfloat16")
    train = train_cli.commands["train"].make_context(
        "train", ["--cache", str(tmp_path), "--out", "r", "--compute-dtype", "bf16"]
    )
    assert train.params["compute_dtype"] == "bfloat16"
    assert TrainConfig(cache=str(tmp_path), out_dir="r", compute_dtype="bf16").compute_dtype == "bfloat16"
    assert EvalConfig(drafter=str(tmp_path), cache=str(tmp_path), eval_shards=1, dtype="bf16").dtype == "bfloat16"
    res = CliRunner().invoke(extract_cli, [*args, "--storage", "float8"])
    assert res.exit_code == 2 and "Invalid value for '--storage'" in res.output and "float8" in res.output
    with pytest.raises(ValueError, match="compute_dtype|--compute-dtype"):
        TrainConfig(cache=str(tmp_path), out_dir="r", compute_dtype="fp8")
