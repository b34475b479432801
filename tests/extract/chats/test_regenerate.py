"""dflash-data regenerate over real HTTP against tools/fixtures/tiny_server.py: replies, resume, retries, failures.
Answers the tiny server never gives (a canned server): test_regenerate_answers.py."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from extract.chats.cli import main as data_cli
from extract.cli import main as extract_cli
from extract.target.model import TargetModel
from tests.helpers.chats import MAX_TOKENS, chat_target, read_rows, regenerate_args, running, write_conversations
from tests.helpers.extract import all_tensors, cli_args
from tests.helpers.train import tiny_cli_args
from tools.fixtures.tiny_server import Faults, TinyChatModel, make_server
from train.cli import main as train_cli

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return chat_target(tmp_path_factory, mixer_scale=0.1)


@pytest.fixture(scope="module")
def chat_model(target) -> TinyChatModel:
    return TinyChatModel(target, max_batch=8)


@contextmanager
def serving(chat_model: TinyChatModel, faults: Faults | None = None):
    with running(make_server(chat_model, 0, faults)) as url:
        yield url


def _regenerate(url: str, data: Path, out: Path, *extra: str, **options: str):
    return CliRunner().invoke(data_cli, regenerate_args(url, data, out, *extra, **options), catch_exceptions=False)


def _greedy_ids(model: TargetModel, tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(prompt ids, the target's greedy reply ids), one sequence at a time, straight from the model."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out = []
    for _ in range(MAX_TOKENS):
        seq = torch.tensor(ids + out)
        cu = torch.tensor([0, len(seq)], dtype=torch.int32)
        _, top, _ = model.topk_next_tokens(seq, torch.arange(len(seq)), cu, [0], k=1)
        out.append(int(top[-1, 0]))
        if out[-1] == tokenizer.eos_token_id:
            break
    return ids, out


def _greedy_reference(target: Path, model: TargetModel, tokenizer, messages: list[dict]) -> str:
    """The target's greedy reply as text, as a server decodes it."""
    return tokenizer.decode(_greedy_ids(model, tokenizer, messages)[1], skip_special_tokens=True)


def test_regenerate_turn_by_turn_equals_greedy_reference(target, chat_model, tmp_path):
    data = write_conversations(tmp_path / "chats.jsonl", 6)
    out = tmp_path / "regen.jsonl"
    with serving(chat_model) as url:
        result = _regenerate(url, data, out, "--concurrency", "3")
    assert result.exit_code == 0, result.output
    assert "6 conversations regenerated (9 replies" in result.output and "0 failed" in result.output
    rows = read_rows(out)
    assert [r["id"] for r in rows] == [f"c{i}" for i in range(6)]  # input order, whatever the completion order
    model = TargetModel.from_pretrained(target, "cpu", dtype=torch.float32, with_head=True)
    tokenizer = chat_model.tokenizer
    for i, row in enumerate(rows):
        assert row["source"] == "test"  # other fields are carried through
        messages = row["messages"]
        assert [m["role"] for m in messages] == (
            ["user", "assistant", "user", "assistant"] if i % 2 else ["user", "assistant"]
        )
        for k, m in enumerate(messages):
            if m["role"] == "assistant":  # the reply to the conversation so far, earlier replies included
                assert m["content"] == _greedy_reference(target, model, tokenizer, messages[:k])
                assert m["content"] != "old answer" and "reasoning_content" not in m
    meta = json.loads(Path(f"{out}.regenerate.json").read_text())
    assert meta == {
        "model": "tiny",
        "temperature": 0.0,
        "max_tokens": MAX_TOKENS,
        "thinking": "off",
        "seed": None,
        "template_kwargs": {},
    }


def test_thinking_on_keeps_reasoning(chat_model, tmp_path):
    data = write_conversations(tmp_path / "chats.jsonl", 1, multi_turn=False)
    out = tmp_path / "regen.jsonl"
    with serving(chat_model) as url:
        result = _regenerate(url, data, out, thinking="on")
    assert result.exit_code == 0, result.output
    reply = read_rows(out)[0]["messages"][-1]
    # The random target never closes </think> within 5 tokens: everything it wrote is reasoning.
    assert reply["reasoning_content"] and reply["content"] == ""


