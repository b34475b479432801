"""Helpers shared by the dflash-data tests (no tests here): a tiny target with a tokenizer and chat template,
conversations in each format, prepare and regenerate through the CLI, and a background HTTP server."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from extract.chats.cli import main as data_cli
from tools.fixtures.tiny_server import running as running  # re-exported: the tests take it from here
from tools.fixtures.tiny_target import tiny_config_dict, write_random_checkpoint

VOCAB = 512
MAX_TOKENS = 5  # regenerate's --max-tokens in these tests: each reply is at most this long


def chat_target(tmp_path_factory, mixer_scale: float = 1.0) -> Path:
    """A tiny random target with the tiny tokenizer and Qwen3.5's chat template (mixer_scale < 1: more
    predictable greedy text, as the demo's)."""
    return write_random_checkpoint(
        tmp_path_factory.mktemp("target"),
        tiny_config_dict(vocab_size=VOCAB),
        naming="text",
        with_tokenizer=True,
        mixer_scale=mixer_scale,
    )


# A template line that reads the reasoning_effort keyword (Qwen3.5's template ignores it).
EFFORT = "{%- if reasoning_effort is defined -%}{{- '<|im_start|>system\\nreasoning ' + reasoning_effort + '<|im_end|>\\n' -}}{%- endif -%}\n"


def effort_chat_target(tmp_path_factory) -> Path:
    """chat_target (predictable text) whose template also reads reasoning_effort."""
    path = chat_target(tmp_path_factory, mixer_scale=0.1)
    template = path / "chat_template.jinja"
    template.write_text(EFFORT + template.read_text())
    return path


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


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows))
    return path


def prepare(args: list[str]):
    return CliRunner().invoke(data_cli, ["prepare", *args], catch_exceptions=False)


def write_conversations(path: Path, n: int, multi_turn: bool = True) -> Path:
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Question number {i} about the weather?"}]
        if multi_turn and i % 2:
            messages += [
                {"role": "assistant", "content": "old answer"},
                {"role": "user", "content": "And tomorrow?"},
                {"role": "assistant", "content": "old answer two"},
            ]
        rows.append({"id": f"c{i}", "messages": messages, "source": "test"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def regenerate_args(url: str, data: Path, out: Path, *extra: str, model: str = "tiny", thinking: str = "off"):
    """dflash-data regenerate's arguments against the tiny server: MAX_TOKENS per reply, no progress bar,
    short retry backoff, then `extra`."""
    return [
        "regenerate",
        "--server",
        url,
        "--model",
        model,
        "--data",
        str(data),
        "--out",
        str(out),
        "--max-tokens",
        str(MAX_TOKENS),
        "--thinking",
        thinking,
        "--no-progress",
        "--retry-backoff",
        "0.05",
        *extra,
    ]


def read_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]
