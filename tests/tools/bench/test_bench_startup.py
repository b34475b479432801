"""tools/bench/startup.py on CPU: two whole processes per stage (cold, then warm on the same compile cache),
their start-up records side by side; a --work that holds anything is refused (cold needs an empty cache)."""

import json

import pytest
from click.testing import CliRunner

from tools.bench.startup import main


@pytest.mark.slow
def test_training_start_up_cold_then_warm_as_two_processes(tmp_path):
    out, work = tmp_path / "startup.json", tmp_path / "work"
    result = CliRunner().invoke(main, ["--out", str(out), "--work", str(work), "--stages", "train", "--tiny"])
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["stages"]["train"]
    assert list(runs) == ["cold", "warm"]
    for run in runs.values():  # each its own process: its age at the first step covers its model and step
        assert run["since_process_start_s"] > run["model_s"] + run["first_step_s"]
        assert run["process_wall_s"] > run["since_process_start_s"]
    assert "goal: warm since_process_start_s <= 30 s" in result.output
    assert (work / "train_cold.json").is_file() and (work / "train_warm.log").is_file()


def test_a_work_directory_holding_anything_is_refused(tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, ["--out", str(tmp_path / "o.json"), "--work", str(tmp_path / "work")])
    assert result.exit_code == 2 and "is not empty" in result.output
    assert (tmp_path / "work" / "notes.txt").read_text() == "mine"