def test_kill_in_the_middle_then_resume_loses_and_duplicates_nothing(chat_model, tmp_path):
    data = write_conversations(tmp_path / "chats.jsonl", 8, multi_turn=False)
    clean = tmp_path / "clean.jsonl"
    out = tmp_path / "regen.jsonl"
    with serving(chat_model) as url:
        assert _regenerate(url, data, clean, "--concurrency", "2").exit_code == 0
    # The server answers 3 requests, then hangs: with one conversation in flight exactly 3 are written.
    with serving(chat_model, Faults(hang_after=3)) as url:
        cmd = [sys.executable, "-m", "extract.chats.cli", *regenerate_args(url, data, out, "--concurrency", "1")]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while not (out.exists() and out.read_text().count("\n") == 3):
                assert proc.poll() is None and time.monotonic() < deadline, (
                    proc.stdout.read().decode() if proc.poll() is not None else "timeout"
                )
                time.sleep(0.1)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert [r["id"] for r in read_rows(out)] == ["c0", "c1", "c2"]
    with open(out, "a") as f:  # a write torn by the kill
        f.write('{"id": "c3", "messages": [{"role": "us')
    with serving(chat_model) as url:
        result = _regenerate(url, data, out, "--concurrency", "3")
    assert result.exit_code == 0, result.output
    assert "5 conversations regenerated" in result.output and "3 kept from an earlier run" in result.output
    ids = [r["id"] for r in read_rows(out)]
    assert sorted(ids) == sorted(f"c{i}" for i in range(8)) and len(ids) == len(set(ids))
    assert sorted(read_rows(out), key=lambda r: r["id"]) == sorted(read_rows(clean), key=lambda r: r["id"])
    # A third run has nothing left to do.
    with serving(chat_model) as url:
        result = _regenerate(url, data, out)
    assert result.exit_code == 0 and "0 conversations regenerated" in result.output and "8 kept" in result.output


def test_a_conversation_edited_in_the_data_is_regenerated_on_resume(chat_model, tmp_path):
    data = write_conversations(tmp_path / "chats.jsonl", 3, multi_turn=False)
    out = tmp_path / "regen.jsonl"
    with serving(chat_model) as url:
        assert _regenerate(url, data, out).exit_code == 0
        first = {r["id"]: r for r in read_rows(out)}
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        rows[1]["messages"][0]["content"] = "A new question about the sea?"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        result = _regenerate(url, data, out)
    assert result.exit_code == 0 and "1 conversations regenerated" in result.output, result.output
    assert "2 kept from an earlier run" in result.output
    again = {r["id"]: r for r in read_rows(out)}
    assert again["c1"]["messages"][0]["content"] == "A new question about the sea?"
    assert again["c0"] == first["c0"] and again["c2"] == first["c2"]
    assert again["c1"]["regenerated_from_sha256"] != first["c1"]["regenerated_from_sha256"]


def test_prepare_reads_a_regenerate_folder_without_its_sidecar_and_renders_each_row_in_its_own_mode(
    target, chat_model, tmp_path
):
    data = write_conversations(tmp_path / "chats.jsonl", 2, multi_turn=False)
    out = tmp_path / "regen" / "out.jsonl"
    with serving(chat_model) as url:
        assert _regenerate(url, data, out, thinking="off").exit_code == 0
    tokens = tmp_path / "tokens.parquet"
    args = ["prepare", "--target", str(target), "--data", str(out.parent), "--out", str(tokens), "--thinking", "on"]
    result = CliRunner().invoke(data_cli, args)
    assert result.exit_code == 0, result.output  # the folder's out.jsonl.regenerate.json is no data
    assert pq.read_table(tokens).num_rows == 2
    # Each regenerated row states the mode its reply was made in (chat_template_kwargs), which wins over --thinking.
    modes = pq.read_table(tokens).column("chat_mode").to_pylist()
    assert [json.loads(m)["thinking"] for m in modes] == ["off", "off"]


