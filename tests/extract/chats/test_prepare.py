"""dflash-data prepare: chat template rendering and loss masks against independent references.

References: (1) an independent per-turn rendering written here in Python from Qwen3.5's rules, each
segment tokenised on its own; (2) transformers' own assistant mask (return_assistant_tokens_mask)
over a copy of the template with {% generation %} blocks around what the model writes.
"""

from __future__ import annotations

import json
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
from tools.fixtures.tiny_target import tiny_config_dict, write_random_checkpoint
from tools.fixtures.tiny_tokenizer import CHAT_TEMPLATE, unemittable_ids

VOCAB = 512

WEATHER = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
# Agentic: tool-call chain, then a later user query, so every earlier turn loses its reasoning.
AGENTIC = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "reasoning_content": "I need the tool.", "content": "", "tool_calls": [WEATHER]},
    {"role": "tool", "content": '{"temperature": 21}'},
    {
        "role": "assistant",
        "reasoning_content": "Also the time.",
        "content": "Let me check the time.",
        "tool_calls": [CLOCK, WEATHER],
    },
    {"role": "tool", "content": "10:00"},
    {"role": "tool", "content": '{"temperature": 22}'},
    {"role": "assistant", "reasoning_content": "Summarise.", "content": "It is 21 degrees at 10:00."},
    {"role": "user", "content": "Thanks! And tomorrow?"},
    {"role": "assistant", "reasoning_content": "No data for tomorrow.", "content": "I do not know."},
]
# Tool chain after the last user query: the template keeps the reasoning of both turns.
CHAIN = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "reasoning_content": "Call it.", "content": "", "tool_calls": [WEATHER]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "reasoning_content": "Answer now.", "content": "Sunny."},
]
# Reasoning written inline in the content, no reasoning_content.
INLINE = [
    {"role": "user", "content": "Two plus two?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nFour."},
    {"role": "user", "content": "Times three?"},
    {"role": "assistant", "content": "<think>\nMultiply.\n</think>\n\nTwelve."},
]
CONVERSATIONS = {"agentic": AGENTIC, "chain": CHAIN, "inline": INLINE}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return write_random_checkpoint(
        tmp_path_factory.mktemp("target"), tiny_config_dict(vocab_size=VOCAB), naming="text", with_tokenizer=True
    )


def _split_think(m: dict) -> tuple[str, str]:
    reasoning, content = m.get("reasoning_content"), m.get("content") or ""
    if reasoning is None and "</think>" in content:
        reasoning = content.split("</think>")[0].split("<think>")[-1]
        content = content.split("</think>")[-1].strip()
    return (reasoning or "").strip(), content.strip()


def reference_segments(messages: list[dict], thinking: bool) -> list[tuple[str, int]]:
    """(text, supervised) pieces of the conversation, turn by turn, from Qwen3.5's rules."""
    last_query = max(i for i, m in enumerate(messages) if m["role"] == "user")
    segs: list[tuple[str, int]] = []
    for i, m in enumerate(messages):
        role, content = m["role"], (m.get("content") or "").strip()
        if role in ("system", "user"):
            segs.append((f"<|im_start|>{role}\n{content}<|im_end|>\n", 0))
        elif role == "tool":
            first = messages[i - 1]["role"] != "tool"
            last = i + 1 == len(messages) or messages[i + 1]["role"] != "tool"
            segs.append(
                (
                    ("<|im_start|>user" if first else "")
                    + f"\n<tool_response>\n{content}\n</tool_response>"
                    + ("<|im_end|>\n" if last else ""),
                    0,
                )
            )
        else:
            reasoning, content = _split_think(m)
            if i > last_query and thinking:
                segs += [("<|im_start|>assistant\n<think>\n", 0), (f"{reasoning}\n</think>\n\n{content}", 1)]
            elif i > last_query:  # thinking off: the generation prompt closed an empty think block
                segs += [("<|im_start|>assistant\n<think>\n\n</think>\n\n", 0), (content, 1)]
            else:
                segs += [("<|im_start|>assistant\n", 0), (content, 1)]
            for j, call in enumerate(m.get("tool_calls") or []):
                fn = call["function"]
                args = fn["arguments"] if isinstance(fn["arguments"], dict) else json.loads(fn["arguments"])
                text = ("\n" if j else "\n\n" if content else "") + f"<tool_call>\n<function={fn['name']}>\n"
                for name, value in args.items():
                    text += (
                        f"<parameter={name}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
                    )
                segs.append((text + "</function>\n</tool_call>", 1))
            segs += [("<|im_end|>", 1), ("\n", 0)]
    return segs


