"""The chat template (extract/chats/template.py, ChatRenderer): rendering and loss masks against independent
references, OpenAI and ShareGPT rows alike, reasoning dropped and counted with thinking off.

References: (1) an independent per-turn rendering written here in Python from Qwen3.5's rules, each
segment tokenised on its own; (2) transformers' own assistant mask (return_assistant_tokens_mask)
over a copy of the template with {% generation %} blocks around what the model writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from extract.chats.conversations import conversation_from_row
from extract.chats.template import ChatRenderer
from tests.helpers.chats import AGENTIC, CONVERSATIONS, SHAREGPT, SHAREGPT_AS_OPENAI, chat_target
from tools.fixtures.tiny_tokenizer import CHAT_TEMPLATE


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return chat_target(tmp_path_factory)


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