def test_retries_after_5xx_and_timeouts(chat_model, tmp_path):
    data = write_conversations(tmp_path / "chats.jsonl", 2, multi_turn=False)
    with serving(chat_model, Faults(fail_requests=frozenset({1, 2}))) as url:
        result = _regenerate(url, data, tmp_path / "a.jsonl", "--concurrency", "1")
    assert result.exit_code == 0 and "2 retries" in result.output and "0 failed" in result.output, result.output
    assert len(read_rows(tmp_path / "a.jsonl")) == 2
    # Request 1 takes longer than the timeout: retried. (A loaded machine may time out more: at least 1.)
    with serving(chat_model, Faults(delay_s={1: 20.0})) as url:
        result = _regenerate(url, data, tmp_path / "b.jsonl", "--concurrency", "1", "--request-timeout", "4")
    assert result.exit_code == 0 and "0 retries" not in result.output and "0 failed" in result.output, result.output
    assert len(read_rows(tmp_path / "b.jsonl")) == 2


def test_failures_are_listed_never_dropped_and_retried_by_a_rerun(chat_model, tmp_path):
    data = write_conversations(tmp_path / "chats.jsonl", 3, multi_turn=False)
    out = tmp_path / "regen.jsonl"
    with serving(chat_model, Faults(fail_requests=frozenset({2, 3}))) as url:  # c1 fails twice: out of retries
        result = _regenerate(url, data, out, "--concurrency", "1", "--max-retries", "1")
    assert result.exit_code == 1
    assert f"failed 'c1' ({data}, row 1 (line 2)): InternalServerError after 2 attempts" in result.output, result.output
    assert "1 conversations failed and are not in" in result.output and "re-run the same command" in result.output
    assert [r["id"] for r in read_rows(out)] == ["c0", "c2"]
    with serving(chat_model) as url:
        result = _regenerate(url, data, out)
    assert result.exit_code == 0 and "1 conversations regenerated" in result.output
    assert sorted(r["id"] for r in read_rows(out)) == ["c0", "c1", "c2"]


def test_refusals_name_the_problem(chat_model, tmp_path):
    data = write_conversations(tmp_path / "chats.jsonl", 1, multi_turn=False)
    out = tmp_path / "regen.jsonl"
    with serving(chat_model) as url:
        assert _regenerate(url, data, out).exit_code == 0
        other = _regenerate(url, data, out, "--temperature", "0.5")
        assert other.exit_code == 1 and "temperature: 0.0" in other.output and "0.5 now" in other.output
        wrong = _regenerate(url, data, tmp_path / "w.jsonl", model="nope")
        assert wrong.exit_code == 1 and "--model 'nope' is not served" in wrong.output and "tiny" in wrong.output
        assert not list(tmp_path.glob("w.jsonl*")), "a refused first run leaves nothing that blocks the fix"
        assert _regenerate(url, data, tmp_path / "w.jsonl").exit_code == 0
        for value in ("nan", "inf"):
            odd = _regenerate(url, data, tmp_path / "t.jsonl", "--temperature", value)
            assert odd.exit_code != 0 and "--temperature" in odd.output and "finite" in odd.output, odd.output
        inside = _regenerate(url, tmp_path, tmp_path / "inside.jsonl")
        assert inside.exit_code == 1 and "would be read by it" in inside.output, inside.output
        empty = tmp_path / "empty" / "chats.jsonl"
        empty.parent.mkdir()
        empty.write_text("")
        none = _regenerate(url, empty, tmp_path / "e.jsonl")
        assert none.exit_code == 1 and "holds no conversations" in none.output, none.output
        foreign = tmp_path / "foreign.jsonl"
        foreign.write_text("mine\n")
        refused = _regenerate(url, data, foreign)
        assert refused.exit_code == 1 and "was not written by dflash-data regenerate" in refused.output
        assert foreign.read_text() == "mine\n"
        sidecar = tmp_path / "new.jsonl.regenerate.json"  # a user's file under the sidecar's name, no OUT yet
        sidecar.write_text("my notes")
        refused = _regenerate(url, data, tmp_path / "new.jsonl")
        assert refused.exit_code == 1 and "is not a record of dflash-data regenerate" in refused.output
        assert sidecar.read_text() == "my notes" and not (tmp_path / "new.jsonl").exists()
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
        refused = _regenerate(url, bad, tmp_path / "o.jsonl")
        assert (
            refused.exit_code == 1 and f"{bad}, row 0 (line 1): messages[0] has unknown role 'robot'" in refused.output
        )
    down = _regenerate(url, data, tmp_path / "down.jsonl")  # the server is gone now
    assert down.exit_code == 1 and "no OpenAI-compatible server answers at" in down.output
    assert "Traceback" not in down.output


