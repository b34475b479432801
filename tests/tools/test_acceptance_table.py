"""The acceptance table (tools/testbed/table) end to end on the tiny target, and its refusals.

The end-to-end run is very reduced (a few prompts, tokens and steps) but real: the tiny server answers,
dflash-data prepares, dflash-extract writes bf16 and fp8 caches, dflash-train trains and evaluates three
seeds per row. Its figures are checked against what they must be (acceptance within [1, block size],
bytes per token from the shard files on disk), then the table is run again: nothing is recomputed; a
result removed is recomputed alone; a changed row definition recomputes that row and only it.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from extract.target.config import TargetConfig
from tests.helpers.chats import chat_target
from tools.fixtures.demo_data import demo_conversations
from tools.fixtures.tiny_target import tiny_config_dict
from tools.testbed.table.cli import main as table_cli
from tools.testbed.table.config import TableConfig
from tools.testbed.table.report import compare, spread_stats
from tools.testbed.table.rows import PCA_FRACTIONS, ROWS
from tools.testbed.table.run import SKIPPED_NO_CUDA, run_table
from tools.testbed.table.steps import Plan
from tools.testbed.table.store import WorkDir, WorkDirError

BLOCK_SIZE = 16  # dflash-train's default block size: acceptance counts at most this many tokens per step
NUM_TAPS = 5  # dflash-extract's default number of taps


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return chat_target(tmp_path_factory, mixer_scale=0.1)


def _prompts(path: Path, n: int) -> Path:
    """Chats and plain prompts mixed: the two forms --prompts takes."""
    rows = demo_conversations(n, seed=1)
    lines = [row if i % 2 else {"prompt": row["messages"][-1]["content"]} for i, row in enumerate(rows)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _config(target: Path, tmp_path: Path, **changes) -> TableConfig:
    settings = dict(
        target=str(target),
        prompts=str(_prompts(tmp_path / "prompts.jsonl", 20)),
        work=str(tmp_path / "work"),
        rows=["bf16-storage", "fp8-storage", "fp8-compute"],
        heldout_prompts=3,
        max_tokens=10,
        token_budget=512,
        max_seqs=16,
        steps=3,
        max_new_tokens=6,
        concurrency=16,
        device="cpu",
    )
    return TableConfig(**{**settings, **changes})


def _data_bytes_per_token(cache: Path) -> float:
    """A shard's tensor bytes per token slot, read off the file: its size less the safetensors header."""
    shard = sorted((cache / "shards").glob("b*.safetensors"))[0]
    with open(shard, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    budget = json.loads((cache / "cache.json").read_text())["token_budget"]
    return (shard.stat().st_size - 8 - header_len) / budget


def _cache_of(work: Path, storage: str) -> Path:
    found = [
        p.parent
        for p in work.glob("caches/*/train/cache.json")
        if json.loads(p.read_text())["storage_dtype"] == storage
    ]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow
def test_reduced_table_end_to_end_then_resumed(target, tmp_path):
    cfg = _config(target, tmp_path)
    work = Path(cfg.work)
    prepared = run_table(dataclasses.replace(cfg, data_only=True))  # the data alone, as for another machine
    assert prepared.computed == [] and not (work / "caches").exists() and len(list(work.glob("data/*/data.json"))) == 1
    data_logs = sorted((work / "logs").glob("data-*.log"))
    logged = [p.read_text() for p in data_logs]
    first = run_table(cfg)
    assert [p.read_text() for p in data_logs] == logged, "the data made by --data-only are reused"
    pairs = [(row, seed) for row in ("bf16-storage", "fp8-storage") for seed in (0, 1, 2)]
    assert sorted(first.computed) == pairs and first.reused == []

    rows = {entry["name"]: entry for entry in first.table["rows"]}
    if not torch.cuda.is_available():
        assert rows["fp8-compute"]["status"] == SKIPPED_NO_CUDA and "stats" not in rows["fp8-compute"]
        assert f"| fp8-compute | {SKIPPED_NO_CUDA} |" in first.markdown
    hidden = tiny_config_dict(vocab_size=512)["hidden_size"]
    for name, storage, hidden_bytes in (("bf16-storage", "bf16", 2 * hidden), ("fp8-storage", "fp8", hidden + 4)):
        entry = rows[name]
        assert entry["status"] == "done" and entry["seeds"] == [0, 1, 2] and entry["real_lossless"]
        results = [json.loads((work / "results" / name / f"seed-{s}.json").read_text()) for s in (0, 1, 2)]
        for result in results:
            figures = result["figures"]
            assert 1.0 <= figures["walk_acceptance"] <= BLOCK_SIZE and 1.0 <= figures["real_acceptance"] <= BLOCK_SIZE
            assert figures["heldout_loss"] > 0
        # Bytes per token: the cache's own figure equals the shard files' bytes, and taps x (hidden x dtype
        # bytes, + a 4-byte scale per tap in fp8) + 10 bytes of ids, positions, loss and anchor masks + cu_seqlens' share.
        cache = _cache_of(work, storage)
        bytes_per_token = entry["stats"]["bytes_per_token"]["mean"]
        assert bytes_per_token == _data_bytes_per_token(cache)
        assert bytes_per_token == NUM_TAPS * hidden_bytes + 4 + 4 + 1 + 1 + 4 * (cfg.max_seqs + 1) / cfg.token_budget
        walk = [r["figures"]["walk_acceptance"] for r in results]
        assert entry["stats"]["walk_acceptance"]["mean"] == pytest.approx(sum(walk) / 3)
        assert entry["stats"]["walk_acceptance"]["spread"] == pytest.approx(max(walk) - min(walk))
    versus = rows["fp8-storage"]["vs_baseline"]["walk_acceptance"]
    assert versus["within_spread"] == (abs(versus["delta"]) <= versus["spread"])
    assert ("within the spread" if versus["within_spread"] else "beyond the spread") in first.markdown
    assert json.loads((work / "table.json").read_text()) == json.loads(json.dumps(first.table))
    assert (work / "table.md").read_text() == first.markdown

    # The same command again: nothing recomputed, not even the data.
    again = run_table(cfg)
    assert again.computed == [] and sorted(again.reused) == pairs
    assert [p.read_text() for p in data_logs] == logged
    assert again.table["rows"] == first.table["rows"]

    # A run cut after its training: the missing result alone is computed (its training resumes complete).
    (work / "results" / "fp8-storage" / "seed-1.json").unlink()
    cut = run_table(cfg)
    assert cut.computed == [("fp8-storage", 1)]
    assert "already complete" in (work / "logs" / "fp8-storage-seed1-train.log").read_text()

    # A changed row definition: that row's seeds are recomputed, the other row's results kept.
    fp8 = next(row for row in ROWS if row.name == "fp8-storage")
    changed = [
        *(row for row in ROWS if row.name != "fp8-storage"),
        dataclasses.replace(fp8, train_options={"--warmup-ratio": "0.5"}),
    ]
    rerun = run_table(cfg, rows=changed)
    assert sorted(rerun.computed) == [("fp8-storage", s) for s in (0, 1, 2)]
    assert sorted(rerun.reused) == [("bf16-storage", s) for s in (0, 1, 2)]


def test_spread_and_comparison_against_hand_computed_figures():
    stats = spread_stats([2.0, 2.5, 4.0])
    assert stats["mean"] == pytest.approx(8.5 / 3)
    deviations = [(v - 8.5 / 3) ** 2 for v in (2.0, 2.5, 4.0)]
    assert stats["std"] == pytest.approx((sum(deviations) / 2) ** 0.5)
    assert (stats["min"], stats["max"], stats["spread"]) == (2.0, 4.0, 2.0)
    base = spread_stats([3.0, 3.2, 3.1])
    assert compare(stats, base) == pytest.approx({"delta": 8.5 / 3 - 3.1, "spread": 2.0, "within_spread": True})
    assert compare(spread_stats([5.0, 5.1, 5.2]), base)["within_spread"] is False  # 2.0 apart, spreads 0.2


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--seeds", "0,1"], "--seeds 0,1: give at least 3 different seeds"),
        (["--rows", "bf16-storage,fp9-storage"], "--rows fp9-storage: no such row"),
        (["--train-temperatures", ""], "--train-temperatures"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(target, tmp_path, flags, said):
    prompts = _prompts(tmp_path / "prompts.jsonl", 4)
    args = ["--target", str(target), "--prompts", str(prompts), "--work", str(tmp_path / "work"), *flags]
    result = CliRunner().invoke(table_cli, args)
    assert result.exit_code in (1, 2) and said in result.output, result.output
    assert not (tmp_path / "work").exists()


def test_a_work_directory_of_other_files_is_refused_and_kept(target, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    prompts = _prompts(tmp_path / "prompts.jsonl", 4)
    result = CliRunner().invoke(table_cli, ["--target", str(target), "--prompts", str(prompts), "--work", str(work)])
    assert result.exit_code == 1 and "holds files the acceptance table did not make" in result.output, result.output
    assert [p.name for p in work.iterdir()] == ["notes.txt"]


def test_prompts_that_leave_no_training_prompt_are_refused(target, tmp_path):
    prompts = _prompts(tmp_path / "prompts.jsonl", 4)
    args = [
        "--target",
        str(target),
        "--prompts",
        str(prompts),
        "--work",
        str(tmp_path / "work"),
        "--heldout-prompts",
        "4",
    ]
    result = CliRunner().invoke(table_cli, args)
    assert result.exit_code == 1 and "--heldout-prompts 4: leaves no training prompt of the 4" in result.output


def test_links_where_the_tables_files_belong_are_refused_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    with pytest.raises(WorkDirError, match="not a directory"):
        WorkDir.open(link)
    work = WorkDir.open(tmp_path / "work")
    (work.root / "results").symlink_to(elsewhere)
    with pytest.raises(WorkDirError, match="is a link or a file"):
        work.save_result("bf16-storage", 0, {"fingerprint": "x"})
    (work.root / "logs").mkdir()
    (work.root / "logs" / "data-prepare.log").symlink_to(elsewhere / "file")
    with pytest.raises(WorkDirError, match="is a link"):
        work.log("data-prepare")
    assert list(elsewhere.iterdir()) == []


def test_a_prompt_line_of_another_shape_is_refused_naming_its_line(target, tmp_path):
    prompts = _prompts(tmp_path / "prompts.jsonl", 4)
    prompts.write_text(prompts.read_text() + '{"text": "no prompt field"}\n')
    args = [
        "--target",
        str(target),
        "--prompts",
        str(prompts),
        "--work",
        str(tmp_path / "work"),
        "--heldout-prompts",
        "1",
    ]
    result = CliRunner().invoke(table_cli, args)
    assert result.exit_code == 1 and f"--prompts {prompts} line 5: give a non-empty" in result.output, result.output


def test_the_compact_cache_rows_take_their_rank_from_the_targets_width(target, tmp_path):
    plan = Plan(_config(target, tmp_path), dataset=None, device_type="cpu")
    taps_width = 5 * TargetConfig.from_dir(target).hidden_size
    for n in PCA_FRACTIONS:
        for name, normalize in ((f"pca-{n}", "per-tap"), (f"pca-{n}-raw", "none")):
            options = plan.extract_options(next(row for row in ROWS if row.name == name))
            assert options["--pca-rank"] == str(taps_width // n) and options["--pca-normalize"] == normalize
            assert options["--storage"] == "fp8"
