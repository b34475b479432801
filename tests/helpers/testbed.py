"""Helpers shared by the proxy target's tests (no tests here): its training script's --smoke run."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from tools.testbed.train_target import main as train_target_cli


def proxy_smoke_dir(tmp_path_factory) -> Path:
    """Run `python -m tools.testbed.train_target --smoke` (a few CPU steps on a few chats); its output directory."""
    out = tmp_path_factory.mktemp("proxy") / "smoke"
    result = CliRunner().invoke(train_target_cli, ["--out", str(out), "--smoke"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out
