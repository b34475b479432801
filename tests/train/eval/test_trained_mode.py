"""The serving mode a drafter was trained for (its cache's chat_mode) travels in its checkpoint
(train_state.json) and export (config.json, under dflash_training); `dflash-train eval --target` with
either evaluates that mode by default and warns when --thinking / --template-kwarg say another."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from tests.helpers.train import mix_modes, tiny_cache, tiny_cli_args
from tools.cli.dflash_train import entry_point
from tools.fixtures.tiny_target import write_random_checkpoint
from train.checkpoint.store import resolve_checkpoint
from train.checkpoint.train_state import train_state
from train.cli import main as train_cli

TRAINED_MODE = {"thinking": "off", "template_kwargs": {"reasoning_effort": "high"}}
WARNING = "WARNING: evaluating in serving mode"


def test_eval_target_warns_when_the_mode_differs_from_the_training_data(tmp_path):
    target = write_random_checkpoint(tmp_path / "target", seed=0, dtype=torch.float32)
    cache = tiny_cache(tmp_path / "cache", num_batches=2, hidden_size=64, vocab_size=512, chat_mode=TRAINED_MODE)
    args = tiny_cli_args(cache, tmp_path / "run", "--max-steps", "1", "--checkpoint-every", "0")
    assert CliRunner().invoke(train_cli, args).exit_code == 0
    assert train_state(resolve_checkpoint(tmp_path / "run")).chat_mode == TRAINED_MODE
    res = CliRunner().invoke(train_cli, ["export", str(tmp_path / "run"), str(tmp_path / "export")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dflash_training"]["chat_mode"] == TRAINED_MODE

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[5, 6, 7]\n")
    for drafter, source in ((tmp_path / "run", "checkpoint"), (tmp_path / "export", "export")):
        base = ["eval", "--drafter", str(drafter), "--target", str(target), "--prompts", str(prompts)]
        base += ["--max-new-tokens", "4", "--dtype", "float32"]
        other = CliRunner().invoke(
            train_cli, [*base, "--thinking", "on", "--out", str(tmp_path / "e.json")], obj=entry_point()
        )
        assert other.exit_code == 0, other.output
        assert other.output.startswith(WARNING), other.output
        assert f"but the training data of {source}" in other.output
        assert "thinking on" in other.output and 'thinking off, reasoning_effort="high"' in other.output
        assert WARNING in json.loads((tmp_path / "e.json").read_text())["chat_mode_warning"]
        same = [*base, "--thinking", "off", "--template-kwarg", "reasoning_effort=high"]
        res = CliRunner().invoke(train_cli, same, obj=entry_point())
        assert res.exit_code == 0 and WARNING not in res.output, res.output
        # No mode given: the drafter's own is evaluated, without a warning.
        res = CliRunner().invoke(train_cli, [*base, "--out", str(tmp_path / "d.json")], obj=entry_point())
        assert res.exit_code == 0 and WARNING not in res.output, res.output
        assert json.loads((tmp_path / "d.json").read_text())["chat_mode"] == TRAINED_MODE


def test_a_drafter_trained_on_several_modes_warns_only_outside_them(tmp_path):
    target = write_random_checkpoint(tmp_path / "target", seed=0, dtype=torch.float32)
    modes = [{"thinking": "on", "template_kwargs": {}}, TRAINED_MODE]
    cache = mix_modes(tiny_cache(tmp_path / "cache", num_batches=2, hidden_size=64, vocab_size=512), modes)
    args = tiny_cli_args(cache, tmp_path / "run", "--max-steps", "1", "--checkpoint-every", "0")
    assert CliRunner().invoke(train_cli, args).exit_code == 0
    state = train_state(resolve_checkpoint(tmp_path / "run"))
    assert state.chat_mode is None and state.chat_modes == modes
    res = CliRunner().invoke(train_cli, ["export", str(tmp_path / "run"), str(tmp_path / "export")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dflash_training"]["chat_modes"] == modes
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[5, 6, 7]\n")
    for drafter, source in ((tmp_path / "run", "checkpoint"), (tmp_path / "export", "export")):
        base = ["eval", "--drafter", str(drafter), "--target", str(target), "--prompts", str(prompts)]
        base += ["--max-new-tokens", "4", "--dtype", "float32"]
        for flags in (["--thinking", "on"], ["--thinking", "off", "--template-kwarg", "reasoning_effort=high"]):
            res = CliRunner().invoke(train_cli, [*base, *flags], obj=entry_point())
            assert res.exit_code == 0 and WARNING not in res.output, res.output
        other = CliRunner().invoke(train_cli, [*base, "--thinking", "off"], obj=entry_point())
        assert other.exit_code == 0 and other.output.startswith(WARNING), other.output
        assert (
            f"but the training data of {source}" in other.output and "rendered in one of thinking on | " in other.output
        )
