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


def describe_mode(mode: dict[str, Any]) -> str:
    """`thinking on, reasoning_effort=high` as the flags would say it."""
    kwargs = mode.get("template_kwargs")
    kwargs = kwargs if isinstance(kwargs, dict) else {}  # a record read from a file: described, never trusted
    return ", ".join([f"thinking {mode.get('thinking')}", *(f"{k}={json.dumps(v)}" for k, v in kwargs.items())])