def _encode(target: Path, messages: list[dict], thinking: bool):
    renderer = ChatRenderer(target, thinking=thinking)
    return renderer, *renderer.encode(conversation_from_row({"messages": messages}, "chats.jsonl", 0))


@pytest.mark.parametrize("thinking", [True, False], ids=["think-on", "think-off"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_mask_equals_per_turn_reference(target, name, thinking):
    renderer, ids, mask, _ = _encode(target, CONVERSATIONS[name], thinking)
    segs = reference_segments(CONVERSATIONS[name], thinking)
    tok = renderer.tokenizer
    # The reference text is the template's final rendering...
    conv = conversation_from_row({"messages": CONVERSATIONS[name]}, "chats.jsonl", 0)
    assert "".join(t for t, _ in segs) == renderer.render(renderer.prepare_messages(conv.messages)[0])
    # ...and its per-segment tokens and flags are exactly the ids and mask.
    ref_ids, ref_mask = [], []
    for text, flag in segs:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ref_ids += piece
        ref_mask += [flag] * len(piece)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(mask, ref_mask)
    assert (ids[mask == 1] == tok.convert_tokens_to_ids("<|im_end|>")).sum() == sum(
        m["role"] == "assistant" for m in CONVERSATIONS[name]
    )


def _generation_marked_template() -> str:
    """The tiny template with {% generation %} around what the model writes in each mode."""
    old_turn = (
        "        {%- if loop.index0 > ns.last_query_index -%}\n"
        "            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning | trim + '\\n</think>\\n\\n' + content -}}\n"
        "        {%- else -%}\n"
        "            {{- '<|im_start|>assistant\\n' + content -}}\n"
        "        {%- endif -%}\n"
    )
    new_turn = (
        "        {%- if loop.index0 > ns.last_query_index and enable_thinking is defined and enable_thinking is false -%}\n"
        "            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning | trim + '\\n</think>\\n\\n' -}}{% generation %}{{- content -}}{% endgeneration %}\n"
        "        {%- elif loop.index0 > ns.last_query_index -%}\n"
        "            {{- '<|im_start|>assistant\\n<think>\\n' -}}{% generation %}{{- reasoning | trim + '\\n</think>\\n\\n' + content -}}{% endgeneration %}\n"
        "        {%- else -%}\n"
        "            {{- '<|im_start|>assistant\\n' -}}{% generation %}{{- content -}}{% endgeneration %}\n"
        "        {%- endif -%}\n"
        "        {% generation %}\n"
    )
    old_end = "        {%- endfor -%}\n        {{- '<|im_end|>\\n' -}}\n    {%- elif message.role == 'tool' -%}"
    new_end = "        {%- endfor -%}\n        {{- '<|im_end|>' -}}{% endgeneration %}{{- '\\n' -}}\n    {%- elif message.role == 'tool' -%}"
    assert CHAT_TEMPLATE.count(old_turn) == 1 and CHAT_TEMPLATE.count(old_end) == 1
    return CHAT_TEMPLATE.replace(old_turn, new_turn).replace(old_end, new_end)


@pytest.mark.parametrize("thinking", [True, False], ids=["think-on", "think-off"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_mask_equals_transformers_assistant_mask(target, name, thinking):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    renderer = ChatRenderer(target, thinking=thinking)
    conv = conversation_from_row({"messages": CONVERSATIONS[name], "tools": tools}, "chats.jsonl", 0)
    ids, mask, _ = renderer.encode(conv)
    messages, _ = renderer.prepare_messages(conv.messages)
    ref = renderer.tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=_generation_marked_template(),
        enable_thinking=thinking,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    np.testing.assert_array_equal(ids, ref["input_ids"])
    np.testing.assert_array_equal(mask, ref["assistant_masks"])


def test_thinking_off_removes_reasoning_and_counts_it(target):
    renderer, ids, mask, dropped = _encode(target, AGENTIC, thinking=False)
    text = renderer.tokenizer.decode(ids.tolist())  # the tiny tokenizer decodes words joined by spaces
    assert dropped == 4 and "no data for tomorrow" not in text and "<think> </think> i do not know ." in text
    _, ids_on, _, dropped_on = _encode(target, AGENTIC, thinking=True)
    assert dropped_on == 0 and "no data for tomorrow" in renderer.tokenizer.decode(ids_on.tolist())


SHAREGPT = {
    "system": "You are brief.",
    "conversations": [
        {"from": "human", "value": "What is the weather in Paris?"},
        {
            "from": "function_call",
            "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}),
        },
        {"from": "observation", "value": '{"temperature": 21}'},
        {"from": "gpt", "value": "It is 21 degrees."},
        {"from": "human", "value": "Thanks!"},
        {"from": "gpt", "value": "You are welcome."},
    ],
}
SHAREGPT_AS_OPENAI = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [WEATHER]},
    {"role": "tool", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "It is 21 degrees."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]


@pytest.mark.parametrize("thinking", [True, False], ids=["think-on", "think-off"])
def test_sharegpt_equals_openai_and_reference(target, thinking):
    renderer = ChatRenderer(target, thinking=thinking)
    ids_s, mask_s, _ = renderer.encode(conversation_from_row(SHAREGPT, "share.json", 0))
    _, ids_o, mask_o, _ = _encode(target, SHAREGPT_AS_OPENAI, thinking)
    np.testing.assert_array_equal(ids_s, ids_o)
    np.testing.assert_array_equal(mask_s, mask_o)
    ref_mask = []
    for text, flag in reference_segments(SHAREGPT_AS_OPENAI, thinking):
        ref_mask += [flag] * len(renderer.tokenizer(text, add_special_tokens=False)["input_ids"])
    np.testing.assert_array_equal(mask_s, ref_mask)


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows))
    return path


def _prepare(args: list[str]):
    return CliRunner().invoke(data_cli, ["prepare", *args], catch_exceptions=False)


def test_prepare_formats_and_output_reads_in_extract(target, tmp_path):
    rows = [{"id": f"c{i}", "messages": conv} for i, conv in enumerate(CONVERSATIONS.values())]
    share = [{"id": "s0", **SHAREGPT}]
    jsonl = _write_rows(tmp_path / "in" / "a.jsonl", rows[:2])
    _write_rows(tmp_path / "in" / "b.json", rows[2:] + share)
    out = tmp_path / "data.parquet"
    result = _prepare(["--target", str(target), "--data", str(tmp_path / "in"), "--out", str(out)])
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
        _prepare(["--target", str(target), "--data", str(tmp_path / "in" / "a.*l"), "--out", str(out2)]).exit_code == 0
    )
    assert pq.read_table(out2).to_pylist() == table[:2]
    assert jsonl.exists()
    # A rerun refuses to overwrite; --max-length cuts and counts.
    again = _prepare(["--target", str(target), "--data", str(jsonl), "--out", str(out2)])
    assert again.exit_code == 1 and "exists" in again.output and "--overwrite" in again.output
    cut = _prepare(
        ["--target", str(target), "--data", str(jsonl), "--out", str(out2), "--overwrite", "--max-length", "20"]
    )
    assert cut.exit_code == 0 and "2 truncated" in cut.output
    assert all(len(r["input_ids"]) == 20 for r in pq.read_table(out2).to_pylist())


