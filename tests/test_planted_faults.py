"""Fault injection, planted files: no command that writes follows a link, opens a FIFO or device, or takes a
pre-created link for a file of its own (shards/common/owned decides for all of them).

Every case plants, where a command keeps its own file or folder, what a hostile or careless user could: a
link to a file outside (the "victim"), a link to nothing, a link to a folder outside, a FIFO. Each command
then refuses with one line naming the planted path (exit 1, no traceback), and the outside folder is
byte for byte as it was, with nothing created where a dangling link points. A FIFO case runs the command in
a child process with a time limit: a command that opens the FIFO blocks forever, which fails the test
instead of hanging the suite.

  dflash-extract       resume with .dflash.lock, logs/extract-rank0.jsonl, manifest.parquet or shards/ a link; cache.json a
                       FIFO; a new --out holding only a lock link or a dangling one
  dflash-train train   a new --out holding only a lock link or a dangling one; --resume with metrics.jsonl
                       or tb/ a link, run.json or a checkpoint's train_state.json a FIFO; --resume of a
                       hard-linked copy (`cp -al`), whose lock shares the original's bytes
  dflash-train export  --overwrite of an export whose config.json is a link
  dflash-train eval    --out a FIFO; --out a link to an eval.json of ours
  dflash-train plot    --out a link to a PNG of ours
  dflash-shards        index and verify --quarantine with the lock a link; quarantine/ a link
  dflash-data          prepare with a link at the temporary name older versions used (the pid's), --out a
                       link; regenerate --out a link
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from extract.chats.cli import main as data_cli
from extract.cli import main as extract_cli
from shards import shard_path
from tests.helpers.chats import chat_target, prepare, write_conversations
from tests.helpers.extract import cli_args, copy_cache, corrupt_shard, snapshot
from tests.helpers.process import REPO, child_env
from tests.helpers.train import tiny_cache, tiny_cli_args
from tools.cli.dflash_shards import main as shards_cli
from train.checkpoint.store import checkpoint_folders
from train.cli import main as train_cli

LOCK = ".dflash.lock"


@pytest.fixture
def outside(tmp_path):
    """A folder of the user's outside every directory a command writes in, holding victim.txt."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "victim.txt").write_text("precious: any file the user can write\n")
    return folder


def plant_link(at: Path, to: Path) -> Path:
    if at.is_dir() and not at.is_symlink():
        shutil.rmtree(at)
    else:
        at.unlink(missing_ok=True)
    at.symlink_to(to)
    return at


def plant_fifo(at: Path) -> Path:
    at.unlink(missing_ok=True)
    os.mkfifo(at)
    return at


def state(folder: Path) -> tuple[dict, list[str]]:
    """Every file's bytes and every name (folders and links included) under folder."""
    return snapshot(folder), sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def assert_refused(exit_code: int, output: str, planted: Path, outside: Path, before: tuple) -> None:
    assert exit_code == 1, output
    assert str(planted) in output, f"the refusal must name {planted}:\n{output}"
    assert "Traceback" not in output, output
    assert state(outside) == before, "something outside was written or created through the planted link"


def invoke(cli, args) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, result.output


