"""shards/common/owned: descriptor-relative, no-follow access to the program's directories, and the one
judgement of which entries are its own.

Every case plants what a hostile or careless user could (a link to a file outside, a dangling link, a
FIFO, a folder swapped for a link) and checks the outside file's bytes, that nothing was created where a
link points, that no call blocks, and that the refusal is OwnershipError naming the planted path.
"""

from __future__ import annotations

import os
import re
import stat
import threading

import pytest

from shards.common.owned import (
    LOCK_FILE,
    Dir,
    Layout,
    OwnershipError,
    check_output_file,
    judge,
    remove_empty_folders,
    remove_entries,
    survey,
)


@pytest.fixture
def outside(tmp_path):
    """A file of the user's outside the owned directory, and its bytes."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    return victim


@pytest.fixture
def owned(tmp_path):
    d = tmp_path / "owned"
    d.mkdir()
    return d


def finishes(call, *args, timeout_s=10.0):
    """call(*args)'s result or exception, asserting it returns within timeout_s (a FIFO's open would block)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call(*args)
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{call.__name__} blocked (a FIFO was opened)"
    return outcome


# ---- opening directories ---------------------------------------------------------------------------------


def test_open_creates_the_directory_and_refuses_a_dangling_link(tmp_path):
    with Dir.open(tmp_path / "a" / "b", create=True) as d:
        assert os.path.samestat(os.fstat(d.fd), os.stat(tmp_path / "a" / "b"))
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(OwnershipError, match=re.escape(f"{tmp_path / 'dangling'} is a symbolic link")):
        Dir.open(tmp_path / "dangling", create=True)
    assert not (tmp_path / "nowhere").exists(), "nothing is made where the link points"


def test_open_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OwnershipError, match="is a file, not a directory"):
        Dir.open(tmp_path / "f")