def test_server_batches_concurrent_requests_like_single_ones(chat_model, target):
    """The tiny server's packed steps give each sequence the tokens it gets alone (the reference
    the regenerate tests rely on), at several batch sizes."""
    from tools.fixtures.tiny_server import _Job

    tok = chat_model.tokenizer
    prompts = [
        tok(f"<|im_start|>user\nq{i}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        for i in range(5)
    ]
    alone = []
    for p in prompts:
        job = chat_model.submit(_Job(p, 4, 0.0, None))
        job.done.wait()
        alone.append(job.out)
    jobs = [chat_model.submit(_Job(p, 4, 0.0, None)) for p in prompts]
    for job in jobs:
        job.done.wait()
    assert [job.out for job in jobs] == alone
    assert all(0 <= t < 512 for seq in alone for t in seq) and np.unique(np.concatenate(alone)).size > 1


def test_greedy_ids_survive_the_server_text_and_prepare(target, chat_model, tmp_path):
    """The tiny target's greedy ids -> the server's text -> dflash-data prepare -> the same ids, so the
    data are the target's own greedy output: extracted with its top-1, data == target greedy on 100% of
    supervised positions (what `eval` prints as whose tokens). A reply cut at max_tokens is closed by the
    template with an end token the model never wrote: in the data, not supervised."""
    data = write_conversations(tmp_path / "chats.jsonl", 8, multi_turn=False)
    regenerated, prepared = tmp_path / "regen.jsonl", tmp_path / "data.parquet"
    with serving(chat_model) as url:
        assert _regenerate(url, data, regenerated).exit_code == 0
    args = ["prepare", "--target", str(target), "--data", str(regenerated), "--out", str(prepared), "--thinking", "off"]
    result = CliRunner().invoke(data_cli, args)
    assert result.exit_code == 0, result.output
    model = TargetModel.from_pretrained(target, "cpu", dtype=torch.float32, with_head=True)
    tokenizer = chat_model.tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = pq.read_table(prepared).to_pylist()
    cut = 0
    for row, chat in zip(rows, read_rows(data)):
        prompt, reply = _greedy_ids(model, tokenizer, chat["messages"])
        closed = reply[-1] == end
        cut += not closed
        assert row["input_ids"] == prompt + reply + ([] if closed else [end]), row["id"]
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(reply) + ([] if closed else [0]), row["id"]
    assert cut > 0, "the test needs replies cut at max_tokens"

    cache, run = tmp_path / "cache", tmp_path / "run"
    extract = CliRunner().invoke(
        extract_cli, cli_args(target, prepared, cache, "--target-topk", "1", token_budget=64, max_seqs=4)
    )
    assert extract.exit_code == 0, extract.output
    train = CliRunner().invoke(train_cli, tiny_cli_args(cache, run, "--max-steps", "1", "--eval-shards", "1"))
    assert train.exit_code == 0, train.output
    assert json.loads((run / "eval.json").read_text())["data_is_target_greedy"] == 1.0


def test_extract_takes_conversations_as_prepare_then_extract(target, tmp_path):
    """dflash-extract --data CHATS --thinking off == dflash-data prepare --thinking off, then dflash-extract:
    the same tensors and dataset fingerprint; cache.json records the on-the-fly preparation; a re-run
    resumes, one with thinking on is another dataset; --thinking with token rows is refused naming the flag."""
    chats = tmp_path / "chats.jsonl"
    rows = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"What is the weather {i}?"}, reply]}
        for i, reply in enumerate(
            [{"role": "assistant", "content": "Sunny and warm today.", "reasoning_content": "Look outside."}] * 3
            + [{"role": "assistant", "content": "I do not know.", "finish_reason": "length"}] * 3
        )
    ]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepared = tmp_path / "data.parquet"
    args = ["prepare", "--target", str(target), "--data", str(chats), "--out", str(prepared), "--thinking", "off"]
    assert CliRunner().invoke(data_cli, args).exit_code == 0
    two_step, direct = tmp_path / "two-step", tmp_path / "direct"
    for data, out, extra in ((prepared, two_step, ()), (chats, direct, ("--thinking", "off"))):
        result = CliRunner().invoke(extract_cli, cli_args(target, data, out, *extra, token_budget=64, max_seqs=4))
        assert result.exit_code == 0, result.output
    want, got = all_tensors(two_step), all_tensors(direct)
    assert sorted(want) == sorted(got) and len(want) > 1
    for b in want:
        assert sorted(want[b]) == sorted(got[b])
        for name in want[b]:
            assert torch.equal(want[b][name], got[b][name]), (b, name)
    record = json.loads((direct / "cache.json").read_text())["dataset"]
    assert record["fingerprint"] == json.loads((two_step / "cache.json").read_text())["dataset"]["fingerprint"]
    assert json.loads((two_step / "cache.json").read_text())["dataset"]["prepared"] is None
    template = (target / "chat_template.jinja").read_text()
    assert record["prepared"]["from"] == "conversations" and record["prepared"]["thinking"] == "off"
    assert record["prepared"]["chat_template_sha256"] == hashlib.sha256(template.encode()).hexdigest()
    assert record["prepared"]["num_reasoning_removed"] == 3
    # A re-run of the same command resumes: the conversations render to the same tokens again.
    result = CliRunner().invoke(
        extract_cli, cli_args(target, chats, direct, "--thinking", "off", token_budget=64, max_seqs=4)
    )
    assert result.exit_code == 0 and "nothing to extract" in result.output, result.output
    # Thinking on renders other tokens: that is another dataset, refused for this cache.
    result = CliRunner().invoke(
        extract_cli, cli_args(target, chats, direct, "--thinking", "on", token_budget=64, max_seqs=4)
    )
    assert result.exit_code != 0 and "fingerprint" in result.output, result.output
    result = CliRunner().invoke(
        extract_cli, cli_args(target, prepared, tmp_path / "c3", "--thinking", "on", token_budget=64, max_seqs=4)
    )
    assert result.exit_code != 0 and f"--thinking on: --data {prepared} holds token rows" in result.output
    assert "Traceback" not in result.output


