"""The acceptance table (tools/testbed/table) end to end on the tiny target, and its refusals.

The end-to-end run is very reduced (a few prompts, tokens and steps) but real: the tiny server answers,
dflash-data prepares, dflash-extract writes bf16 and fp8 caches, dflash-train trains DFlash 1 and DFlash 2
drafters (both selector-gold choices) at the table's block size and evaluates three seeds per row, greedy
and at T > 0. Its figures are checked against what they must be (acceptance within [1, block size],
bytes per token from the shard files on disk), then the table is run again: nothing is recomputed; a
result removed is recomputed alone; a changed row definition recomputes that row and only it.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from extract.target.config import TargetConfig
from shards.common.errors import UserError
from tests.helpers.chats import chat_target
from tools.fixtures.demo_data import demo_conversations
from tools.fixtures.tiny_target import tiny_config_dict
from tools.testbed.table.cli import main as table_cli
from tools.testbed.table.config import TableConfig
from tools.testbed.table.report import build_table, compare, markdown, seeded_figures, spread_stats
from tools.testbed.table.rows import PCA_FRACTIONS, ROWS
from tools.testbed.table.run import SKIPPED_NO_CUDA, run_table
from tools.testbed.table.steps import RESULT_VERSION, Plan
from tools.testbed.table.store import WorkDir, WorkDirError
from train.loss.head_gemms import require_fp8_head

BLOCK_SIZE = 8  # the table's --block-size in these runs (not dflash-train's default 16, so that it shows)
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
        rows=["bf16-storage", "fp8-storage", "fp8-compute", "dflash2", "dflash2-swap"],
        heldout_prompts=3,
        max_tokens=10,
        token_budget=512,
        max_seqs=16,
        steps=3,
        max_new_tokens=6,
        block_size=BLOCK_SIZE,
        sliding_window=8,
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
    trained_rows = ("bf16-storage", "fp8-storage", "dflash2", "dflash2-swap")
    pairs = sorted((row, seed) for row in trained_rows for seed in (0, 1, 2))
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
        _check_figures(results)
        # Bytes per token: the cache's own figure equals the shard files' bytes, and taps x (hidden x dtype
        # bytes, + a 4-byte scale per tap in fp8) + 10 bytes of ids, positions, loss and anchor masks + cu_seqlens' share.
        cache = _cache_of(work, storage)
        bytes_per_token = entry["stats"]["bytes_per_token"]["mean"]
        assert bytes_per_token == _data_bytes_per_token(cache)
        assert bytes_per_token == NUM_TAPS * hidden_bytes + 4 + 4 + 1 + 1 + 4 * (cfg.max_seqs + 1) / cfg.token_budget
        walk = [r["figures"]["walk_acceptance"] for r in results]
        assert entry["stats"]["walk_acceptance"]["mean"] == pytest.approx(sum(walk) / 3)
        assert entry["stats"]["walk_acceptance"]["spread"] == pytest.approx(max(walk) - min(walk))
    for name, gold in (("dflash2", "drop"), ("dflash2-swap", "swap")):
        assert rows[name]["status"] == "done" and rows[name]["real_lossless"]
        _check_figures([json.loads((work / "results" / name / f"seed-{s}.json").read_text()) for s in (0, 1, 2)])
        runs = sorted(work.glob(f"runs/{name}/*/run/run.json"))  # what dflash-train recorded of each seed's drafter
        assert len(runs) == 3
        for run in runs:
            recorded = json.loads(run.read_text())
            assert (recorded["drafter"]["arch"], recorded["drafter"]["block_size"]) == ("dflash2", BLOCK_SIZE)
            assert recorded["config"]["selector_gold"] == gold and recorded["drafter"]["sliding_window"] == 8
            assert recorded["drafter"]["layer_types"] == ["sliding_attention"] * 5  # the published layout
    sampled = rows["dflash2"]["vs_baseline"]["sampled_acceptance"]
    assert sampled["within_spread"] == (abs(sampled["delta"]) <= sampled["spread"])
    assert "| real decoding acceptance (greedy) | real decoding acceptance (T=0.7) | held-out loss |" in first.markdown
    assert "real decoding also at T=0.7, its draws seeded with the drafter's training seed" in first.markdown
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
    assert sorted(rerun.reused) == [(row, s) for row in ("bf16-storage", "dflash2", "dflash2-swap") for s in (0, 1, 2)]


def _check_figures(results: list[dict]) -> None:
    """Each seed's figures are real: acceptances in [1, block size], greedy and at T > 0, a positive loss."""
    for result in results:
        figures = result["figures"]
        for key in ("walk_acceptance", "real_acceptance", "sampled_acceptance"):
            assert isinstance(figures[key], float) and 1.0 <= figures[key] <= BLOCK_SIZE, (key, figures)
        assert figures["heldout_loss"] > 0


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
        (["--eval-temperature", "-0.5"], "--eval-temperature -0.5: must be a finite temperature >= 0"),
        (["--block-size", "1"], "--block-size 1: must be an integer >= 2"),
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