def child(module: str, *args, timeout_s: float = 180.0) -> tuple[int, str]:
    """`python -m module args` in a child process; a child still running after timeout_s is blocked
    (on a FIFO it opened): killed, and the test fails."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", module, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=child_env(),
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{module} {' '.join(map(str, args))} hung: it opened a FIFO where it expected its own file")
    return proc.returncode, proc.stdout + proc.stderr


# ---- dflash-extract ---------------------------------------------------------------------------------------


def resumable_cache(reference, tmp_path) -> Path:
    """A copy of the reference cache without its last shard: a resume has a batch to extract."""
    cache = copy_cache(reference, tmp_path)
    shard_path(cache, reference["num_batches"] - 1).unlink()
    return cache


EXTRACT_RESUME_PLANTS = {
    "lock link": lambda cache, outside: plant_link(cache / LOCK, outside / "victim.txt"),
    "progress log link": lambda cache, outside: plant_link(
        cache / "logs" / "extract-rank0.jsonl", outside / "victim.txt"
    ),
    "manifest link": lambda cache, outside: plant_link(cache / "manifest.parquet", outside / "victim.txt"),
    "shards folder link": lambda cache, outside: plant_link(
        cache / "shards", shutil.copytree(cache / "shards", outside / "shards")
    ),
}


@pytest.mark.parametrize("case", list(EXTRACT_RESUME_PLANTS))
def test_extract_resume_never_writes_through_a_planted_link(target, data, reference, tmp_path, outside, case):
    cache = resumable_cache(reference, tmp_path)
    (cache / "logs").mkdir(exist_ok=True)
    planted = EXTRACT_RESUME_PLANTS[case](cache, outside)
    before = state(outside)
    code, output = invoke(extract_cli, cli_args(target, data, cache))
    assert "is a symbolic link" in output, output
    assert_refused(code, output, planted, outside, before)


@pytest.mark.parametrize("dangling", [False, True], ids=["lock link", "dangling lock link"])
def test_extract_refuses_a_new_out_holding_only_a_lock_link(target, data, tmp_path, outside, dangling):
    out = tmp_path / "new"
    out.mkdir()
    planted = plant_link(out / LOCK, outside / ("made-by-link" if dangling else "victim.txt"))
    before = state(outside)
    code, output = invoke(extract_cli, cli_args(target, data, out))
    assert "not a dflash-extract cache and is not empty" in output, output
    assert_refused(code, output, planted, outside, before)


def test_extract_resume_refuses_a_fifo_cache_json_naming_it(target, data, reference, tmp_path, outside):
    cache = resumable_cache(reference, tmp_path)
    planted = plant_fifo(cache / "cache.json")
    before = state(outside)
    code, output = child("extract.cli", *cli_args(target, data, cache))
    assert "not a dflash-extract cache and is not empty" in output, output
    assert_refused(code, output, planted, outside, before)


# ---- dflash-train -----------------------------------------------------------------------------------------


def run_args(cache: Path, run: Path, *extra) -> list[str]:
    """One run's settings, the same for the run and its resumes (TensorBoard on: tb/ is written)."""
    return tiny_cli_args(cache, run, "--epochs", "1", "--checkpoint-every", "2", "--tensorboard", *extra)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished CLI run with checkpoints, metrics.jsonl and tb/."""
    root = tmp_path_factory.mktemp("planted-train")
    cache = tiny_cache(root / "cache", num_batches=4)
    run = root / "run"
    code, output = invoke(train_cli, run_args(cache, run))
    assert code == 0 and len(checkpoint_folders(run)) >= 2 and (run / "tb").is_dir(), output
    return cache, run


def resumable_run(trained, tmp_path) -> Path:
    """A copy of the trained run without its newest checkpoint: --resume trains the last steps again."""
    run = tmp_path / "run"
    shutil.copytree(trained[1], run, symlinks=True)
    shutil.rmtree(checkpoint_folders(run)[-1])
    return run


@pytest.mark.parametrize("dangling", [False, True], ids=["lock link", "dangling lock link"])
def test_train_refuses_a_new_out_holding_only_a_lock_link(trained, tmp_path, outside, dangling):
    out = tmp_path / "new"
    out.mkdir()
    planted = plant_link(out / LOCK, outside / ("made-by-link" if dangling else "victim.txt"))
    before = state(outside)
    code, output = invoke(train_cli, run_args(trained[0], out))
    assert "holds files dflash-train did not write" in output, output
    assert_refused(code, output, planted, outside, before)


TRAIN_RESUME_PLANTS = {
    "metrics.jsonl link": lambda run, outside: plant_link(run / "metrics.jsonl", outside / "victim.txt"),
    "tb folder link": lambda run, outside: plant_link(run / "tb", shutil.copytree(run / "tb", outside / "tb")),
}


@pytest.mark.parametrize("case", list(TRAIN_RESUME_PLANTS))
def test_train_resume_never_writes_through_a_planted_link(trained, tmp_path, outside, case):
    run = resumable_run(trained, tmp_path)
    planted = TRAIN_RESUME_PLANTS[case](run, outside)
    before = state(outside)
    code, output = invoke(train_cli, run_args(trained[0], run, "--resume"))
    assert "holds files dflash-train did not write" in output, output
    assert_refused(code, output, planted, outside, before)


def test_train_resume_does_not_hang_on_a_fifo_run_json(trained, tmp_path, outside):
    run = resumable_run(trained, tmp_path)
    planted = plant_fifo(run / "run.json")
    before = state(outside)
    code, output = child("train.cli", *run_args(trained[0], run, "--resume"))
    assert "holds files dflash-train did not write" in output, output
    assert_refused(code, output, planted, outside, before)


def test_train_resume_does_not_hang_on_a_fifo_train_state(trained, tmp_path, outside):
    run = resumable_run(trained, tmp_path)
    planted = plant_fifo(checkpoint_folders(run)[-1] / "train_state.json")
    before = state(outside)
    code, output = child("train.cli", *run_args(trained[0], run, "--resume"))
    assert f"{planted} is a FIFO" in output, "the warning names the FIFO:\n" + output
    assert_refused(code, output, planted.parent, outside, before)  # "none is valid", naming the folder


def test_train_resume_of_a_hard_linked_copy_leaves_the_original_untouched(trained, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(trained[1], copy, copy_function=os.link)  # `cp -al`: every file shares the original's bytes
    shutil.rmtree(checkpoint_folders(copy)[-1])
    before, lock_record = state(trained[1]), (trained[1] / LOCK).read_bytes()  # state() leaves the lock out
    code, output = invoke(train_cli, run_args(trained[0], copy, "--resume"))
    assert f"{copy / LOCK} has 2 hard links" in output, output
    assert_refused(code, output, copy / LOCK, trained[1], before)
    assert (trained[1] / LOCK).read_bytes() == lock_record, "the original's lock record was rewritten"


def test_export_overwrite_refuses_an_export_whose_config_is_a_link(trained, tmp_path, outside):
    drafter = tmp_path / "drafter"
    assert invoke(train_cli, ["export", trained[1], drafter])[0] == 0
    planted = plant_link(drafter / "config.json", outside / "victim.txt")
    before = state(outside)
    code, output = invoke(train_cli, ["export", trained[1], drafter, "--overwrite"])
    assert "not a drafter exported by dflash-train" in output, output
    assert_refused(code, output, planted, outside, before)
    assert planted.is_symlink(), "the user's link is left as it was"


def eval_args(trained, out: Path) -> list:
    cache, run = trained
    return ["eval", "--drafter", run, "--cache", cache, "--eval-shards", "1", "--budgets", "", "--out", out]


def test_eval_does_not_hang_on_a_fifo_out(trained, tmp_path, outside):
    planted = plant_fifo(tmp_path / "eval.json")
    before = state(outside)
    code, output = child("train.cli", *eval_args(trained, planted))
    assert f"--out {planted} is a FIFO" in output, output
    assert_refused(code, output, planted, outside, before)


def test_eval_and_plot_refuse_an_out_that_links_to_a_file_of_ours(trained, tmp_path, outside):
    ours = {"eval": outside / "eval.json", "plot": outside / "run.png"}
    assert invoke(train_cli, eval_args(trained, ours["eval"]))[0] == 0
    assert invoke(train_cli, ["plot", trained[1], "--out", ours["plot"]])[0] == 0
    before = state(outside)
    for command, args in {
        "eval": lambda out: eval_args(trained, out),
        "plot": lambda out: ["plot", trained[1], "--out", out],
    }.items():
        planted = plant_link(tmp_path / ours[command].name, ours[command])
        code, output = invoke(train_cli, args(planted))
        assert f"--out {planted} is a symbolic link" in output, output
        assert_refused(code, output, planted, outside, before)
        assert planted.is_symlink(), "the user's link is left as it was"


# ---- dflash-shards ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["index"], ["verify", "--quarantine"]])
def test_shards_commands_refuse_a_lock_link(tmp_path, outside, command):
    cache = tiny_cache(tmp_path / "cache", num_batches=3)
    planted = plant_link(cache / LOCK, outside / "victim.txt")
    before = state(outside)
    code, output = invoke(shards_cli, [command[0], cache, *command[1:]])
    assert "is a symbolic link" in output, output
    assert_refused(code, output, planted, outside, before)


def test_quarantine_never_moves_a_shard_through_a_linked_folder(tmp_path, outside):
    cache = tiny_cache(tmp_path / "cache", num_batches=3)
    corrupt_shard(shard_path(cache, 1), "flip")
    (outside / "quarantine").mkdir()
    planted = plant_link(cache / "quarantine", outside / "quarantine")
    before = state(outside)
    code, output = invoke(shards_cli, ["verify", cache, "--quarantine"])
    assert_refused(code, output, planted, outside, before)
    assert shard_path(cache, 1).is_file() and list((outside / "quarantine").iterdir()) == []


# ---- dflash-data ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_target_dir(tmp_path_factory):
    return chat_target(tmp_path_factory)


def test_prepare_never_writes_through_a_link_at_a_temporary_name(chat_target_dir, tmp_path, outside):
    data = write_conversations(tmp_path / "chats.jsonl", 4)
    out = tmp_path / "data.parquet"
    planted = plant_link(tmp_path / f".{out.name}.tmp-{os.getpid()}", outside / "victim.txt")  # the old name
    before = state(outside)
    args = ["--target", str(chat_target_dir), "--data", str(data), "--out", str(out), "--skip-bad-rows"]
    result = prepare(args)  # --skip-bad-rows: the even chats have no assistant turn
    assert result.exit_code == 0, result.output
    assert state(outside) == before and planted.is_symlink(), "the planted link is neither followed nor taken"
    assert out.is_file() and not out.is_symlink()


def test_prepare_and_regenerate_refuse_an_out_that_is_a_link(chat_target_dir, tmp_path, outside):
    data = write_conversations(tmp_path / "chats.jsonl", 2)
    before = state(outside)
    planted = plant_link(tmp_path / "data.parquet", outside / "victim.txt")
    code, output = invoke(
        data_cli, ["prepare", "--target", chat_target_dir, "--data", data, "--out", planted, "--overwrite"]
    )
    assert f"{planted} is a symbolic link" in output, output
    assert_refused(code, output, planted, outside, before)

    planted = plant_link(tmp_path / "regenerated.jsonl", outside / "victim.txt")
    meta = {"model": "tiny"}  # whatever its record says: the link is refused before it is read
    (tmp_path / "regenerated.jsonl.regenerate.json").write_text(json.dumps(meta))
    code, output = invoke(
        data_cli,
        ["regenerate", "--server", "http://127.0.0.1:9/v1", "--model", "tiny", "--data", data, "--out", planted],
    )
    assert f"{planted} is a symbolic link" in output, output
    assert_refused(code, output, planted, outside, before)
