"""dflash-data prepare through its CLI: input formats and globs, output that dflash-extract reads, never
replacing its input or a file it did not write, each bad row named by file, row and reason, targets without
a tokenizer or template, the tiny tokenizer itself, and flags that can never work.
Rendering and masks against independent references: test_template.py; hostile inputs: test_prepare_edges.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from extract.chats.cli import main as data_cli
from extract.chats.conversations import conversation_from_row
from extract.chats.template import ChatRenderer
from extract.dataset.index import scan_dataset
from tests.helpers.chats import (
    CHAIN,
    CONVERSATIONS,
    SHAREGPT,
    SHAREGPT_AS_OPENAI,
    VOCAB,
    chat_target,
    prepare,
    write_rows,
)
from tools.fixtures.tiny_target import tiny_config_dict, write_random_checkpoint
from tools.fixtures.tiny_tokenizer import unemittable_ids


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return chat_target(tmp_path_factory)


def test_prepare_formats_and_output_reads_in_extract(target, tmp_path):
    rows = [{"id": f"c{i}", "messages": conv} for i, conv in enumerate(CONVERSATIONS.values())]
    share = [{"id": "s0", **SHAREGPT}]
    jsonl = write_rows(tmp_path / "in" / "a.jsonl", rows[:2])
    write_rows(tmp_path / "in" / "b.json", rows[2:] + share)
    out = tmp_path / "data.parquet"
    result = prepare(["--target", str(target), "--data", str(tmp_path / "in"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    table = pq.read_table(out).to_pylist()
    assert [r["id"] for r in table] == ["c0", "c1", "c2", "s0"]
    renderer = ChatRenderer(target, thinking=True)
    for r, messages in zip(table, [*CONVERSATIONS.values(), SHAREGPT_AS_OPENAI]):
        ids, mask, _ = renderer.encode(conversation_from_row({"messages": messages}, "x.jsonl", 0))
        assert r["input_ids"] == ids.tolist() and r["loss_mask"] == mask.tolist()
    summary = json.loads(Path(f"{out}.summary.json").read_text())
    total = sum(len(r["input_ids"]) for r in table)
    assert summary["num_samples"] == 4 and summary["num_tokens"] == total
    assert summary["supervised_fraction"] == pytest.approx(sum(sum(r["loss_mask"]) for r in table) / total)
    index = scan_dataset(out, vocab_size=VOCAB)  # what dflash-extract reads
    assert index.sample_ids == ["c0", "c1", "c2", "s0"] and int(index.lengths.sum()) == total
    # The same conversations as one glob of a .jsonl file give the same rows.
    out2 = tmp_path / "glob.parquet"
    assert (
        prepare(["--target", str(target), "--data", str(tmp_path / "in" / "a.*l"), "--out", str(out2)]).exit_code == 0
    )
    assert pq.read_table(out2).to_pylist() == table[:2]
    assert jsonl.exists()
    # A rerun refuses to overwrite; --max-length cuts and counts.
    again = prepare(["--target", str(target), "--data", str(jsonl), "--out", str(out2)])
    assert again.exit_code == 1 and "exists" in again.output and "--overwrite" in again.output
    cut = prepare(
        ["--target", str(target), "--data", str(jsonl), "--out", str(out2), "--overwrite", "--max-length", "20"]
    )
    assert cut.exit_code == 0 and "2 truncated" in cut.output
    assert all(len(r["input_ids"]) == 20 for r in pq.read_table(out2).to_pylist())


def test_prepare_never_replaces_its_input_or_a_file_it_did_not_write(target, tmp_path):
    path = tmp_path / "convs.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "p0", "messages": CHAIN}]), path)
    before = path.read_bytes()
    args = ["--target", str(target), "--thinking", "off", "--overwrite"]
    same = prepare([*args, "--data", str(path), "--out", str(path)])
    assert same.exit_code == 1 and "would be read by it" in same.output and path.read_bytes() == before
    inside = prepare([*args, "--data", str(tmp_path), "--out", str(tmp_path / "tokens.parquet")])
    assert inside.exit_code == 1 and "would be read by it" in inside.output
    mine = tmp_path / "out" / "mine.parquet"
    mine.parent.mkdir()
    mine.write_text("my notes")
    foreign = prepare([*args, "--data", str(path), "--out", str(mine)])
    assert foreign.exit_code == 1 and "was not written by dflash-data prepare" in foreign.output, foreign.output
    assert mine.read_text() == "my notes"
    ours = tmp_path / "out" / "tokens.parquet"
    assert prepare([*args, "--data", str(path), "--out", str(ours)]).exit_code == 0
    assert prepare([*args, "--data", str(path), "--out", str(ours)]).exit_code == 0, "its own output it replaces"


def test_prepare_parquet_input(target, tmp_path, caplog):
    rows = [{"id": "p0", "messages": CHAIN}]
    path = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)  # nested structs, as datasets exports them
    out = tmp_path / "o.parquet"
    caplog.set_level(logging.INFO)
    result = prepare(["--target", str(target), "--data", str(path), "--out", str(out), "--thinking", "off"])
    assert result.exit_code == 0, result.output
    said = result.output + caplog.text  # the result is said once: the `done:` line, not also a log line
    assert said.count("1 sample, ") == 1 and result.output.startswith("done: ") and "1 samples" not in said, said
    ids, mask, _ = ChatRenderer(target, thinking=False).encode(conversation_from_row({"messages": CHAIN}, "x", 0))
    mode = '{"template_kwargs": {}, "thinking": "off"}'  # the mode the row was rendered in
    want = {"id": "p0", "input_ids": ids.tolist(), "loss_mask": mask.tolist(), "chat_mode": mode}
    assert pq.read_table(out).to_pylist() == [want]


BAD_ROWS = {
    "no messages": ({"id": "x", "text": "hello"}, "no 'messages' (OpenAI) or 'conversations' (ShareGPT)"),
    "unknown role": (
        {"messages": [{"role": "narrator", "content": "hi"}, {"role": "assistant", "content": "a"}]},
        "unknown role 'narrator'",
    ),
    "unknown speaker": ({"conversations": [{"from": "bot", "value": "hi"}]}, "unknown speaker"),
    "no assistant": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    "empty messages": ({"messages": []}, "non-empty list"),
    "bad arguments": (
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
            ]
        },
        "not valid JSON",
    ),
    # Nested past the reader's bound inside a string: a RecursionError traceback before.
    "arguments nested 100,000 deep": (
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}]},
            ]
        },
        "arguments is not valid JSON (JSON nested more than the 64 levels allowed)",
    ),
    # The token rows made of it would be refused by dflash-extract's scan (shards/sample_ids.py).
    "id with escape sequences": (
        {"id": "c\x1b[2J", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        "id 'c\\x1b[2J' holds the control character '\\x1b' at character 1",
    ),
    "image part": (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                {"role": "assistant", "content": "a"},
            ]
        },
        "content part of type 'image_url'",
    ),
    "template refuses": ({"messages": [{"role": "assistant", "content": "a"}]}, "No user query found"),
    # Valid JSON ("\\ud83d" unpaired), not text: the tokenizer raised a TypeError, even with --skip-bad-rows.
    "lone surrogate": (
        {"messages": [{"role": "user", "content": "bad \ud83d here"}, {"role": "assistant", "content": "ok"}]},
        "messages[0].content holds a lone UTF-16 surrogate",
    ),
    # The end-of-turn text inside a reply closed its turn there: the rest was silently unsupervised.
    "end-of-turn text": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok <|im_end|> more"}]},
        "messages[1] (assistant) contains the end-of-turn text '<|im_end|>'",
    ),
    "end-of-turn text in a tool call": (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"x": "a<|im_end|>"}}}]},
            ]
        },
        "contains the end-of-turn text",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_prepare_bad_row_names_file_row_reason(target, tmp_path, case):
    row, reason = BAD_ROWS[case]
    good = {"id": "good", "messages": CHAIN}
    data = write_rows(tmp_path / "chats.jsonl", [good, row])
    out = tmp_path / "o.parquet"
    result = prepare(["--target", str(target), "--data", str(data), "--out", str(out)])
    assert result.exit_code == 1
    assert f"{data}, row 1 (line 2)" in result.output and reason in result.output, result.output
    assert "Traceback" not in result.output and not out.exists() and not list(tmp_path.glob(".o.parquet.tmp*"))
    # --skip-bad-rows writes the good row and lists the bad one in the summary.
    result = prepare(["--target", str(target), "--data", str(data), "--out", str(out), "--skip-bad-rows"])
    assert result.exit_code == 0 and "1 skipped" in result.output
    assert [r["id"] for r in pq.read_table(out).to_pylist()] == ["good"]
    skipped = json.loads(Path(f"{out}.summary.json").read_text())["skipped"]
    assert len(skipped) == 1 and skipped[0]["row"] == f"{data}, row 1 (line 2)" and reason in skipped[0]["reason"]


def test_prepare_lists_every_bad_row(target, tmp_path):
    rows = [
        {"messages": CHAIN},
        BAD_ROWS["no messages"][0],
        {"messages": CHAIN, "id": "a"},
        BAD_ROWS["no assistant"][0],
    ]
    data = write_rows(tmp_path / "chats.jsonl", rows)
    result = prepare(["--target", str(target), "--data", str(data), "--out", str(tmp_path / "o.parquet")])
    assert result.exit_code == 1 and "2 bad rows" in result.output
    assert "row 1 (line 2)" in result.output and "row 3 (line 4)" in result.output


def test_prepare_refuses_target_without_tokenizer_or_template(target, tmp_path):
    data = write_rows(tmp_path / "chats.jsonl", [{"messages": CHAIN}])
    bare = write_random_checkpoint(tmp_path / "bare", tiny_config_dict(vocab_size=VOCAB), naming="text")
    result = prepare(["--target", str(bare), "--data", str(data), "--out", str(tmp_path / "o.parquet")])
    assert result.exit_code == 1 and f"{bare}: no tokenizer" in result.output, result.output
    no_template = write_random_checkpoint(
        tmp_path / "nt", tiny_config_dict(vocab_size=VOCAB), naming="text", with_tokenizer=True
    )
    (no_template / "chat_template.jinja").unlink()
    result = prepare(["--target", str(no_template), "--data", str(data), "--out", str(tmp_path / "o.parquet")])
    assert result.exit_code == 1 and "no chat template" in result.output and "chat_template.jinja" in result.output
    small = write_random_checkpoint(tmp_path / "small", tiny_config_dict(vocab_size=300), naming="text")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (small / name).write_bytes((target / name).read_bytes())
    result = prepare(["--target", str(small), "--data", str(data), "--out", str(tmp_path / "o.parquet")])
    assert result.exit_code == 1 and "more than the model's vocab_size 300" in result.output


def test_tiny_tokenizer_is_deterministic_and_fits_the_vocabulary(target, tmp_path):
    other = write_random_checkpoint(
        tmp_path / "t2", tiny_config_dict(vocab_size=VOCAB), naming="text", seed=1, with_tokenizer=True
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (other / name).read_bytes() == (target / name).read_bytes()
    tok = ChatRenderer(target, thinking=True).tokenizer
    assert max(tok.get_vocab().values()) < VOCAB - 8  # the top ids stay free for a MASK token
    text = "Hello world, <think>\nreasoning\n</think>\n\n<tool_call>yes</tool_call><|im_end|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "hello world , <think> reasoning </think> <tool_call> yes </tool_call> <|im_end|>"
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids and tok.convert_tokens_to_ids("<|unk|>") not in ids
    # Every id the tiny target can emit round-trips through text, in any order and next to any other.
    emittable = sorted(set(range(VOCAB)) - set(unemittable_ids(VOCAB)))
    rng = np.random.default_rng(0)
    for _ in range(200):
        seq = rng.choice(emittable, size=int(rng.integers(1, 40))).tolist()
        assert tok(tok.decode(seq), add_special_tokens=False)["input_ids"] == seq


def test_bad_settings_name_the_flag(target, tmp_path):
    data = write_rows(tmp_path / "chats.jsonl", [{"messages": CHAIN}])
    result = CliRunner().invoke(
        data_cli,
        [
            "prepare",
            "--target",
            str(target),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "o.parquet"),
            "--max-length",
            "0",
        ],
    )
    assert result.exit_code == 2 and "--max-length 0: must be positive" in result.output
    result = CliRunner().invoke(
        data_cli,
        [
            "regenerate",
            "--server",
            "http://127.0.0.1:1/v1",
            "--model",
            "m",
            "--data",
            str(data),
            "--out",
            str(tmp_path / "o.jsonl"),
            "--concurrency",
            "0",
        ],
    )
    assert result.exit_code == 2 and "--concurrency 0: must be positive" in result.output