def test_every_row_trains_in_bf16_but_the_fp8_training_rows(target, tmp_path):
    """dflash-train's default --fp8 auto trains FP8 on an FP8 GPU: the table pins bf16, so each row is judged
    against the same bf16 baseline on any GPU, and the FP8 rows say so themselves."""
    plan = Plan(_config(target, tmp_path), dataset=None, device_type="cpu")
    modes = {row.name: plan.train_options(row, 0)["--fp8"] for row in ROWS}
    assert {name for name, mode in modes.items() if mode != "off"} == {"fp8-train", "dflash2-fp8-train"}
    assert modes["fp8-train"] == modes["dflash2-fp8-train"] == "linears+head"


def test_real_decoding_spans_the_held_out_replies_unless_told_otherwise(target, tmp_path):
    """The walk reads whole held-out replies (--max-tokens); real decoding generates as many tokens by default."""
    dataset = SimpleNamespace(identity={"data": "one data set for every plan"})
    spans = []
    for given in (None, 4):
        plan = Plan(_config(target, tmp_path, max_tokens=10, max_new_tokens=given), dataset, device_type="cpu")
        spans.append((plan.eval_options()["--max-new-tokens"], plan.sampled_eval_options(0)["--max-new-tokens"]))
    assert spans == [("10", "10"), ("4", "4")]


def test_the_fingerprint_covers_the_block_size_and_the_sampled_evaluation(target, tmp_path):
    """Results made before the T > 0 column, or at another temperature, seed or block size, are never reused."""
    dataset = SimpleNamespace(identity={"data": "one data set for every plan"})  # only its identity is read

    def plan(**changes) -> Plan:
        return Plan(_config(target, tmp_path, **changes), dataset, device_type="cpu")

    row = ROWS[0]
    table = plan()
    assert table.sampled_eval_options(2) == {"--temperature": "0.7", "--seed": "2", "--max-new-tokens": "6"}
    assert table.train_options(row, 2)["--block-size"] == str(BLOCK_SIZE)
    assert plan(eval_temperature=0).sampled_eval_options(2) is None
    fingerprints = [
        table.fingerprint(row, 0),
        table.fingerprint(row, 1),
        plan(eval_temperature=0.9).fingerprint(row, 0),
        plan(eval_temperature=0).fingerprint(row, 0),
        plan(block_size=16).fingerprint(row, 0),
    ]
    assert len(set(fingerprints)) == len(fingerprints)
    assert (
        table.result_identity(row, 0)["version"] == RESULT_VERSION == 3
    )  # 1: no T > 0 figure; 2: decoded past the stop tokens


def test_the_sampled_column_is_tabulated_beside_the_greedy_one_or_left_out_at_t0():
    def record(seed: int, sampled: float | None) -> dict:
        figures = dict(walk_acceptance=2.0, real_acceptance=1.5, heldout_loss=3.0, bytes_per_token=100.0)
        return {"seed": seed, "figures": {**figures, "sampled_acceptance": sampled, "real_lossless": True}}

    def rows(sampled: dict[str, list[float | None]]) -> list[dict]:
        return [
            {"name": name, "what": name, "status": "done", "results": [record(s, v) for s, v in enumerate(values)]}
            for name, values in sampled.items()
        ]

    figures = seeded_figures(0.7)
    table = build_table(rows({"base": [1.2, 1.4, 1.3], "new": [2.0, 2.1, 2.2]}), "base", figures)
    new = table["rows"][1]
    assert new["stats"]["sampled_acceptance"]["mean"] == pytest.approx(2.1)
    assert new["vs_baseline"]["sampled_acceptance"] == pytest.approx(
        {"delta": 0.8, "spread": 0.2, "within_spread": False}
    )
    text = markdown(table, "caption", figures)
    assert "| real decoding acceptance (T=0.7) |" in text and "| new | 2.000 [2.000, 2.000] | 1.500" in text
    assert (
        "2.100 [2.000, 2.200]" in text and "real decoding acceptance (T=0.7) +0.800 (beyond the spread 0.200)" in text
    )
    greedy_only = seeded_figures(0)
    assert [f.key for f in greedy_only] == ["walk_acceptance", "real_acceptance", "heldout_loss"]
    text = markdown(build_table(rows({"base": [None] * 3}), "base", greedy_only), "caption", greedy_only)
    assert "T=" not in text and "| base (baseline) | 2.000 [2.000, 2.000] | 1.500 [1.500, 1.500] | 3.0000" in text