def test_prepare_never_replaces_its_input_or_a_file_it_did_not_write(target, tmp_path):
    path = tmp_path / "convs.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "p0", "messages": CHAIN}]), path)
    before = path.read_bytes()
    args = ["--target", str(target), "--thinking", "off", "--overwrite"]
    same = _prepare([*args, "--data", str(path), "--out", str(path)])
    assert same.exit_code == 1 and "would be read by it" in same.output and path.read_bytes() == before
    inside = _prepare([*args, "--data", str(tmp_path), "--out", str(tmp_path / "tokens.parquet")])
    assert inside.exit_code == 1 and "would be read by it" in inside.output
    mine = tmp_path / "out" / "mine.parquet"
    mine.parent.mkdir()
    mine.write_text("my notes")
    foreign = _prepare([*args, "--data", str(path), "--out", str(mine)])
    assert foreign.exit_code == 1 and "was not written by dflash-data prepare" in foreign.output, foreign.output
    assert mine.read_text() == "my notes"
    ours = tmp_path / "out" / "tokens.parquet"
    assert _prepare([*args, "--data", str(path), "--out", str(ours)]).exit_code == 0
    assert _prepare([*args, "--data", str(path), "--out", str(ours)]).exit_code == 0, "its own output it replaces"


def test_prepare_parquet_input(target, tmp_path):
    rows = [{"id": "p0", "messages": CHAIN}]
    path = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)  # nested structs, as datasets exports them
    out = tmp_path / "o.parquet"
    result = _prepare(["--target", str(target), "--data", str(path), "--out", str(out), "--thinking", "off"])
    assert result.exit_code == 0, result.output
    ids, mask, _ = ChatRenderer(target, thinking=False).encode(conversation_from_row({"messages": CHAIN}, "x", 0))
    assert pq.read_table(out).to_pylist() == [{"id": "p0", "input_ids": ids.tolist(), "loss_mask": mask.tolist()}]


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
    data = _write_rows(tmp_path / "chats.jsonl", [good, row])
    out = tmp_path / "o.parquet"
    result = _prepare(["--target", str(target), "--data", str(data), "--out", str(out)])
    assert result.exit_code == 1
    assert f"{data}, row 1 (line 2)" in result.output and reason in result.output, result.output
    assert "Traceback" not in result.output and not out.exists() and not list(tmp_path.glob(".o.parquet.tmp*"))
    # --skip-bad-rows writes the good row and lists the bad one in the summary.
    result = _prepare(["--target", str(target), "--data", str(data), "--out", str(out), "--skip-bad-rows"])
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
    data = _write_rows(tmp_path / "chats.jsonl", rows)
    result = _prepare(["--target", str(target), "--data", str(data), "--out", str(tmp_path / "o.parquet")])
    assert result.exit_code == 1 and "2 bad rows" in result.output
    assert "row 1 (line 2)" in result.output and "row 3 (line 4)" in result.output


