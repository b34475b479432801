"""Chat datasets: find, read and normalise conversations (OpenAI messages or ShareGPT).

Input: JSON Lines (one conversation per line), JSON (a list of conversations) or Parquet (one per
row); a file, a directory (searched recursively) or a glob; files in sorted order, rows counted
from 0 within their file. A row is one of
    {"id": ..., "messages": [{"role", "content", "reasoning_content"?, "tool_calls"?}, ...], "tools"?}
    {"id": ..., "conversations": [{"from": "human"|"gpt"|"system"|..., "value": "..."}, ...], "tools"?}
`id` is optional and must be unique. When absent it is derived, "<file>:<row>": <file> is the file's
stem ("chats:17"), or, where two of the dataset's files share a stem (a/chats.jsonl, b/chats.jsonl),
the file's path relative to the folder common to all of them ("a/chats.jsonl:17").

Every conversation becomes a `Conversation` of OpenAI-style messages: role in system / user /
assistant / tool, content a string, reasoning in `reasoning_content`, `finish_reason: "length"` on
an assistant reply cut at max_tokens (regenerate writes it), tool calls as
{"type": "function", "function": {"name", "arguments": {...}}} (JSON-string arguments are parsed:
chat templates render the mapping). Anything else is a DataError naming file, row and reason;
nothing is dropped silently.

Parquet: pyarrow stores a list of objects as one struct type holding every key of every row, so a
row reads back with the other rows' keys set to null (r1's arguments {"tz"} become {"tz", "a": None,
"b": None} when r2 calls add(a, b)). Null struct fields are therefore dropped from Parquet rows: a
genuine null (an argument passed as null, a schema's "default": null) cannot be told apart from a
filled-in one there. Tool-call arguments and tool schemas that must keep nulls, or differ between
rows, are best stored as JSON strings, which are read as written.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extract.dataset.files import derived_id_prefixes, find_data_files
from extract.dataset.rows import MAX_ROW_BYTES, DataError, open_parquet, read_row_group, row_location
from shards.common.json_input import InputFileError, parse_json, read_json
from shards.sample_ids import sample_id_problem

CONVERSATION_SUFFIXES = (".jsonl", ".json", ".parquet")
MAX_JSON_DATASET_BYTES = 8 << 30  # a .json dataset is parsed whole; larger ones belong in JSON Lines
# The records dflash-data writes beside its outputs (regenerate's settings, prepare's summary): never data.
REGENERATE_META_SUFFIX = ".regenerate.json"
PREPARE_SUMMARY_SUFFIX = ".summary.json"
SIDECAR_SUFFIXES = (REGENERATE_META_SUFFIX, PREPARE_SUMMARY_SUFFIX)
ROLES = ("system", "user", "assistant", "tool")
# An assistant message's "finish_reason": "length" (written by dflash-data regenerate) says the reply
# was cut at max_tokens: the model never generated its end-of-turn token, so it is not supervised.
FINISH_REASON = "finish_reason"
# ShareGPT speaker names -> OpenAI roles ("function_call" is an assistant turn holding one tool call).
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
    "function_call": "assistant",
}


@dataclass
class Conversation:
    """One conversation in OpenAI message form, with where it came from."""

    sample_id: str
    messages: list[dict[str, Any]]  # normalised: see the module docstring
    tools: list[dict[str, Any]] | None = None  # tool schemas given to the chat template
    where: str = ""  # "file, row r", for messages
    extra: dict[str, Any] = field(default_factory=dict)  # other row fields, carried through regenerate

    def to_row(self) -> dict[str, Any]:
        row = {"id": self.sample_id, "messages": self.messages}
        if self.tools:
            row["tools"] = self.tools
        return row

    @property
    def num_assistant_turns(self) -> int:
        return sum(m["role"] == "assistant" for m in self.messages)


def _text(value: Any, what: str, where: str) -> str:
    """Message content as one string: a string, None (empty) or a list of text parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if not isinstance(part, dict) or kind not in (None, "text") or not isinstance(part.get("text"), str):
                raise DataError(f"{where}: {what} holds a content part of type {kind!r}; only text is supported")
            parts.append(part["text"])
        return "".join(parts)
    raise DataError(f"{where}: {what} must be a string or a list of text parts, found {type(value).__name__}")


