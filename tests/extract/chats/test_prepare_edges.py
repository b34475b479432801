"""dflash-data prepare on hostile inputs: Parquet's struct merging, replies cut inside their reasoning,
a tokenizer whose ids pass the model's vocabulary, same-named files, errors of on-the-fly preparation, code
shipped in the target directory (auto_map: refused, never run, never asked about on stdin).

Each test names what went wrong before it was fixed; the tiny target and helpers are tests/helpers/chats.py's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from extract.chats.cli import main as data_cli
from extract.chats.conversations import conversation_from_row, iter_conversations
from extract.chats.prepare import tokens_for_extraction
from extract.chats.template import ChatRenderer
from extract.cli import main as extract_cli
from extract.dataset.index import scan_dataset
from extract.dataset.rows import DataError
from tests.helpers.chats import CHAIN, chat_target, prepare, write_rows
from tests.helpers.extract import cli_args


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return chat_target(tmp_path_factory)


def _with_hello_at(target: Path, out: Path, token_id: int) -> Path:
    """A copy of `target` whose tokenizer.json maps "hello" to `token_id`."""
    shutil.copytree(target, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    tok["model"]["vocab"]["hello"] = token_id
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


def _call(name: str, args: dict) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}],
    }


def _tool(name: str, props: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


TOOL_ROWS = [
    {
        "id": "r1",
        "messages": [
            {"role": "user", "content": "time"},
            _call("clock", {"tz": "utc"}),
            {"role": "tool", "content": "noon"},
            {"role": "assistant", "content": "noon"},
        ],
        "tools": [_tool("clock", {"tz": {"type": "string"}})],
    },
    {
        "id": "r2",
        "messages": [
            {"role": "user", "content": "add"},
            _call("add", {"a": 1, "b": 2}),
            {"role": "tool", "content": "3"},
            {"role": "assistant", "content": "three"},
        ],
        "tools": [_tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}})],
    },
]


OFF = '{"template_kwargs": {}, "thinking": "off"}'  # the mode column of a row rendered with --thinking off


def test_parquet_rows_do_not_get_other_rows_keys(target, tmp_path):
    # pyarrow merges struct fields over rows: r1 read back as clock(tz, a=None, b=None), and prepare
    # rendered and supervised "<parameter=a> null"; the tools' schemas got null properties too.
    path = tmp_path / "calls.parquet"
    pq.write_table(pa.Table.from_pylist(TOOL_ROWS), path)
    assert pq.read_table(path).to_pylist()[0]["messages"][1]["tool_calls"][0]["function"]["arguments"]["a"] is None
    out = tmp_path / "o.parquet"
    result = prepare(["--target", str(target), "--data", str(path), "--out", str(out), "--thinking", "off"])
    assert result.exit_code == 0, result.output
    renderer = ChatRenderer(target, thinking=False)
    for row, written in zip(TOOL_ROWS, pq.read_table(out).to_pylist()):  # as the same rows in JSON Lines give
        ids, mask, _ = renderer.encode(conversation_from_row(row, "x.jsonl", 0))
        assert written == {"id": row["id"], "input_ids": ids.tolist(), "loss_mask": mask.tolist(), "chat_mode": OFF}
    # A null in JSON is the row's own: kept (in a Parquet struct it cannot be told from a merged one).
    conv = conversation_from_row(
        {"messages": [{"role": "user", "content": "q"}, _call("f", {"x": None})]}, "c.jsonl", 0
    )
    assert conv.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": None}


def _supervised(renderer: ChatRenderer, messages: list[dict]) -> list[str]:
    ids, mask, _ = renderer.encode(conversation_from_row({"messages": messages}, "c.jsonl", 0))
    return renderer.tokenizer.convert_ids_to_tokens(ids[mask == 1].tolist())


def test_reply_cut_inside_its_reasoning_supervises_only_the_reasoning(target):
    # Before: "</think>" was supervised though the model, cut at --max-tokens, never wrote it.
    renderer = ChatRenderer(target, thinking=True)
    user = {"role": "user", "content": "Why?"}
    cut = {"role": "assistant", "content": "", "reasoning_content": "think more", "finish_reason": "length"}
    assert _supervised(renderer, [user, cut]) == ["think", "more"]
    # Cut after the think block: the model wrote "</think>" and the content, not the end token.
    after = {**cut, "content": "Because"}
    assert _supervised(renderer, [user, after]) == ["think", "more", "</think>", "because"]
    # Cut before writing anything: nothing is supervised in that turn.
    nothing = {"role": "assistant", "content": "", "finish_reason": "length"}
    assert _supervised(renderer, [user, nothing]) == []


HELLO = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]


def test_tokenizer_id_outside_the_vocabulary_is_refused_before_work(target, tmp_path):
    # Before: tokenizer.json mapped "hello" to 700 (vocab_size 512, 305 tokens) and prepare wrote id 700.
    bad = _with_hello_at(target, tmp_path / "target", 700)
    data = write_rows(tmp_path / "chats.jsonl", HELLO)
    out = tmp_path / "o.parquet"
    result = prepare(["--target", str(bad), "--data", str(data), "--out", str(out)])
    assert result.exit_code == 1 and not out.exists(), result.output
    assert f"{bad / 'tokenizer.json'}: token 'hello' has id 700, outside the model's vocab_size 512" in result.output


def test_prepared_ids_are_checked_against_the_vocabulary(target, tmp_path, monkeypatch):
    # Past the tokenizer check (here switched off), an id outside the vocabulary is still never written.
    monkeypatch.setattr(ChatRenderer, "_check_fits", lambda self, vocab_size: None)
    bad = _with_hello_at(target, tmp_path / "target", 700)
    data = write_rows(tmp_path / "chats.jsonl", HELLO)
    out = tmp_path / "o.parquet"
    result = prepare(["--target", str(bad), "--data", str(data), "--out", str(out), "--thinking", "off"])
    assert result.exit_code == 1 and not out.exists(), result.output
    assert f"{data}, row 0 (line 1): token " in result.output
    assert "has id 700 ('hello'), outside the model's vocab_size 512" in result.output


def test_same_named_files_get_distinct_derived_ids(target, tmp_path):
    # Before: a/chats.jsonl and b/chats.jsonl both derived "chats:0": "duplicate id", nothing written.
    row = {"messages": CHAIN}
    for folder in ("a", "b"):
        write_rows(tmp_path / "in" / folder / "chats.jsonl", [row, row])
    write_rows(tmp_path / "in" / "other.jsonl", [row])
    out = tmp_path / "o.parquet"
    result = prepare(["--target", str(target), "--data", str(tmp_path / "in"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    ids = [r["id"] for r in pq.read_table(out).to_pylist()]
    assert ids == ["a/chats.jsonl:0", "a/chats.jsonl:1", "b/chats.jsonl:0", "b/chats.jsonl:1", "other:0"]
    # One file alone keeps the documented "<stem>:<row>".
    assert [c.sample_id for c in iter_conversations(tmp_path / "in" / "a")] == ["chats:0", "chats:1"]
    # A derived id can still meet a given one: the message says which was derived and how to fix it.
    clash = write_rows(tmp_path / "clash" / "c.jsonl", [{"id": "c:1", **row}, row])
    with pytest.raises(DataError, match=r"row 1 \(line 2\): duplicate id 'c:1' \(derived from the file name"):
        list(iter_conversations(clash))


def test_errors_on_prepared_rows_name_the_chat_file_and_row(target, tmp_path):
    # Before: dflash-extract's error named the temporary prepared file, deleted once it had failed.
    rows = [{"id": f"c{i}", "messages": CHAIN} for i in range(3)]
    data = write_rows(tmp_path / "chats.jsonl", rows)
    with pytest.raises(DataError) as err:
        with tokens_for_extraction(str(data), str(target), "off") as (prepared, _):
            scan_dataset(prepared, vocab_size=10)  # every row has ids past 10: refused, naming rows
    message = str(err.value)
    assert "dflash-extract-prepared" not in message, message
    assert f"{data}, row 0 (line 1) (id 'c0')" in message and f"{data}, row 2 (line 3) (id 'c2')" in message


# Code a checkpoint may ship: auto_map naming a module of the directory, as transformers reads it (file ->
# fields set in it). The module writes a marker when imported. "config": a model type transformers does not
# know and a tokenizer class that sends AutoTokenizer to config.json (before: "run the custom code? [y/N]",
# and the code ran on "y").
_SHIPPED_CODE = {
    "tokenizer": {
        "tokenizer_config.json": {
            "auto_map": {"AutoTokenizer": [None, "shipped.EvilTokenizer"]},
            "tokenizer_class": "EvilTokenizer",
        }
    },
    "config": {
        "config.json": {"auto_map": {"AutoConfig": "shipped.EvilConfig"}, "model_type": "evil"},
        "tokenizer_config.json": {"tokenizer_class": "Qwen2Tokenizer"},
    },
}


def _with_shipped_code(target: Path, out: Path, which: str, marker: Path) -> Path:
    """A copy of `target` whose files name a module of its own (shipped.py) that writes `marker` when imported."""
    shutil.copytree(target, out)
    (out / "shipped.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig, PreTrainedTokenizerFast\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    for file_name, fields in _SHIPPED_CODE[which].items():
        (out / file_name).write_text(json.dumps({**json.loads((out / file_name).read_text()), **fields}))
    return out


@pytest.mark.parametrize(
    "which, command", [("tokenizer", "prepare"), ("config", "prepare"), ("tokenizer", "dflash-extract")]
)
def test_code_shipped_in_the_target_is_refused_never_run(target, tmp_path, which, command):
    marker = tmp_path / "the shipped code ran"
    shipped = _with_shipped_code(target, tmp_path / "target", which, marker)
    data = write_rows(tmp_path / "chats.jsonl", [{"id": "a", "messages": CHAIN}])
    if command == "prepare":
        cli, args = data_cli, ["prepare", "--target", shipped, "--data", data, "--out", tmp_path / "out.parquet"]
    else:  # conversations prepared on the fly load the same tokenizer
        cli, args = extract_cli, cli_args(shipped, data, tmp_path / "cache", "--device", "cpu")
    # "y" waiting on stdin: what a user answering the prompt would type.
    result = CliRunner().invoke(cli, [str(a) for a in args], input="y\n")
    assert not marker.exists(), "the code shipped in the checkpoint ran"
    assert result.exit_code == 1 and (result.exception is None or isinstance(result.exception, SystemExit))
    named = "tokenizer_config.json" if which == "tokenizer" else "config.json"
    assert f"Error: {shipped / named}: auto_map " in result.output, result.output
    assert "never runs code from a checkpoint" in result.output and "[y/N]" not in result.output, result.output
    assert not (tmp_path / "out.parquet").exists() and not (tmp_path / "cache").exists()