def test_prepare_refuses_target_without_tokenizer_or_template(target, tmp_path):
    data = _write_rows(tmp_path / "chats.jsonl", [{"messages": CHAIN}])
    bare = write_random_checkpoint(tmp_path / "bare", tiny_config_dict(vocab_size=VOCAB), naming="text")
    result = _prepare(["--target", str(bare), "--data", str(data), "--out", str(tmp_path / "o.parquet")])
    assert result.exit_code == 1 and f"{bare}: no tokenizer" in result.output, result.output
    no_template = write_random_checkpoint(
        tmp_path / "nt", tiny_config_dict(vocab_size=VOCAB), naming="text", with_tokenizer=True
    )
    (no_template / "chat_template.jinja").unlink()
    result = _prepare(["--target", str(no_template), "--data", str(data), "--out", str(tmp_path / "o.parquet")])
    assert result.exit_code == 1 and "no chat template" in result.output and "chat_template.jinja" in result.output
    small = write_random_checkpoint(tmp_path / "small", tiny_config_dict(vocab_size=300), naming="text")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (small / name).write_bytes((target / name).read_bytes())
    result = _prepare(["--target", str(small), "--data", str(data), "--out", str(tmp_path / "o.parquet")])
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
    data = _write_rows(tmp_path / "chats.jsonl", [{"messages": CHAIN}])
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