def test_a_folder_inside_is_never_reached_through_a_link(owned, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (owned / "shards").symlink_to(elsewhere)
    with pytest.raises(OwnershipError, match=re.escape(f"{owned / 'shards'} is a symbolic link (to {elsewhere})")):
        with Dir.opened(owned, "shards", create=True) as d:
            d.write_atomic("b.safetensors", lambda f: f.write(b"x"))
    assert list(elsewhere.iterdir()) == []


# ---- files of our own -------------------------------------------------------------------------------------


def test_write_atomic_replaces_our_file_and_refuses_a_link(owned, outside):
    with Dir.open(owned) as d:
        d.write_atomic("cache.json", lambda f: f.write(b"one"))
        d.write_atomic("cache.json", lambda f: f.write(b"two"))
        assert (owned / "cache.json").read_bytes() == b"two"
        assert stat.S_IMODE((owned / "cache.json").stat().st_mode) == 0o644
        (owned / "manifest.parquet").symlink_to(outside)
        with pytest.raises(OwnershipError, match=re.escape(f"{owned / 'manifest.parquet'} is a symbolic link")):
            d.write_atomic("manifest.parquet", lambda f: f.write(b"junk"))
    assert outside.read_text() == "precious\n" and (owned / "manifest.parquet").is_symlink(), "link and target kept"
    assert sorted(p.name for p in owned.iterdir()) == ["cache.json", "manifest.parquet"], "no temporary left"


def test_write_atomic_leaves_no_partial_file_on_failure(owned):
    def half(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with Dir.open(owned) as d, pytest.raises(OSError, match="No space"):
        d.write_atomic("run.json", half)
    assert list(owned.iterdir()) == []


@pytest.mark.parametrize("planted", ["link", "dangling link"])
def test_append_and_create_never_follow_a_link(owned, outside, tmp_path, planted):
    target = outside if planted == "link" else tmp_path / "made-through-link"
    (owned / "metrics.jsonl").symlink_to(target)
    with Dir.open(owned) as d:
        with pytest.raises(OwnershipError, match=re.escape(f"{owned / 'metrics.jsonl'} is a symbolic link")):
            d.open_append("metrics.jsonl")
        with pytest.raises(OwnershipError, match="is a symbolic link"):
            d.create("metrics.jsonl")
    if planted == "link":
        assert outside.read_text() == "precious\n"
    else:
        assert not target.exists(), "a dangling link must not create a file where it points"


def test_a_fifo_is_refused_without_blocking(owned):
    os.mkfifo(owned / "run.json")
    with Dir.open(owned) as d:
        for call in (d.read_bytes, d.open_append, lambda n: d.open_own(n, os.O_RDWR | os.O_CREAT)):
            outcome = finishes(call, "run.json")
            assert isinstance(outcome.get("error"), OwnershipError), outcome
            assert f"{owned / 'run.json'} is a FIFO" in str(outcome["error"])


def test_a_device_is_refused_and_never_opened(owned):
    try:
        os.mknod(owned / ".dflash.lock", stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    with Dir.open(owned) as d, pytest.raises(OwnershipError, match="is a device"):
        d.open_own(LOCK_FILE, os.O_RDWR | os.O_CREAT)


def test_append_creates_and_appends_a_regular_file(owned):
    with Dir.open(owned) as d:
        for line in ("a", "b"):
            with d.open_append("log.jsonl") as f:
                f.write(line + "\n")
        assert d.read_text("log.jsonl") == "a\nb\n"


def test_rmtree_refuses_a_link_and_removes_a_folder(owned, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    (owned / "step-00000001").symlink_to(elsewhere)
    (owned / "step-00000002").mkdir()
    (owned / "step-00000002" / "inner-link").symlink_to(elsewhere / "keep.txt")
    with Dir.open(owned) as d:
        with pytest.raises(OwnershipError, match="is a symbolic link"):
            d.rmtree("step-00000001")
        d.rmtree("step-00000002")
    assert (elsewhere / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in owned.iterdir()) == ["step-00000001"]


def test_make_temp_dir_is_fresh_and_private(owned):
    with Dir.open(owned) as d:
        name, tmp = d.make_temp_dir(".tmp-step-00000001-")
        with tmp:
            assert re.fullmatch(r"\.tmp-step-00000001-[a-z0-9_]{8}", name)
            assert stat.S_IMODE(os.fstat(tmp.fd).st_mode) == 0o700 and tmp.names() == []
            with open(tmp.pinned_path("model.safetensors"), "wb") as f:  # what a path-taking library does
                f.write(b"weights")
    assert (owned / name / "model.safetensors").read_bytes() == b"weights"


def test_temporaries_of_ours_are_removed_and_look_alikes_kept(owned):
    (owned / ".tmp-run.json.abcd1234").write_text("half")
    (owned / ".tmp-notes.txt").write_text("the user's")
    (owned / ".tmp-eval.json.abcd1234").mkdir()  # a folder of that shape is not our temporary
    with Dir.open(owned) as d:
        assert d.remove_temporaries(lambda final: final == "run.json") == [".tmp-run.json.abcd1234"]
    assert sorted(p.name for p in owned.iterdir()) == [".tmp-eval.json.abcd1234", ".tmp-notes.txt"]


# ---- the judgement ----------------------------------------------------------------------------------------

LAYOUT = Layout(
    claim=lambda d, e, marked: marked and e.name in ("run.json", "tb"),
    temporaries=lambda final: final == "run.json",
    folders={"logs": Layout(claim=lambda d, e, marked: e.is_file and e.name.endswith(".jsonl"))},
    marked=lambda d: d.is_file("run.json"),
)


def test_survey_sorts_ours_scaffolding_and_foreign(owned, outside):
    (owned / "run.json").write_text("{}")
    (owned / "tb").mkdir()
    (owned / LOCK_FILE).write_text("")
    (owned / ".tmp-run.json.abcd1234").write_text("")
    (owned / ".tmp-probe.abcd1234").write_text("")
    (owned / "notes.txt").write_text("mine")
    (owned / "logs").mkdir()
    (owned / "logs" / "a.jsonl").write_text("")
    (owned / "logs" / "b.jsonl").symlink_to(outside)
    with Dir.open(owned) as d:
        found = survey(d, LAYOUT)
    assert found.marked
    assert sorted(str(e.path.relative_to(owned)) for e in found.ours) == ["logs/a.jsonl", "run.json", "tb"]
    assert sorted(e.name for e in found.scaffolding) == [
        ".dflash.lock",
        ".tmp-probe.abcd1234",
        ".tmp-run.json.abcd1234",
    ]
    assert sorted(str(e.path.relative_to(owned)) for e in found.foreign) == ["logs/b.jsonl", "notes.txt"]


@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_a_lock_or_file_of_our_name_that_is_no_regular_file_is_foreign(owned, outside, planted):
    for name in (LOCK_FILE, "run.json"):
        if planted == "link":
            (owned / name).symlink_to(outside)
        else:
            os.mkfifo(owned / name)
    with Dir.open(owned) as d:
        found = finishes(survey, d, LAYOUT)["value"]
        assert not found.marked and found.scaffolding == [] and found.ours == []
        assert sorted(e.name for e in found.foreign) == [LOCK_FILE, "run.json"]
        assert not judge(d, "run.json", LAYOUT)


def test_remove_entries_removes_only_what_was_listed(owned, outside):
    (owned / "run.json").write_text("{}")
    (owned / "logs").mkdir()
    (owned / "logs" / "a.jsonl").write_text("")
    (owned / "keep.txt").write_text("mine")
    with Dir.open(owned) as d:
        found = survey(d, LAYOUT)
        remove_entries(d, [e for e in found.ours if e.is_file])
        remove_empty_folders(d, ["logs"])
    assert sorted(p.name for p in owned.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("planted", ["link", "fifo", "folder", "foreign file"])
def test_check_output_file_refuses_what_is_not_ours(tmp_path, outside, planted):
    out = tmp_path / "eval.json"
    if planted == "link":
        out.symlink_to(outside)
    elif planted == "fifo":
        os.mkfifo(out)
    elif planted == "folder":
        out.mkdir()
    else:
        out.write_text("{}")
    outcome = finishes(check_output_file, out, "--out", lambda d, n: d.read_bytes(n) == b"ours", "this test")
    assert isinstance(outcome.get("error"), OwnershipError), outcome
    assert str(out) in str(outcome["error"]) and "--out" in str(outcome["error"])
    assert outside.read_text() == "precious\n"


def test_an_in_place_write_refuses_a_file_whose_bytes_another_name_shares(owned, outside):
    os.link(outside, owned / "metrics.jsonl")  # a `cp -al` copy of a run shares its files' bytes
    with Dir.open(owned) as d:
        with pytest.raises(OwnershipError, match=re.escape(f"{owned / 'metrics.jsonl'} has 2 hard links")):
            d.open_append("metrics.jsonl")
        assert d.read_bytes("metrics.jsonl") == outside.read_bytes(), "reading it is fine"
        d.write_atomic("metrics.jsonl", lambda f: f.write(b"new\n"))  # a rename gives the name bytes of its own
    assert outside.read_text() == "precious\n" and (owned / "metrics.jsonl").read_text() == "new\n"
