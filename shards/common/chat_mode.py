"""The mode a target is served in, as its chat template takes it: --thinking (enable_thinking) plus any
other template keyword (`--template-kwarg reasoning_effort=high`, repeatable). Acceptance collapses when
a drafter is served in another mode than its training data were made in, so dflash-data records the
mode in the rows it writes, dflash-extract in cache.json ("chat_mode"), and dflash-train eval compares.

    parse_template_kwargs(["reasoning_effort=high", "budget=2048"]) -> {"reasoning_effort": "high", "budget": 2048}

A value is a JSON scalar when it parses as one (2048, 0.5, true, null, "quoted"), else the text itself.
It lives in shards/ because dflash-data, dflash-extract and dflash-train all take the flags.
"""

from __future__ import annotations

import json
from typing import Any

THINKING_KEY = "enable_thinking"  # the keyword --thinking sets: never a --template-kwarg
# apply_chat_template's own arguments: a template keyword of that name would never reach the template.
_RESERVED = frozenset(
    {THINKING_KEY, "conversation", "messages", "tools", "documents", "tokenize", "add_generation_prompt"}
)


def parse_template_kwargs(entries: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """KEY=VALUE entries as a dict; refuses a malformed entry, a repeated key or a reserved one, naming it."""
    out: dict[str, Any] = {}
    for entry in entries:
        key, sep, text = entry.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(
                f"--template-kwarg {entry!r}: expected KEY=VALUE with KEY a name, e.g. reasoning_effort=high"
            )
        if key in _RESERVED:
            hint = "use --thinking on|off" if key == THINKING_KEY else "it is apply_chat_template's own argument"
            raise ValueError(f"--template-kwarg {entry!r}: {key} is not a template keyword to set here ({hint})")
        if key in out:
            raise ValueError(f"--template-kwarg {entry!r}: {key} is given twice")
        out[key] = _scalar(text)
    return out


def _scalar(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if value is None or isinstance(value, (str, int, float, bool)) else text


def chat_mode(thinking: str, template_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The record of a mode: {"thinking": "on"|"off", "template_kwargs": {...}}, keys sorted."""
    return {"thinking": thinking, "template_kwargs": dict(sorted(template_kwargs.items()))}


def describe_mode(mode: dict[str, Any] | None) -> str:
    """`thinking on, reasoning_effort=high` as the flags would say it; "unknown mode" for None."""
    if mode is None:
        return "unknown mode"
    kwargs = mode.get("template_kwargs")
    kwargs = kwargs if isinstance(kwargs, dict) else {}  # a record read from a file: described, never trusted
    return ", ".join([f"thinking {mode.get('thinking')}", *(f"{k}={json.dumps(v)}" for k, v in kwargs.items())])


# A conversation row may state its own mode, as chat datasets and vLLM requests carry it:
#   enable_thinking       true | false                       (HF apply_chat_template's keyword)
#   chat_template_kwargs  {"reasoning_effort": "low", ...}   (vLLM's request field; may hold enable_thinking)
# dflash-data prepare renders such a row in the flags' mode updated key by key by the row's, and writes the
# result in the token row's MODE_COLUMN, which dflash-extract reads into cache.json "chat_modes".
ROW_MODE_FIELDS = (THINKING_KEY, "chat_template_kwargs")
MODE_COLUMN = "chat_mode"  # a token row's mode: the record's JSON text, {"thinking": ..., "template_kwargs": ...}


def row_mode(row: dict[str, Any], default: dict[str, Any], where: str) -> dict[str, Any]:
    """The mode a conversation row is rendered in: `default` (the flags') with the row's ROW_MODE_FIELDS
    applied; ValueError naming the row (`where`) and the field when one is malformed."""
    thinking, kwargs = default["thinking"], dict(default["template_kwargs"])
    stated = row.get("chat_template_kwargs")
    if stated is not None:
        if not isinstance(stated, dict):
            raise ValueError(
                f"{where}: chat_template_kwargs must be an object of template keywords, found {stated!r:.80}"
            )
        stated = dict(stated)
        if stated.get(THINKING_KEY) is not None:
            thinking = _thinking(stated[THINKING_KEY], f"{where}: chat_template_kwargs.{THINKING_KEY}")
        stated.pop(THINKING_KEY, None)
        for key, value in stated.items():
            if value is None:  # not stated: in a Parquet struct, a key only other rows have reads back null
                continue
            field_name = f"{where}: chat_template_kwargs.{key}"
            if not isinstance(key, str) or not key.isidentifier() or key in _RESERVED:
                raise ValueError(f"{field_name}: not a template keyword to set per row")
            if not isinstance(value, (str, int, float, bool)):
                raise ValueError(
                    f"{field_name}: must be text, a number or true/false (null: not stated), found {value!r:.80}"
                )
            kwargs[key] = value
    if row.get(THINKING_KEY) is not None:
        own = _thinking(row[THINKING_KEY], f"{where}: {THINKING_KEY}")
        if stated is not None and row["chat_template_kwargs"].get(THINKING_KEY) is not None and own != thinking:
            raise ValueError(f"{where}: {THINKING_KEY} and chat_template_kwargs.{THINKING_KEY} disagree")
        thinking = own
    return chat_mode(thinking, kwargs)


def _thinking(value: Any, field_name: str) -> str:
    if not isinstance(value, bool):
        raise ValueError(f"{field_name}: must be true or false, found {value!r:.80}")
    return "on" if value else "off"


def mode_text(mode: dict[str, Any]) -> str:
    """A mode's canonical JSON: the token rows' MODE_COLUMN value and the key modes are told apart by."""
    return json.dumps(chat_mode(mode["thinking"], mode["template_kwargs"]), sort_keys=True)


def mode_from_value(value: Any, where: str) -> dict[str, Any]:
    """A token row's MODE_COLUMN (the JSON text, or in JSON Lines the object itself) as a mode record;
    ValueError naming `where` when it is not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{where}: {MODE_COLUMN} is not JSON: {value!r:.80}") from None
    ok = (
        isinstance(value, dict)
        and set(value) == {"thinking", "template_kwargs"}
        and value["thinking"] in ("on", "off")
        and isinstance(value["template_kwargs"], dict)
        and all(v is None or isinstance(v, (str, int, float, bool)) for v in value["template_kwargs"].values())
    )
    if not ok:
        raise ValueError(
            f'{where}: {MODE_COLUMN} must be {{"thinking": "on"|"off", "template_kwargs": {{KEY: scalar}}}}, '
            f"found {value!r:.120}"
        )
    return chat_mode(value["thinking"], value["template_kwargs"])
