"""dflash-data regenerate against a canned HTTP server, for answers the tiny server never gives: an HTTP 200
that is no chat completion fails its conversation only, a /models answer that is no model list is one clear
error, missing or invalid usage never becomes token figures, tool-call arguments that are not a JSON object
fail the conversation, a lone surrogate in an input row is refused naming file and row, and the API key
(from OPENAI_API_KEY or --api-key) reaches the server but never the output, the logs or the files, even when
the server echoes it back."""

from __future__ import annotations

import json
import logging
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from extract.chats.cli import main as data_cli
from tests.helpers.chats import read_rows, regenerate_args, running, write_conversations


def _completion(content: str = "hello", *, usage: object = 2, **message: object) -> bytes:
    """A chat completion's body; usage: completion_tokens, or None for no usage block."""
    body: dict = {"id": "x", "object": "chat.completion", "created": 0, "model": "tiny"}
    body["choices"] = [
        {"index": 0, "message": {"role": "assistant", "content": content, **message}, "finish_reason": "stop"}
    ]
    if usage is not None:
        body["usage"] = {"prompt_tokens": 3, "completion_tokens": usage, "total_tokens": 5}
    return json.dumps(body).encode()


def _no_crash(result) -> None:
    """The command ended through click (its exit or a clean `Error:` line), not an uncaught exception."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)


_MODELS = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode()


@contextmanager
def canned(
    answers: dict[int, bytes],
    default: bytes = _completion(),
    models: bytes = _MODELS,
    status: tuple[int, int] = (200, 200),
    keys: list[str] | None = None,
):
    """A server answering with canned bodies: request n (from 1) gets answers[n], others `default`; GET
    /models gets `models`. For answers the tiny server never gives (HTML pages, empty bodies...). `status`:
    the HTTP status of /models and of the replies; `keys` collects the Authorization header of every request."""
    count = {"n": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):
            pass

        def _send(self, body: bytes, code: int) -> None:
            if keys is not None:
                keys.append(self.headers.get("Authorization", ""))
            self.send_response(code)
            self.send_header("Content-Type", "text/html" if body.startswith(b"<") else "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(models, status[0])

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with lock:
                count["n"] += 1
                n = count["n"]
            self._send(answers.get(n, default), status[1])

    with running(ThreadingHTTPServer(("127.0.0.1", 0), Handler)) as url:
        yield url


@pytest.mark.parametrize(
    "body, reason",
    [
        (json.dumps({"choices": []}).encode(), "choices is []"),
        (json.dumps({"choices": None}).encode(), "choices is null"),
        (json.dumps({"choices": [{"index": 0}]}).encode(), "choices[0] has no message object"),
        (b"<html>gateway</html>", "not JSON (body: '<html>gateway</html>')"),
        (b"", "not JSON (body: an empty body)"),
        (b'{"choices": [', "not JSON"),
        (b"[1, 2]", "a JSON list, not an object"),
        (_completion(None), ""),  # content null: an empty reply, fine
        (_completion(7), "message.content is a int, not a string"),
        (_completion("x", tool_calls={"a": 1}), "message.tool_calls is a dict, not a list"),
        (_completion("cut \ud83d emoji"), "lone UTF-16 surrogate"),
    ],
)
def test_an_answer_that_is_no_chat_completion_fails_its_conversation_only(tmp_path, body, reason):
    """One malformed HTTP 200 answer among many: that conversation is listed with the reason and left
    out, the others are written, no traceback; a re-run does the one left."""
    data = write_conversations(tmp_path / "chats.jsonl", 6, multi_turn=False)
    out = tmp_path / "regen.jsonl"
    with canned({3: body}) as url:
        result = CliRunner().invoke(data_cli, regenerate_args(url, data, out, "--concurrency", "1"))
    _no_crash(result)
    if not reason:
        assert result.exit_code == 0, result.output
        assert read_rows(out)[2]["messages"][-1]["content"] == ""
        return
    assert result.exit_code == 1, result.output
    assert (
        f"failed 'c2' ({data}, row 2 (line 3)): the server answered HTTP 200 with no chat completion: " in result.output
    )
    assert reason in result.output, result.output
    assert "5 conversations regenerated" in result.output and "1 failed" in result.output
    assert [r["id"] for r in read_rows(out)] == ["c0", "c1", "c3", "c4", "c5"]
    with canned({}) as url:
        result = CliRunner().invoke(data_cli, regenerate_args(url, data, out))
    assert result.exit_code == 0 and "1 conversations regenerated" in result.output, result.output
    assert sorted(r["id"] for r in read_rows(out)) == [f"c{i}" for i in range(6)]


@pytest.mark.parametrize(
    "models, said",
    [
        (b"<html>login</html>", "('<html>login</html>')"),
        (b"", "(an empty body)"),
        (json.dumps({"object": "list", "data": None}).encode(), '"data": null'),
        (json.dumps({"data": [{"name": "tiny"}]}).encode(), '"name": "tiny"'),
    ],
)
def test_a_models_answer_that_is_no_model_list_is_one_clear_error(tmp_path, models, said):
    data = write_conversations(tmp_path / "chats.jsonl", 1, multi_turn=False)
    with canned({}, models=models) as url:
        result = CliRunner().invoke(data_cli, regenerate_args(url, data, tmp_path / "regen.jsonl"))
    _no_crash(result)
    assert result.exit_code == 1
    assert f"Error: {url}/models answered HTTP 200 with no model list " in result.output, result.output
    assert said in result.output, result.output
    assert not list(tmp_path.glob("regen.jsonl*")), "a refused first run leaves nothing behind"


def test_the_summary_never_states_token_figures_the_server_did_not_report(tmp_path, caplog):
    data = write_conversations(tmp_path / "chats.jsonl", 2, multi_turn=False)
    for name, answers, default in (
        ("none", {}, _completion(usage=None)),
        ("negative", {}, _completion(usage=-5)),
        ("no-count", {}, _completion(usage="7")),
    ):
        with canned(answers, default) as url, caplog.at_level("WARNING"):
            result = CliRunner().invoke(data_cli, regenerate_args(url, data, tmp_path / f"{name}.jsonl"))
        assert result.exit_code == 0, result.output
        assert "(2 replies, tokens unknown: the server reported no valid usage, 0 cut" in result.output, result.output
        assert "-10 tokens" not in result.output and "0 gen tok/s" not in result.output
    assert "completion_tokens is not a count" in caplog.text  # the negative and the string said in the log
    # Only some replies with usage: the count says what it leaves out.
    with canned({1: _completion(usage=None)}, _completion(usage=4)) as url:
        result = CliRunner().invoke(data_cli, regenerate_args(url, data, tmp_path / "some.jsonl", "--concurrency", "1"))
    assert result.exit_code == 0, result.output
    assert (
        "(2 replies, 4 tokens, " in result.output
        and "(counted over 1 replies; 1 came without valid usage)" in result.output
    )


def _tool_call_reply(arguments: str) -> bytes:
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return _completion("", tool_calls=[call])


def test_tool_call_arguments_that_are_not_a_json_object_fail_the_conversation(tmp_path):
    """Never rewritten ({"value": ...} or {"arguments": raw}): prepare would supervise parameters the model
    never wrote."""
    data = write_conversations(tmp_path / "chats.jsonl", 1, multi_turn=False)
    for i, arguments in enumerate(("[1,2]", "not json {", '"a string"')):
        out = tmp_path / f"bad{i}.jsonl"
        with canned({}, _tool_call_reply(arguments)) as url:
            result = CliRunner().invoke(data_cli, regenerate_args(url, data, out))
        _no_crash(result)
        assert result.exit_code == 1, result.output
        assert "the server returned tool-call arguments that are not a JSON object" in result.output, result.output
        assert repr(arguments) in result.output and out.read_text() == ""
    out = tmp_path / "good.jsonl"
    with canned({}, _tool_call_reply('{"city": "Paris"}')) as url:
        result = CliRunner().invoke(data_cli, regenerate_args(url, data, out))
    assert result.exit_code == 0, result.output
    calls = read_rows(out)[0]["messages"][-1]["tool_calls"]
    assert calls == [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]


def test_a_lone_surrogate_in_a_row_is_refused_naming_the_file_and_row(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text(
        '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n'
        '{"id": "b", "messages": [{"role": "user", "content": "bad \\ud83d here"}]}\n'
    )
    with canned({}) as url:
        result = CliRunner().invoke(data_cli, regenerate_args(url, data, tmp_path / "regen.jsonl"))
    _no_crash(result)
    assert result.exit_code == 1, result.output
    assert f"Error: {data}, row 1 (line 2): " in result.output and "surrogate" in result.output, result.output
    assert "codec can't encode" not in result.output


_KEY = "sk-test-0a1b2c3d4e5f6a7b8c9d"


def _refusing_the_key(key: str) -> bytes:
    """An HTTP 401 body as some gateways write it: the rejected key in full."""
    return json.dumps({"error": {"message": f"Incorrect API key provided: {key}", "code": "invalid_api_key"}}).encode()


@pytest.mark.parametrize("given", ["OPENAI_API_KEY", "--api-key"])
def test_the_api_key_reaches_the_server_and_nothing_else(tmp_path, monkeypatch, caplog, given):
    data = write_conversations(tmp_path / "chats.jsonl", 2, multi_turn=False)
    out = tmp_path / "regen.jsonl"
    if given == "OPENAI_API_KEY":
        monkeypatch.setenv("OPENAI_API_KEY", _KEY)
        extra: tuple[str, ...] = ()
    else:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        extra = ("--api-key", _KEY)
    caplog.set_level(logging.DEBUG)
    keys: list[str] = []
    with canned({}, keys=keys) as url:
        result = CliRunner().invoke(data_cli, regenerate_args(url, data, out, *extra))
    assert result.exit_code == 0, result.output
    assert keys and set(keys) == {f"Bearer {_KEY}"}, f"the server got {set(keys)}"
    # A server that refuses the key and echoes it, at the first request (/models) and at a reply.
    refusal = _refusing_the_key(_KEY)
    for models, default, status in ((refusal, _completion(), (401, 200)), (_MODELS, refusal, (200, 401))):
        with canned({}, default, models=models, status=status) as url:
            refused = CliRunner().invoke(data_cli, regenerate_args(url, data, tmp_path / "refused.jsonl", *extra))
        _no_crash(refused)
        assert refused.exit_code == 1, refused.output
        assert "HTTP 401: Error code: 401 - Incorrect API key provided: <api key>" in refused.output, refused.output
        assert _KEY not in refused.output, refused.output
    written = "".join(p.read_text() for p in tmp_path.iterdir() if p.is_file())
    for where, text in (("output", result.output), ("log", caplog.text), ("files", written)):
        assert _KEY not in text, f"the API key is in the {where}"


def test_the_key_is_not_in_the_config_repr():
    from extract.chats.regenerate import RegenerateConfig

    cfg = RegenerateConfig(server="http://x:1/v1", model="m", data="d.jsonl", out="o.jsonl", api_key=_KEY)
    assert cfg.api_key == _KEY and _KEY not in repr(cfg) and "api_key" not in repr(cfg)


def test_the_help_names_the_variable_and_never_shows_its_value(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", _KEY)
    shown = CliRunner().invoke(data_cli, ["regenerate", "--help"], terminal_width=200).output
    assert "env var: OPENAI_API_KEY" in shown and "Prefer setting OPENAI_API_KEY" in shown, shown
    assert _KEY not in shown