def first_unencodable(value: Any, what: str) -> str | None:
    """Where in `value` a string (or object key) holds a lone UTF-16 surrogate, or None: "\\ud83d" is
    valid JSON but not text, and the tokenizer and every UTF-8 writer refuse it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return what
        return None
    if isinstance(value, list):
        return next(filter(None, (first_unencodable(v, f"{what}[{i}]") for i, v in enumerate(value))), None)
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{what}.{key}" if what else str(key)
            found = first_unencodable(key, f"a key of {what or 'the row'}") or first_unencodable(item, inner)
            if found:
                return found
    return None


def _embedded_json(text: str, where: str, what: str) -> Any:
    """A JSON value stored as a string inside a row (tool-call arguments, tool schemas), bounded as
    every JSON read is."""
    try:
        return parse_json(text, where)
    except InputFileError as e:
        raise DataError(f"{where}: {what} is not valid JSON ({str(e).removeprefix(where + ': ')})") from e


def _without_struct_nulls(value: Any) -> Any:
    """`value` with every null object field dropped, at any depth (see the module docstring: in a
    Parquet struct, a key another row has reads back as null in this one). List items are kept."""
    if isinstance(value, dict):
        return {k: _without_struct_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_struct_nulls(v) for v in value]
    return value


def _tool_call(call: Any, what: str, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise DataError(f"{where}: {what} must be an object, found {type(call).__name__}")
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise DataError(f"{where}: {what} has no function name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        args = _embedded_json(args, where, f"{what}.arguments") if args.strip() else {}
    if not isinstance(args, dict):
        raise DataError(f"{where}: {what}.arguments must be a JSON object, found {type(args).__name__}")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _openai_message(msg: Any, i: int, where: str) -> dict[str, Any]:
    what = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise DataError(f"{where}: {what} must be an object, found {type(msg).__name__}")
    role = msg.get("role")
    if role not in ROLES:
        raise DataError(f"{where}: {what} has unknown role {role!r}; expected one of {ROLES}")
    out: dict[str, Any] = {"role": role, "content": _text(msg.get("content"), f"{what}.content", where)}
    if role == "assistant":
        reasoning = msg.get("reasoning_content", msg.get("reasoning"))
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise DataError(f"{where}: {what}.reasoning_content must be a string, found {type(reasoning).__name__}")
            out["reasoning_content"] = reasoning
        calls = msg.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise DataError(f"{where}: {what}.tool_calls must be a list, found {type(calls).__name__}")
            out["tool_calls"] = [_tool_call(c, f"{what}.tool_calls[{j}]", where) for j, c in enumerate(calls)]
        finish = msg.get(FINISH_REASON)
        if finish is not None:
            if finish not in ("stop", "length"):
                raise DataError(f"{where}: {what}.{FINISH_REASON} must be 'stop' or 'length', found {finish!r}")
            if finish == "length":
                out[FINISH_REASON] = finish
    elif role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(msg.get(key), str):
                out[key] = msg[key]
    return out


def _sharegpt_message(msg: Any, i: int, where: str) -> dict[str, Any]:
    what = f"conversations[{i}]"
    if isinstance(msg, dict) and "from" not in msg and "role" in msg:
        return _openai_message(msg, i, where)  # some ShareGPT dumps already use role/content
    if not isinstance(msg, dict):
        raise DataError(f"{where}: {what} must be an object, found {type(msg).__name__}")
    speaker = msg.get("from")
    if speaker not in SHAREGPT_ROLES:
        raise DataError(
            f"{where}: {what} has unknown speaker 'from': {speaker!r}; expected one of {sorted(SHAREGPT_ROLES)}"
        )
    value = _text(msg.get("value"), f"{what}.value", where)
    if speaker == "function_call":
        call = _embedded_json(value, where, f"{what} (a function_call) value")
        return {"role": "assistant", "content": "", "tool_calls": [_tool_call(call, what, where)]}
    return {"role": SHAREGPT_ROLES[speaker], "content": value}


def conversation_from_row(row: Any, path: str, row_index: int, id_prefix: str | None = None) -> Conversation:
    """Validate and normalise one dataset row; DataError naming file, row and reason. A row without
    an id gets "<id_prefix>:<row_index>" (default prefix: the file's stem)."""
    where = row_location(path, row_index)
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with 'messages' or 'conversations', found {type(row).__name__}")
    bad_text = first_unencodable(row, "")
    if bad_text:
        raise DataError(
            f"{where}: {bad_text} holds a lone UTF-16 surrogate (an escape such as \\ud83d without its pair), "
            "which is not text; fix the string or drop the row"
        )
    if row.get("messages") is not None:
        raw, parse = row["messages"], _openai_message
        key = "messages"
    elif row.get("conversations") is not None:
        raw, parse = row["conversations"], _sharegpt_message
        key = "conversations"
    else:
        raise DataError(f"{where}: no 'messages' (OpenAI) or 'conversations' (ShareGPT) list (keys: {sorted(row)})")
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{where}: {key} must be a non-empty list, found {raw!r:.60}")
    messages = [parse(m, i, where) for i, m in enumerate(raw)]
    system = row.get("system")  # ShareGPT variants carry the system prompt beside the turns
    if isinstance(system, str) and system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    for i, m in enumerate(messages):
        if m["role"] == "system" and i > 0:
            raise DataError(f"{where}: {key}[{i}] is a system message after the first turn")
    tools = row.get("tools")
    if isinstance(tools, str):  # ShareGPT function-calling sets store the schemas as a JSON string
        tools = _embedded_json(tools, where, "tools") if tools.strip() else None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: tools must be a list of objects")
    raw_id = row.get("id")
    if raw_id is not None and (isinstance(raw_id, bool) or not isinstance(raw_id, (str, int))):
        raise DataError(f"{where}: id must be a string or an integer, found {type(raw_id).__name__}")
    prefix = Path(path).stem if id_prefix is None else id_prefix
    sample_id = f"{prefix}:{row_index}" if raw_id is None else str(raw_id)
    problem = sample_id_problem(sample_id)
    if problem is not None:  # the token rows made of it would be refused by dflash-extract's scan
        fix = (
            "fix the row's id"
            if raw_id is not None
            else "give the row an id, or rename the file (its name makes the id)"
        )
        raise DataError(f"{where}: id {problem}; {fix}")
    extra = {k: v for k, v in row.items() if k not in ("id", "messages", "conversations", "tools", "system")}
    return Conversation(sample_id, messages, tools or None, where, extra)


def _file_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(row index, parsed row) of one file; a malformed line comes as a DataError in place of the row,
    an unreadable file raises."""
    if path.endswith(".parquet"):
        pf = open_parquet(path)
        row = 0
        for g in range(pf.num_row_groups):
            for item in read_row_group(pf, g, path, row).to_pylist():
                # Columns stay as they are (every row has every column); nested null fields are struct merging's.
                yield row, {k: _without_struct_nulls(v) for k, v in item.items()}
                row += 1
    elif path.endswith(".json"):
        try:
            items = read_json(path, max_bytes=MAX_JSON_DATASET_BYTES)
        except InputFileError as e:
            raise DataError(f"{e}; a .json file holds a list of conversations") from e
        if not isinstance(items, list):
            raise DataError(f"{path}: a .json file must hold a list of conversations, found {type(items).__name__}")
        yield from enumerate(items)
    else:
        with open(path, "rb") as f:
            for row, line in enumerate(f):
                if not line.strip():
                    yield row, DataError(f"{row_location(path, row)}: empty line; JSON Lines needs one object per line")
                    continue
                where = row_location(path, row)
                try:
                    yield row, parse_json(line, where, max_bytes=MAX_ROW_BYTES)
                except InputFileError as e:
                    yield row, DataError(f"{where}: malformed JSON line ({str(e).removeprefix(where + ': ')})")


def conversation_files(path: str | os.PathLike) -> list[str]:
    """The conversation files `path` names, less the sidecars dflash-data writes beside its outputs
    (X.regenerate.json or X.summary.json with X beside it)."""
    files = find_data_files(path, CONVERSATION_SUFFIXES)
    return [f for f in files if not (f.endswith(SIDECAR_SUFFIXES) and os.path.exists(_sidecar_owner(f)))]


def _sidecar_owner(path: str) -> str:
    return next(path[: -len(s)] for s in SIDECAR_SUFFIXES if path.endswith(s))


def iter_conversations(path: str | os.PathLike, errors: list[str] | None = None) -> Iterator[Conversation]:
    """Every conversation under `path`, in file and row order; ids checked for uniqueness.

    errors=None: raise at the first bad row. A list: append each bad row's message to it and go
    on (the caller reports them all); a file that cannot be read at all still raises."""
    seen: dict[str, str] = {}
    files = conversation_files(path)
    prefixes = derived_id_prefixes(files)
    for path_ in files:
        for row_index, row in _file_rows(path_):
            try:
                if isinstance(row, DataError):
                    raise row
                conv = conversation_from_row(row, path_, row_index, prefixes[path_])
                if conv.sample_id in seen:
                    derived = (
                        " (derived from the file name and row: the row has no id)" if row.get("id") is None else ""
                    )
                    raise DataError(
                        f"{conv.where}: duplicate id {conv.sample_id!r}{derived}, first at {seen[conv.sample_id]}; "
                        "give every row a unique 'id'"
                    )
            except DataError as e:
                if errors is None:
                    raise
                errors.append(str(e))
                continue
            seen[conv.sample_id] = conv.where
            yield conv


def _file_kind(path: str) -> str | None:
    """ "conversations", "tokens" or None (unreadable or neither) from a file's first row or schema."""
    try:
        if path.endswith(".parquet"):
            keys = set(open_parquet(path).schema_arrow.names)
        elif path.endswith(".json"):
            items = read_json(path, max_bytes=MAX_JSON_DATASET_BYTES)
            keys = set(items[0]) if isinstance(items, list) and items and isinstance(items[0], dict) else set()
        else:
            with open(path, "rb") as f:
                line = next((raw for raw in f if raw.strip()), b"{}")
            row = parse_json(line, path, max_bytes=MAX_ROW_BYTES)
            keys = set(row) if isinstance(row, dict) else set()
    except (OSError, ValueError):  # DataError (an unreadable Parquet footer) included
        return None  # the token scan reports what is wrong with it, naming file and row
    if keys & {"messages", "conversations"}:
        return "conversations"
    return "tokens" if "input_ids" in keys else None


def holds_conversations(path: str | os.PathLike) -> bool:
    """Whether the dataset at `path` holds conversations (OpenAI messages or ShareGPT) rather than token
    rows (input_ids), judged by each file's first row; DataError when it holds both."""
    kinds = {}
    for file in conversation_files(path):
        kinds.setdefault(_file_kind(file), file)
    kinds.pop(None, None)
    if len(kinds) > 1:
        raise DataError(
            f"{path} holds both conversations ({kinds['conversations']}) and token rows ({kinds['tokens']}); "
            "give one kind per dataset"
        )
    return "conversations" in kinds
