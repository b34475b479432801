"""The OpenAI chat-completions wire format as dflash-data regenerate speaks it: our normalised messages
sent as requests, and the server's answers checked before anything of them is kept.

An answer that is no chat completion (an HTML page, no choices, cut JSON, a field of the wrong type), a
reply that holds a lone UTF-16 surrogate, or tool-call arguments that are not a JSON object raise
`Retryable`: that conversation fails with the reason and is left out of OUT (the next run retries it),
never the whole run. Usage that is no count of tokens is reported as unknown, never summed.
"""

from __future__ import annotations

import json
from typing import Any

from extract.chats.conversations import FINISH_REASON, first_unencodable
from shards.common.json_input import InputFileError, parse_json


class Retryable(Exception):
    """This conversation failed (out of retries, or an answer that is no chat completion): it is
    listed and left out of OUT, so the next run retries it."""


def wire_message(m: dict[str, Any]) -> dict[str, Any]:
    """A normalised message in OpenAI wire form (tool-call arguments as a JSON string; our
    finish_reason mark stays out of the request)."""
    m = {k: v for k, v in m.items() if k != FINISH_REASON}
    if not m.get("tool_calls"):
        return m
    calls = [
        {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
        for c in m["tool_calls"]
    ]
    return {**m, "tool_calls": [{"id": f"call_{i}", **c} for i, c in enumerate(calls)]}


def excerpt(body: bytes) -> str:
    """The start of an answer's body, for messages."""
    if not body:
        return "an empty body"
    return repr(body[:120].decode("utf-8", errors="replace")) + ("..." if len(body) > 120 else "")


def _malformed(what: str, body: bytes) -> Retryable:
    """An HTTP 200 answer that is no chat completion: a failure of its conversation, never a crash."""
    return Retryable(f"the server answered HTTP 200 with no chat completion: {what} (body: {excerpt(body)})")


def _json_body(body: bytes) -> Any:
    """The JSON of an answer's body; None when it is not JSON (an HTML page, empty, cut off)."""
    try:
        return parse_json(body, "the server's answer")
    except InputFileError:
        return None


def completion(body: bytes) -> tuple[dict[str, Any], Any]:
    """(choices[0], usage) of a chat completion's body; anything else fails the conversation."""
    data = _json_body(body)
    if not isinstance(data, dict):
        raise _malformed("not JSON" if data is None else f"a JSON {type(data).__name__}, not an object", body)
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise _malformed(f"choices is {json.dumps(choices)[:40]}", body)
    if not isinstance(choices[0], dict) or not isinstance(choices[0].get("message"), dict):
        raise _malformed("choices[0] has no message object", body)
    return choices[0], data.get("usage")


def completion_tokens(usage: Any) -> int | None:
    """usage.completion_tokens when it is a count of tokens; None (unknown) when missing, negative or
    not an integer: summed, such a figure would misstate the throughput."""
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0 else None


def _optional_text(message: dict[str, Any], key: str, body: bytes) -> str:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise _malformed(f"message.{key} is a {type(value).__name__}, not a string", body)
    return value or ""


def _reply_tool_call(call: Any, index: int, body: bytes) -> dict[str, Any]:
    """One tool call of the server's reply, its arguments parsed: they must be a JSON object, as the
    chat template renders them parameter by parameter."""
    fn = call.get("function") if isinstance(call, dict) else None
    if (
        not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
        or not isinstance(fn.get("arguments") or "", str)
    ):
        raise _malformed(f"tool_calls[{index}] is not a function call with a name and string arguments", body)
    raw = fn.get("arguments") or "{}"  # no arguments: a call without parameters
    try:
        args = parse_json(raw, "the server's tool-call arguments")
    except InputFileError:
        args = None
    if not isinstance(args, dict):  # rewritten, the drafter would learn parameters the model never wrote
        raise Retryable(
            f"the server returned tool-call arguments that are not a JSON object "
            f"(tool_calls[{index}] {fn['name']!r}: {raw[:80]!r})"
        )
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


def reply_message(message: dict[str, Any], body: bytes) -> dict[str, Any]:
    """The server's reply (choices[0].message of `body`) as a normalised assistant message."""
    reasoning = _optional_text(message, "reasoning_content", body) or _optional_text(message, "reasoning", body)
    out: dict[str, Any] = {"role": "assistant", "content": _optional_text(message, "content", body)}
    if reasoning:
        out["reasoning_content"] = reasoning
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise _malformed(f"message.tool_calls is a {type(calls).__name__}, not a list", body)
    if calls:
        out["tool_calls"] = [_reply_tool_call(call, i, body) for i, call in enumerate(calls)]
    bad = first_unencodable(out, "reply")
    if bad is not None:  # it could not be written to OUT
        raise _malformed(f"the reply holds a lone UTF-16 surrogate, which is not text, at {bad}", body)
    return out


def model_ids(body: bytes) -> list[str] | None:
    """The model ids of a /models answer; None when it is no model list."""
    data = _json_body(body)
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in models):
        return None
    return [m["id"] for m in models]
