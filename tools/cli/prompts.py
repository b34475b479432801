"""Conversation prompts for `dflash-train eval --target`, rendered as the target is served: its chat
template with --thinking and --template-kwarg (or the mode a row states: enable_thinking,
chat_template_kwargs, as dflash-data prepare takes them), and the generation prompt (what the template pre-fills,
`<think>\\n` with thinking on). train/ never imports extract/, so the `dflash-train` console script hands
this renderer to train.cli (EntryPoint.prompt_renderer), as it hands the verifier.

A prompt row is a conversation (OpenAI messages or ShareGPT, as dflash-data takes them); the prompt is
the conversation up to its last non-assistant turn: trailing assistant replies are what is generated.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from extract.chats.conversations import conversation_from_row
from extract.chats.template import ChatRenderer
from extract.dataset.rows import DataError
from shards.common.chat_mode import chat_mode, mode_text, parse_template_kwargs, row_mode


def prompt_renderer(target_dir: str, thinking: str, template_kwargs: list[str]) -> Callable[[Any, str, int], list[int]]:
    """(row, file, row index) -> the prompt's token ids; ValueError naming the row when it has no prompt.
    The tokenizer loads at the first conversation: token-id prompts need none (nor a target that has one)."""

    evaluated = chat_mode(thinking, parse_template_kwargs(template_kwargs))

    @functools.cache
    def chat_renderer(key: str) -> ChatRenderer:
        mode = json.loads(key)
        return ChatRenderer(target_dir, mode["thinking"] == "on", template_kwargs=mode["template_kwargs"])

    def render(row: Any, path: str, index: int) -> list[int]:
        conv = conversation_from_row(row, path, index)
        try:  # a row stating its own mode (enable_thinking, chat_template_kwargs) is rendered in it
            renderer = chat_renderer(mode_text(row_mode(conv.extra, evaluated, conv.where)))
        except ValueError as e:
            raise DataError(str(e)) from e
        messages, _ = renderer.prepare_messages(conv.messages)
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise DataError(f"{conv.where}: no turn before the assistant's reply, so no prompt")
        text = renderer.render(messages, conv.tools, add_generation_prompt=True)
        return renderer.tokenizer(text, add_special_tokens=False)["input_ids"]

    return render
