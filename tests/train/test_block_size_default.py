"""--block-size unset: the drafter kind's published block (DFlash 2: 8, DFlash 1: 16) or the --init-from
drafter's, resolved with the drafter's shape (train/resolve.py); runs that gave 16 resume unchanged."""

from __future__ import annotations

from click.testing import CliRunner

from tests.helpers.train import tiny_cache, tiny_cli_args, tiny_config
from train.checkpoint.store import resolve_checkpoint
from train.checkpoint.train_state import train_state
from train.cli import main as train_cli
from train.resolve import resolve_run, resolved_identity


def test_unset_block_size_is_the_published_block_of_the_drafter_kind(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    dflash = resolve_run(tiny_config(cache, tmp_path / "a", block_size=None))
    dflash2 = resolve_run(tiny_config(cache, tmp_path / "b", block_size=None, arch="dflash2"))
    assert (dflash.drafter.block_size, dflash2.drafter.block_size) == (16, 8)
    given = resolve_run(tiny_config(cache, tmp_path / "c", block_size=4, arch="dflash2"))
    assert given.drafter.block_size == 4


def test_a_dflash_run_that_gave_block_size_16_resumes_with_it_unset(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=4)
    explicit = tiny_config(cache, tmp_path / "run", block_size=16)
    unset = tiny_config(cache, tmp_path / "run", block_size=None)
    assert resolved_identity(unset, resolve_run(unset)) == resolved_identity(explicit, resolve_run(explicit))

    def train(*extra):
        args = tiny_cli_args(cache, tmp_path / "run", "--checkpoint-every", "1", *extra)
        at = args.index("--block-size")
        return CliRunner().invoke(train_cli, args[:at] + args[at + 2 :])

    first = train("--block-size", "16", "--max-steps", "2")
    assert first.exit_code == 0, first.output
    (tmp_path / "run" / "step-00000002").rename(tmp_path / "step-2")  # as if stopped after step 1
    resumed = train("--max-steps", "2", "--resume")
    assert resumed.exit_code == 0, resumed.output
    state = train_state(resolve_checkpoint(tmp_path / "run"))
    assert state.step == 2 and state.drafter.block_size == 16
    refused = train("--max-steps", "2", "--resume", "--arch", "dflash2")  # its default (8) is another run
    assert refused.exit_code != 0 and "--block-size: checkpoint 16, now 8" in refused.output, refused.output


def test_init_from_takes_the_drafter_block_size(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    args = tiny_cli_args(cache, tmp_path / "run", "--max-steps", "1", "--checkpoint-every", "0")
    at = args.index("--block-size")
    args[at + 1] = "8"
    assert CliRunner().invoke(train_cli, args).exit_code == 0
    assert CliRunner().invoke(train_cli, ["export", str(tmp_path / "run"), str(tmp_path / "d")]).exit_code == 0
    run = resolve_run(tiny_config(cache, tmp_path / "x", block_size=None, init_from=str(tmp_path / "d")))
    assert run.drafter.block_size == 8


def test_help_says_the_default():
    result = CliRunner().invoke(train_cli, ["train", "--help"], terminal_width=400)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "8 for --arch dflash2" in text and "16 for dflash" in text
