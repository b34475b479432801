"""Serving modes beyond --thinking: `--template-kwarg KEY=VALUE` reaches the chat template in dflash-data
prepare, regenerate (the server's chat_template_kwargs) and dflash-extract; the mode is recorded in the
regenerated rows and in cache.json (chat_mode); a keyword the template never reads is refused; and
dflash-train eval warns when it evaluates another mode than the cache's."""

from __future__ import annotations

import json
import logging

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from extract.chats.cli import main as data_cli
from extract.chats.template import load_tokenizer
from extract.cli import main as extract_cli
from shards.common.chat_mode import chat_mode, parse_template_kwargs
from tests.helpers.chats import effort_chat_target, read_rows, regenerate_args, running, write_conversations
from tests.helpers.extract import cli_args
from tools.cli.dflash_train import entry_point
from tools.fixtures.tiny_server import TinyChatModel, make_server
from train.eval.config import EvalConfig
from train.eval.run import evaluated_mode, mode_mismatch
from train.eval.speculative import PromptModes, read_prompts

# What Qwen3.8's template does with the keyword, in miniature: a system line naming the effort.


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The tiny chat target with a template that reads reasoning_effort."""
    return effort_chat_target(tmp_path_factory)


def test_values_parse_as_json_scalars_else_text():
    entries = [
        "reasoning_effort=high",
        "budget=2048",
        "scale=0.5",
        "strict=true",
        "none=null",
        'quoted="7"',
        "list=[1]",
    ]
    assert parse_template_kwargs(entries) == {
        "reasoning_effort": "high",
        "budget": 2048,
        "scale": 0.5,
        "strict": True,
        "none": None,
        "quoted": "7",
        "list": "[1]",
    }
    for bad, message in [
        ("effort", "expected KEY=VALUE"),
        ("enable_thinking=false", "use --thinking"),
        ("tools=x", "apply_chat_template's own argument"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_template_kwargs([bad])
    with pytest.raises(ValueError, match="given twice"):
        parse_template_kwargs(["a=1", "a=2"])


def _answered(path, n):
    """n conversations with an assistant reply each (what prepare and extract train on)."""
    rows = [
        {
            "id": f"c{i}",
            "messages": [{"role": "user", "content": f"Weather {i}?"}, {"role": "assistant", "content": "Sunny."}],
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prepare(target, data, out, *extra):
    args = ["prepare", "--target", str(target), "--data", str(data), "--out", str(out), *extra]
    return CliRunner().invoke(data_cli, args)


def test_prepare_renders_the_mode_and_refuses_a_keyword_the_template_never_reads(target, tmp_path):
    chats = _answered(tmp_path / "chats.jsonl", 2)
    plain, high = tmp_path / "plain.parquet", tmp_path / "high.parquet"
    assert _prepare(target, chats, plain).exit_code == 0
    result = _prepare(target, chats, high, "--template-kwarg", "reasoning_effort=high")
    assert result.exit_code == 0, result.output
    plain_ids, high_ids = (pq.read_table(p).column("input_ids").to_pylist() for p in (plain, high))
    assert all(len(h) > len(p) for h, p in zip(high_ids, plain_ids)), "the effort line is rendered"
    config = json.loads((tmp_path / "high.parquet.summary.json").read_text())["config"]
    assert config["template_kwargs"] == ["reasoning_effort=high"]
    typo = _prepare(target, chats, tmp_path / "typo.parquet", "--template-kwarg", "reasoning_efort=high")
    assert typo.exit_code == 1 and "--template-kwarg reasoning_efort" in typo.output, typo.output
    assert "never reads it" in typo.output and "reasoning_effort" in typo.output
    assert not (tmp_path / "typo.parquet").exists()


def test_extract_records_the_mode_in_cache_json(target, tmp_path):
    chats = _answered(tmp_path / "chats.jsonl", 3)
    direct, two_step, prepared = tmp_path / "direct", tmp_path / "two-step", tmp_path / "data.parquet"
    mode = ("--thinking", "off", "--template-kwarg", "reasoning_effort=high")
    result = CliRunner().invoke(extract_cli, cli_args(target, chats, direct, *mode, token_budget=64, max_seqs=4))
    assert result.exit_code == 0, result.output
    want = {"thinking": "off", "template_kwargs": {"reasoning_effort": "high"}}
    recorded = json.loads((direct / "cache.json").read_text())
    assert recorded["chat_mode"] == want
    assert recorded["dataset"]["prepared"]["template_kwargs"] == {"reasoning_effort": "high"}
    # Prepared first: the mode comes from the prepare summary beside the token rows.
    assert _prepare(target, chats, prepared, *mode).exit_code == 0
    result = CliRunner().invoke(extract_cli, cli_args(target, prepared, two_step, token_budget=64, max_seqs=4))
    assert result.exit_code == 0, result.output
    assert json.loads((two_step / "cache.json").read_text())["chat_mode"] == want
    # Token rows without a record (no summary, no chat_mode column): the mode is unknown, and
    # --template-kwarg is refused with them.
    bare = tmp_path / "bare.parquet"
    pq.write_table(pq.read_table(prepared).drop_columns(["chat_mode"]), bare)
    result = CliRunner().invoke(extract_cli, cli_args(target, bare, tmp_path / "c3", token_budget=64, max_seqs=4))
    assert result.exit_code == 0 and json.loads((tmp_path / "c3/cache.json").read_text())["chat_mode"] is None
    result = CliRunner().invoke(
        extract_cli,
        cli_args(
            target, bare, tmp_path / "c4", "--template-kwarg", "reasoning_effort=high", token_budget=64, max_seqs=4
        ),
    )
    assert result.exit_code != 0 and "--template-kwarg reasoning_effort=high: --data" in result.output, result.output


def test_regenerate_sends_the_mode_and_records_it(target, tmp_path):
    data = write_conversations(tmp_path / "chats.jsonl", 2, multi_turn=False)
    out = tmp_path / "regen.jsonl"
    with running(make_server(TinyChatModel(target, max_batch=4), 0)) as url:
        args = regenerate_args(url, data, out, "--template-kwarg", "reasoning_effort=high")
        result = CliRunner().invoke(data_cli, args)
        assert result.exit_code == 0, result.output
        rows = read_rows(out)
        assert [r["chat_template_kwargs"] for r in rows] == [{"enable_thinking": False, "reasoning_effort": "high"}] * 2
        meta = json.loads((tmp_path / "regen.jsonl.regenerate.json").read_text())
        assert meta["template_kwargs"] == {"reasoning_effort": "high"}
        meta_path = tmp_path / "regen.jsonl.regenerate.json"
        older = {k: v for k, v in meta.items() if k != "template_kwargs"}  # a run before --template-kwarg
        meta_path.write_text(json.dumps(older))
        resumed = CliRunner().invoke(data_cli, regenerate_args(url, data, out))
        assert resumed.exit_code == 0, resumed.output
        meta_path.write_text(json.dumps(meta))
        other = regenerate_args(url, data, out, "--template-kwarg", "reasoning_effort=low")
        result = CliRunner().invoke(data_cli, other)
    assert result.exit_code != 0 and "template_kwargs" in result.output, result.output


def test_eval_warns_when_the_mode_differs_from_the_caches(tmp_path, caplog):
    cache_mode = {"thinking": "on", "template_kwargs": {"reasoning_effort": "high"}}

    def evaluated(*kwargs: str) -> dict:
        cfg = EvalConfig(drafter=str(tmp_path), cache=str(tmp_path), eval_shards=1, template_kwargs=list(kwargs))
        return evaluated_mode(cfg, cache_mode)

    with caplog.at_level(logging.WARNING):
        warning = mode_mismatch(evaluated("reasoning_effort=xhigh"), cache_mode, "cache C")
    assert warning is not None and warning in caplog.text and "but cache C was rendered in" in warning
    assert 'thinking on, reasoning_effort="xhigh"' in warning and 'thinking on, reasoning_effort="high"' in warning
    assert mode_mismatch(evaluated("reasoning_effort=high"), cache_mode, "cache C") is None
    assert evaluated() == cache_mode  # no mode given: the recorded one is evaluated
    # One flag given: the rest of the recorded mode stays.
    thinking_off = {"thinking": "off", "template_kwargs": {"reasoning_effort": "high"}}
    cfg = EvalConfig(drafter=str(tmp_path), cache=str(tmp_path), eval_shards=1, thinking="off")
    assert evaluated_mode(cfg, cache_mode) == thinking_off
    other = {"thinking": "off", "template_kwargs": {}}
    assert evaluated_mode(cfg, None) == other
    both = EvalConfig(drafter=str(tmp_path), cache=str(tmp_path), eval_shards=1, template_kwargs=["verbosity=2"])
    assert evaluated_mode(both, thinking_off)["template_kwargs"] == {"reasoning_effort": "high", "verbosity": 2}
    assert mode_mismatch(evaluated("reasoning_effort=xhigh"), None, "cache C") is None  # nothing recorded


def test_eval_renders_conversation_prompts_in_the_mode_evaluated(target, tmp_path):
    user, reply = {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"messages": [user, reply]}) + "\n" + json.dumps([5, 6, 7]) + "\n")
    render = entry_point().prompt_renderer(str(target), "off", ["reasoning_effort=high"])
    tokenizer = load_tokenizer(target)
    text = tokenizer.apply_chat_template(
        [user], add_generation_prompt=True, enable_thinking=False, reasoning_effort="high", tokenize=False
    )
    assert "reasoning high" in text
    assert read_prompts(path, 512, render=render) == [tokenizer(text, add_special_tokens=False)["input_ids"], [5, 6, 7]]
    with pytest.raises(ValueError, match="line 1: a conversation, which needs the target's chat template"):
        read_prompts(path, 512)


def test_eval_renders_a_conversation_prompt_in_the_mode_it_states(target, tmp_path):
    user, reply = {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}
    path = tmp_path / "prompts.jsonl"
    rows = [{"messages": [user, reply], "chat_template_kwargs": {"reasoning_effort": "low"}}, {"messages": [user]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    render = entry_point().prompt_renderer(str(target), "off", [])
    modes = PromptModes()
    prompts = read_prompts(path, 512, render=render, modes=modes, evaluated=chat_mode("off", {}))
    tokenizer = load_tokenizer(target)
    texts = [
        tokenizer.apply_chat_template([user], add_generation_prompt=True, enable_thinking=False, tokenize=False, **kw)
        for kw in ({"reasoning_effort": "low"}, {})
    ]
    assert prompts == [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert modes.names == ('thinking off, reasoning_effort="low"', "thinking off") and modes.of == [0, 1]


def test_eval_warns_when_the_mode_is_none_of_a_mixed_caches(caplog):
    on, off = chat_mode("on", {}), chat_mode("off", {})
    assert mode_mismatch(off, [on, off], "cache C") is None
    high = chat_mode("on", {"reasoning_effort": "high"})
    with caplog.at_level(logging.WARNING):
        warning = mode_mismatch(high, [on, off], "cache C")
    assert warning is not None and "rendered in one of thinking on | thinking off" in warning
