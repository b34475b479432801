"""Data in several serving modes: a conversation row states its own (enable_thinking, chat_template_kwargs),
dflash-data prepare renders it in that mode and writes the mode per token row (chat_mode), and dflash-extract
records the modes in cache.json (chat_modes) and each sample's mode index in the shard headers and the
manifest, a long sample's pieces included; `dflash-shards info` counts samples and tokens per mode. A cache
of one mode keeps the header and manifest every earlier cache has."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from extract.chats.cli import main as data_cli
from extract.chats.template import load_tokenizer
from extract.cli import main as extract_cli
from shards.container import read_header
from shards.manifest import SCHEMA, read_manifest
from shards.reader import ShardReader
from tests.helpers.chats import effort_chat_target
from tests.helpers.extract import VOCAB, cli_args
from tools.cli.dflash_shards import main as shards_cli

# What Qwen3.8's template does with the keyword, in miniature: a system line naming the effort.
ROWS = [  # (the row's own mode fields, the mode it is rendered in under --thinking on)
    ({}, ("on", {})),
    ({"enable_thinking": False}, ("off", {})),
    ({"chat_template_kwargs": {"reasoning_effort": "low"}}, ("on", {"reasoning_effort": "low"})),
    (
        {"chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "high"}},
        ("off", {"reasoning_effort": "high"}),
    ),
    (
        {"enable_thinking": True, "chat_template_kwargs": {"reasoning_effort": "low"}},
        ("on", {"reasoning_effort": "low"}),
    ),
]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return effort_chat_target(tmp_path_factory)


def _messages(i):
    return [
        {"role": "user", "content": f"Weather {i}?"},
        {"role": "assistant", "reasoning_content": "Look outside.", "content": f"Sunny {i}."},
    ]


def _chats(path, rows=ROWS):
    path.write_text(
        "".join(json.dumps({"id": f"c{i}", "messages": _messages(i), **f}) + "\n" for i, (f, _) in enumerate(rows))
    )
    return path


def _mode(thinking, kwargs):
    return {"thinking": thinking, "template_kwargs": kwargs}


def test_prepare_renders_each_row_in_its_own_mode_and_writes_it(target, tmp_path):
    out = tmp_path / "tokens.parquet"
    args = ["prepare", "--target", str(target), "--data", str(_chats(tmp_path / "c.jsonl")), "--out", str(out)]
    result = CliRunner().invoke(data_cli, args)
    assert result.exit_code == 0, result.output
    assert "in modes" in result.output
    tokenizer = load_tokenizer(target)
    written = pq.read_table(out).to_pylist()
    for i, ((_, (thinking, kwargs)), row) in enumerate(zip(ROWS, written)):
        assert json.loads(row["chat_mode"]) == _mode(thinking, kwargs)
        messages = (
            _messages(i) if thinking == "on" else [_messages(i)[0], {"role": "assistant", "content": f"Sunny {i}."}]
        )
        text = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=thinking == "on", **kwargs)
        assert row["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"], row["id"]
    assert ("reasoning low" in tokenizer.decode(written[2]["input_ids"])) and "reasoning" not in tokenizer.decode(
        written[0]["input_ids"]
    )


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"enable_thinking": "yes"}, "enable_thinking: must be true or false"),
        ({"chat_template_kwargs": "effort=high"}, "chat_template_kwargs must be an object"),
        ({"chat_template_kwargs": {"reasoning_effort": ["a"]}}, "chat_template_kwargs.reasoning_effort: must be text"),
        ({"chat_template_kwargs": {"tools": "x"}}, "chat_template_kwargs.tools: not a template keyword"),
        (
            {"chat_template_kwargs": {"reasoning_efort": "low"}},
            "chat_template_kwargs: --template-kwarg reasoning_efort",
        ),
        ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, "disagree"),
    ],
)
def test_a_malformed_mode_field_is_refused_naming_row_and_field(target, tmp_path, fields, named):
    data = _chats(tmp_path / "c.jsonl", [ROWS[0], (fields, None)])
    out = tmp_path / "o.parquet"
    result = CliRunner().invoke(data_cli, ["prepare", "--target", str(target), "--data", str(data), "--out", str(out)])
    assert result.exit_code != 0 and "c.jsonl, row 1" in result.output and named in result.output, result.output
    assert not out.exists()


def _header_modes(cache):
    """{sample id: [mode index of each shard holding it]} read from the shard headers."""
    reader = ShardReader(cache)
    found: dict[str, list[int]] = {}
    for b in reader.batch_ids():
        for s in reader.info(b).samples:
            found.setdefault(s.sample_id, []).append(s.mode)
    return found


def test_extract_records_the_modes_and_each_samples_mode(target, tmp_path):
    cache = tmp_path / "cache"
    result = CliRunner().invoke(
        extract_cli, cli_args(target, _chats(tmp_path / "c.jsonl"), cache, token_budget=96, max_seqs=2)
    )
    assert result.exit_code == 0, result.output
    recorded = json.loads((cache / "cache.json").read_text())
    want = [_mode(t, k) for _, (t, k) in ROWS]
    distinct = [m for i, m in enumerate(want) if m not in want[:i]]  # first appearance, in dataset order
    assert recorded["chat_mode"] is None and recorded["chat_modes"] == distinct
    expected = {f"c{i}": distinct.index(m) for i, m in enumerate(want)}
    assert {s: m[0] for s, m in _header_modes(cache).items()} == expected
    manifest = read_manifest(cache)
    assert dict(zip(manifest["sample_id"].to_pylist(), manifest["mode"].to_pylist())) == expected
    # A resume (a shard lost, the manifest with it) writes it again with the same modes.
    reader = ShardReader(cache)
    num_shards = len(reader.batch_ids())
    reader.info(reader.batch_ids()[-1]).path.unlink()
    (cache / "manifest.parquet").unlink()
    again = CliRunner().invoke(
        extract_cli, cli_args(target, _chats(tmp_path / "c.jsonl"), cache, token_budget=96, max_seqs=2)
    )
    assert again.exit_code == 0, again.output
    assert len(ShardReader(cache).batch_ids()) == num_shards, "the lost shard is written again"
    assert json.loads((cache / "cache.json").read_text())["chat_modes"] == distinct
    assert {s: m[0] for s, m in _header_modes(cache).items()} == expected
    # dflash-shards info: samples and tokens per mode, against the headers counted here.
    info = CliRunner().invoke(shards_cli, ["info", "--json", str(cache)])
    assert info.exit_code == 0, info.output
    counted = json.loads(info.output)["modes"]
    reader = ShardReader(cache)
    entries = [s for b in reader.batch_ids() for s in reader.info(b).samples]
    for i, c in enumerate(counted):
        assert c["mode"] == distinct[i]
        assert c["num_samples"] == sum(m == i for m in expected.values())
        assert c["num_tokens"] == sum(s.length for s in entries if expected[s.sample_id] == i)
    text = CliRunner().invoke(shards_cli, ["info", str(cache)]).output
    assert "mode 2" in text and 'thinking on, reasoning_effort="low"' in text, text


def test_files_prepared_in_different_modes_keep_each_files_mode(target, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    chats = _chats(tmp_path / "c.jsonl", [ROWS[0], ROWS[0]])
    for name, flags in (("a", ["--thinking", "on"]), ("b", ["--thinking", "off"])):
        out = folder / f"{name}.parquet"
        args = ["prepare", "--target", str(target), "--data", str(chats), "--out", str(out), *flags]
        assert CliRunner().invoke(data_cli, args).exit_code == 0
        table = pq.read_table(out)  # ids made unique across the files; b's rows lose their column
        table = table.set_column(0, "id", pa.array([f"{name}{i}" for i in range(table.num_rows)]))
        pq.write_table(table.drop_columns(["chat_mode"]) if name == "b" else table, out)
    cache = tmp_path / "cache"
    result = CliRunner().invoke(extract_cli, cli_args(target, folder, cache, token_budget=96, max_seqs=2))
    assert result.exit_code == 0, result.output
    # b.parquet states no mode per row: its prepare summary beside it gives the file's.
    assert json.loads((cache / "cache.json").read_text())["chat_modes"] == [_mode("on", {}), _mode("off", {})]
    assert {s: m[0] for s, m in _header_modes(cache).items()} == {"a0": 0, "a1": 0, "b0": 1, "b1": 1}


def test_a_long_samples_pieces_keep_its_mode(target, tmp_path):
    rng = np.random.default_rng(0)
    on, off = json.dumps(_mode("on", {})), _mode("off", {"reasoning_effort": "high"})
    rows = [
        {"id": "short", "input_ids": rng.integers(0, VOCAB, 40).tolist(), "chat_mode": on},
        {"id": "long", "input_ids": rng.integers(0, VOCAB, 400).tolist(), "chat_mode": off},  # JSONL: an object
        {"id": "short2", "input_ids": rng.integers(0, VOCAB, 40).tolist(), "chat_mode": on},
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = tmp_path / "cache"
    extra = ("--max-seq-len", "512", "--piece-context", "24", "--piece-label-reach", "7")
    result = CliRunner().invoke(extract_cli, cli_args(target, data, cache, *extra, token_budget=128, max_seqs=4))
    assert result.exit_code == 0, result.output
    modes = _header_modes(cache)
    assert len(modes["long"]) > 1 and set(modes["long"]) == {1} and modes["short"] == modes["short2"] == [0]
    info = json.loads(CliRunner().invoke(shards_cli, ["info", "--json", str(cache)]).output)
    assert [c["num_samples"] for c in info["modes"]] == [2, 1]  # the long sample counted once


def test_a_malformed_mode_in_token_rows_is_refused_naming_the_row(target, tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [
        {"input_ids": [1, 2, 3]},
        {"input_ids": [1, 2, 3], "chat_mode": {"thinking": "maybe", "template_kwargs": {}}},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(extract_cli, cli_args(target, data, tmp_path / "cache"))
    assert result.exit_code != 0 and "d.jsonl, row 1" in result.output and "chat_mode must be" in result.output


def test_a_cache_of_one_mode_keeps_the_header_and_manifest_it_always_had(target, tmp_path):
    cache = tmp_path / "cache"
    data = _chats(tmp_path / "c.jsonl", [ROWS[1], ROWS[1]])
    assert CliRunner().invoke(extract_cli, cli_args(target, data, cache, token_budget=96, max_seqs=2)).exit_code == 0
    recorded = json.loads((cache / "cache.json").read_text())
    assert recorded["chat_mode"] == _mode("off", {}) and recorded["chat_modes"] is None
    reader = ShardReader(cache)
    for b in reader.batch_ids():
        assert all(len(row) == 4 for row in json.loads(read_header(reader.info(b).path).metadata["samples"]))
    # A manifest written before the mode column reads as every sample in mode 0.
    path = cache / "manifest.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["mode"]), path)
    manifest = read_manifest(cache)
    assert manifest.schema.names == SCHEMA.names and set(manifest["mode"].to_pylist()) == {0}
    info = json.loads(CliRunner().invoke(shards_cli, ["info", "--json", str(cache)]).output)
    assert [c["described"] for c in info["modes"]] == ["thinking off"]


def test_parquet_conversations_state_their_modes_in_a_struct(target, tmp_path):
    # pyarrow merges struct fields over rows: row 0 reads back {"enable_thinking": None, "reasoning_effort": "low"},
    # and a null keyword counts as not stated.
    rows = [
        {"id": "p0", "messages": _messages(0), "chat_template_kwargs": {"reasoning_effort": "low"}},
        {"id": "p1", "messages": _messages(1), "chat_template_kwargs": {"enable_thinking": False}},
    ]
    data, out = tmp_path / "c.parquet", tmp_path / "o.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    assert pq.read_table(data).to_pylist()[0]["chat_template_kwargs"]["enable_thinking"] is None
    result = CliRunner().invoke(data_cli, ["prepare", "--target", str(target), "--data", str(data), "--out", str(out)])
    assert result.exit_code == 0, result.output
    modes = [json.loads(m) for m in pq.read_table(out).column("chat_mode").to_pylist()]
    assert modes == [_mode("on", {"reasoning_effort": "low"}), _mode("off", {})]
