"""tools/scripts/demo.sh, demo_dflash2.sh and fp8_acceptance.sh delete a WORK_DIR only when an earlier run of theirs made it."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers.process import REPO


@pytest.mark.parametrize(
    "script", ["tools/scripts/demo.sh", "tools/scripts/demo_dflash2.sh", "tools/scripts/fp8_acceptance.sh"]
)
def test_a_work_dir_the_script_did_not_make_is_refused_and_kept(tmp_path, script):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    proc = subprocess.run(["bash", script, str(foreign)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        f"{foreign} exists and was not made by an earlier run" in proc.stderr and "nothing was deleted" in proc.stderr
    )
    assert (foreign / "notes.txt").read_text() == "keep me" and sorted(p.name for p in foreign.iterdir()) == [
        "notes.txt"
    ]
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    proc = subprocess.run(["bash", script, str(a_file)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and a_file.read_text() == "x"


def test_an_earlier_run_is_remade_keeping_what_it_did_not_write(tmp_path):
    def bash(cmd):
        return subprocess.run(
            ["bash", "-c", f". tools/scripts/work_dir.sh && {cmd}"], cwd=REPO, capture_output=True, text=True
        )

    run = tmp_path / "run"
    assert bash(f"fresh_work_dir {run}").returncode == 0 and (run / ".dflash-work-dir").is_file()
    (run / "old-output").write_text("from the earlier run")
    (run / "old-dir").mkdir()
    assert bash(f"record_work_dir {run}").returncode == 0  # the run's EXIT trap
    (run / "notes.txt").write_text("the user's, added after the run")
    proc = bash(f"fresh_work_dir {run}")
    assert proc.returncode == 0 and "kept what the earlier run did not write" in proc.stderr, proc.stderr
    # The deletion is said on screen, naming what went (the user may have wanted it).
    assert f"deleted what the earlier run of this script wrote in {run}: old-dir old-output" in proc.stderr
    assert sorted(p.name for p in run.iterdir()) == [".dflash-work-dir", "notes.txt"]
    (run / "new-output").write_text("x")
    assert bash(f"record_work_dir {run}").returncode == 0 and bash(f"fresh_work_dir {run}").returncode == 0
    assert sorted(p.name for p in run.iterdir()) == [".dflash-work-dir", "notes.txt"], "the user's file kept again"

    killed = tmp_path / "killed"  # made, then killed before its EXIT trap recorded anything
    assert bash(f"fresh_work_dir {killed}").returncode == 0
    (killed / "partial").write_text("x")
    proc = bash(f"fresh_work_dir {killed}")
    assert proc.returncode == 1 and "killed before it recorded what it wrote" in proc.stderr, proc.stderr
    assert (killed / "partial").exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    assert bash(f"fresh_work_dir {empty}").returncode == 0 and (empty / ".dflash-work-dir").is_file()


def test_a_hand_edited_marker_never_deletes_outside_its_entries(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "keep.txt").write_text("x")
    (tmp_path / "sibling.txt").write_text("x")
    (run / ".dflash-work-dir").write_text("made\nentry \nentry ..\nentry .\nentry ../sibling.txt\nentries recorded\n")
    proc = subprocess.run(
        ["bash", "-c", f". tools/scripts/work_dir.sh && fresh_work_dir {run}"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert (run / "keep.txt").exists() and (tmp_path / "sibling.txt").exists()
