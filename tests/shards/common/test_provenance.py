"""Provenance names the code that ran: its commit, and whether the checkout changed it."""

import shutil
import subprocess

import pytest

from shards.common.provenance import git, git_dirty, provenance

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)  # fmt: skip


def test_a_checkout_is_dirty_only_while_a_tracked_file_differs_from_its_commit(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-qm", "one")
    sha = git(["rev-parse", "HEAD"], tmp_path)
    assert sha and len(sha) == 40
    assert git_dirty(tmp_path) is False
    (tmp_path / "untracked.txt").write_text("not code the commit names\n")
    assert git_dirty(tmp_path) is False
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_dirty(tmp_path) is True
    assert git(["rev-parse", "HEAD"], tmp_path) == sha  # HEAD alone would not tell


def test_outside_a_checkout_nothing_is_claimed(tmp_path):
    assert git(["rev-parse", "HEAD"], tmp_path) is None
    assert git_dirty(tmp_path) is None


def test_provenance_records_both():
    made = provenance()
    assert {"git_sha", "git_dirty"} <= made.keys()