def test_the_fp8_train_row_runs_the_heads_gemms_in_fp8_on_the_proxy_target():
    """--fp8 linears+head, CUDA only; the proxy target's head fits FP8 GEMMs (dflash-train would refuse otherwise)."""
    row = next(row for row in ROWS if row.name == "fp8-train")
    assert row.needs_cuda and row.train_options == {"--fp8": "linears+head"} and not row.extract_options
    proxy = TargetConfig.from_dir(Path(__file__).parents[2] / "tools" / "testbed" / "proxy_target")
    require_fp8_head(proxy.vocab_size, proxy.hidden_size)  # raises for a head that is not a multiple of 16
    with pytest.raises(UserError, match="use --fp8 linears"):
        require_fp8_head(proxy.vocab_size, proxy.hidden_size + 8)


def test_the_long_context_row_pieces_its_training_cache_and_shares_the_held_out_samples(target, tmp_path):
    """Only the training cache keeps long samples whole (pieces); the held-out cache is sliding-all's, whole
    in batches of --heldout-token-budget; the drafter is sliding-all's; the buckets reach dflash-train eval."""
    dataset = SimpleNamespace(identity={"data": "one data set for every plan"})
    cfg = _config(target, tmp_path, heldout_token_budget=4096, max_seq_len=2048, context_buckets=[0, 256, 1024])
    plan = Plan(cfg, dataset, device_type="cpu")
    long, short = (next(row for row in ROWS if row.name == name) for name in ("long-context", "sliding-all"))
    assert long.versus == "sliding-all"
    train = plan.extract_options(long)
    assert (train["--max-seq-len"], train["--piece-context"], train["--token-budget"]) == ("2048", "8", "512")
    assert plan.extract_options(short)["--token-budget"] == "512" and "--max-seq-len" not in plan.extract_options(short)
    assert plan.heldout_extract_options(long) == plan.heldout_extract_options(short)
    assert plan.heldout_extract_options(short)["--token-budget"] == "4096"
    assert plan.train_options(long, 0) == plan.train_options(short, 0)
    assert plan.eval_options()["--context-buckets"] == "0,256,1024"
    assert plan.sampled_eval_options(0)["--context-buckets"] == "0,256,1024"
    assert plan.cache_identity(long) != plan.cache_identity(short)
    plain = Plan(_config(target, tmp_path), dataset, device_type="cpu")
    assert "heldout_extract" not in plain.cache_identity(short) and "--context-buckets" not in plain.eval_options()
    with pytest.raises(ValueError, match="--context-buckets"):
        _config(target, tmp_path, context_buckets=[256, 1024])
    with pytest.raises(ValueError, match="--max-seq-len"):
        _config(target, tmp_path, max_seq_len=100)


def test_bucket_columns_and_a_rows_own_reference_are_tabulated():
    """Per-bucket figures get a table of their own (a bucket some seed never reached: "-"); a row with
    `versus` is compared with that row, the others with the baseline."""

    def record(seed: int, walk: float, buckets: tuple[float, float]) -> dict:
        figures = dict(walk_acceptance=walk, real_acceptance=1.5, heldout_loss=3.0, bytes_per_token=100.0)
        for key in ("walk_acceptance", "real_acceptance"):
            figures |= {f"{key}@0-256": buckets[0], f"{key}@256+": buckets[1]}
        return {"seed": seed, "figures": {**figures, "real_lossless": True}}

    def row(name: str, walks: list[float], far: list[float], versus: str | None = None) -> dict:
        results = [record(s, w, (1.0 + s, f)) for s, (w, f) in enumerate(zip(walks, far, strict=True))]
        return {"name": name, "what": name, "status": "done", "results": results, "versus": versus}

    figures = seeded_figures(0, ["0-256", "256+"])
    assert [f.key for f in figures][3:] == [
        "walk_acceptance@0-256",
        "real_acceptance@0-256",
        "walk_acceptance@256+",
        "real_acceptance@256+",
    ]
    rows = [
        row("base", [1.0, 1.0, 1.0], [2.0, 2.0, 2.0]),
        row("long", [3.0, 3.1, 3.2], [4.0, 4.2, float("nan")], versus="short"),
        row("short", [2.0, 2.0, 2.0], [2.5, 2.5, 2.5]),
    ]
    table = build_table(rows, "base", figures)
    long = table["rows"][1]
    assert long["versus"] == "short" and table["rows"][2]["versus"] == "base"
    assert long["vs_baseline"]["walk_acceptance"] == pytest.approx(
        {"delta": 1.1, "spread": 0.2, "within_spread": False}
    )
    assert long["stats"]["walk_acceptance@256+"] is None and "walk_acceptance@256+" not in long["vs_baseline"]
    assert long["vs_baseline"]["walk_acceptance@0-256"] == pytest.approx(
        {"delta": 0.0, "spread": 2.0, "within_spread": True}
    )
    text = markdown(table, "caption", figures)
    assert "| row | walk 0-256 | greedy 0-256 | walk 256+ | greedy 256+ | seeds |" in text
    assert "| long | 2.000 [1.000, 3.000] | 2.000 [1.000, 3.000] | - | - | 0,1,2 |" in text
    assert "- long (against short): decoding-walk acceptance +1.100 (beyond the spread 0.200)" in text
    assert "- short: decoding-walk acceptance +1.000" in text