def test_progress_in_a_log_file_is_plain_lines(chat_model, tmp_path, caplog):
    """Redirected output (not a terminal) gets plain progress lines with rates and ETA, never a bar's carriage
    returns; the last line counts every conversation."""
    data = write_conversations(tmp_path / "chats.jsonl", 4, multi_turn=False)
    out = tmp_path / "regen.jsonl"
    args = [a for a in regenerate_args("URL", data, out) if a != "--no-progress"]
    with serving(chat_model) as url, caplog.at_level("INFO", logger="extract.chats.regenerate"):
        result = CliRunner().invoke(data_cli, [url if a == "URL" else a for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "\r" not in result.output
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("regenerate: ")]
    assert lines and lines[-1].startswith("regenerate: 4/4 conversations | "), lines
    assert " conv/s | " in lines[-1] and " gen tok/s | 0 failed | ETA 0m00s" in lines[-1]


def test_no_eta_before_one_conversation_per_concurrent_request_has_finished(chat_model, tmp_path, caplog):
    """Requests run --concurrency at a time and finish in waves: the first finisher's rate (one conversation
    in a whole wave's time) would put the end --concurrency times too far, so no ETA is said before then."""
    data = write_conversations(tmp_path / "chats.jsonl", 6, multi_turn=False)
    out = tmp_path / "regen.jsonl"
    args = [a for a in regenerate_args("URL", data, out, "--concurrency", "3") if a != "--no-progress"]
    with serving(chat_model) as url, caplog.at_level("INFO", logger="extract.chats.regenerate"):
        result = CliRunner().invoke(data_cli, [url if a == "URL" else a for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("regenerate: ")]
    first = next(line for line in lines if line.startswith("regenerate: 1/6 conversations"))  # the first report
    assert first.endswith("| ETA ?"), first
    assert lines[-1].startswith("regenerate: 6/6 conversations") and lines[-1].endswith("| ETA 0m00s"), lines
