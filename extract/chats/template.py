"""Render conversations with the target's own chat template and mark what the model generates.

The tokenizer and template come from the target checkpoint directory, as official releases ship
them (tokenizer.json, tokenizer_config.json, chat_template.jinja), through transformers'
AutoTokenizer and apply_chat_template; a directory whose auto_map names code of its own is refused
(refuse_shipped_code), never imported and never asked about on stdin. Qwen templates have no
{% generation %} markers, and they rewrite earlier turns (Qwen3.5 drops the reasoning of assistant
turns before the last user query), so the loss mask cannot come from per-turn renderings: it is
computed on the final rendering.

How: three probe renderings give the template's own markers, nothing is hard-coded:
    header   text that opens an assistant turn      "<|im_start|>assistant\\n"
    end      the end-of-turn token closing it        "<|im_end|>"
    prefill  what the generation prompt adds after the header in this thinking mode: the model is
             given it, it does not generate it       "<think>\\n" (on), "<think>\\n\\n</think>\\n\\n" (off)
In the final text, each assistant turn is header + body + end. Supervised: the body (without a
leading prefill) and the end token: reasoning, content and tool calls, exactly the tokens the model
emits after a generation prompt. Everything else (system, user, tool results, headers, the
newline after the end token) is 0, and so is the end token of a reply cut at max_tokens (marked
`finish_reason: "length"` by regenerate: the model never wrote it). A reply cut inside its reasoning
(no content, no tool call) supervises its reasoning only: the template's closing of the think block
is not the model's either. A token is supervised when its first character is. The number of
assistant turns found must equal the number in the conversation, or the row is refused; so is an
assistant message holding the end-of-turn text, which would end its turn early in the rendering.

With thinking off, reasoning is removed from assistant turns before rendering (a model served
without thinking never writes it); with thinking on it is kept where the template keeps it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from extract.chats.conversations import FINISH_REASON, Conversation
from extract.dataset.rows import DataError
from shards.common.errors import UserError
from shards.common.json_input import read_json, read_json_object

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_GENERIC_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")  # tokenizer.json as it is
_SENTINEL = "DFLASHSENTINEL"  # probe content; any text the template copies verbatim works
_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


class ChatTemplateError(UserError, ValueError):
    """The target directory has no usable tokenizer or chat template; the message says which."""


def refuse_shipped_code(target_dir: Path) -> None:
    """Refuse a checkpoint whose config.json or tokenizer_config.json has `auto_map`: it names Python code
    shipped in the directory, which transformers would import (or ask on stdin whether to). We never run
    code from a checkpoint: it runs with all of this user's rights."""
    for name in ("config.json", "tokenizer_config.json"):  # AutoTokenizer reads config.json for the model type
        path = Path(target_dir) / name
        try:
            fields = read_json(path)
        except (OSError, ValueError):  # InputFileError included
            continue  # absent or unreadable: what loads it says so
        if isinstance(fields, dict) and fields.get("auto_map"):
            raise ChatTemplateError(
                f"{path}: auto_map {json.dumps(fields['auto_map'])[:200]} names code shipped with the checkpoint, "
                "and dflash-data never runs code from a checkpoint (it would run with all of this user's rights); "
                "use a release whose tokenizer needs no custom code, or remove auto_map if transformers' own "
                "classes load it"
            )


@dataclass(frozen=True)
class TurnMarkers:
    header: str  # opens every assistant turn in the rendering
    end: str  # the end-of-turn token's text, closes it (supervised)
    prefill: str  # added after the header by the generation prompt in this mode (not supervised)


def load_tokenizer(target_dir: str | Path):
    """The checkpoint's fast tokenizer, with a chat template; ChatTemplateError naming what is missing."""
    target_dir = Path(target_dir)
    present = [name for name in TOKENIZER_FILES if (target_dir / name).is_file()]
    if not present:
        raise ChatTemplateError(
            f"{target_dir}: no tokenizer ({' or '.join(TOKENIZER_FILES)} missing); copy the tokenizer files "
            f"of the release into the checkpoint directory"
        )
    refuse_shipped_code(target_dir)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        # A checkpoint that declares the generic fast class gets its tokenizer.json exactly as written:
        # AutoTokenizer would pick the model type's own class, which rebuilds it (byte-level BPE for
        # Qwen3.5), and the tiny target's word-level tokenizer is not one.
        declared = (
            read_json_object(target_dir / "tokenizer_config.json").get("tokenizer_class")
            if (target_dir / "tokenizer_config.json").is_file()
            else None
        )
        loader = PreTrainedTokenizerFast if declared in _GENERIC_FAST_CLASSES else AutoTokenizer
        # Never code from the directory, and never a question on stdin: refuse_shipped_code has refused
        # what would need it; nothing from the Hub either.
        tokenizer = loader.from_pretrained(str(target_dir), trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ChatTemplateError(f"{target_dir}: the tokenizer does not load ({type(e).__name__}: {e})") from e
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError(f"{target_dir}: the tokenizer is not a fast (tokenizers) one; tokenizer.json is needed")
    if not tokenizer.chat_template:
        raise ChatTemplateError(
            f"{target_dir}: no chat template (neither chat_template.jinja nor a chat_template field in "
            f"tokenizer_config.json); copy the release's chat_template.jinja into the directory"
        )
    return tokenizer


class ChatRenderer:
    """Turns a Conversation into (input_ids, loss_mask) with the target's template."""

    def __init__(
        self,
        target_dir: str | Path,
        thinking: bool,
        vocab_size: int | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ):
        self.target_dir = Path(target_dir)
        self.thinking = thinking
        self.tokenizer = load_tokenizer(target_dir)
        self.template_kwargs = dict(template_kwargs or {})
        self._refuse_unread_kwargs()
        self.vocab_size = vocab_size
        if vocab_size is not None:
            self._check_fits(vocab_size)
        self.markers = self._probe()

    def _refuse_unread_kwargs(self) -> None:
        """A --template-kwarg the template never reads changes nothing: a typo (reasoning_efort) would
        silently render the default mode, so it is refused, naming what the template does read."""
        from jinja2 import meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        template = self.tokenizer.chat_template
        env = ImmutableSandboxedEnvironment()
        read = set().union(  # a tokenizer may carry named templates: any of them may be the one rendered
            *(
                meta.find_undeclared_variables(env.parse(t))
                for t in (template.values() if isinstance(template, dict) else [template])
            )
        )
        unread = sorted(set(self.template_kwargs) - read)
        if unread:
            raise ChatTemplateError(
                f"--template-kwarg {', '.join(unread)}: the chat template of {self.target_dir} never reads "
                f"{'it' if len(unread) == 1 else 'them'} (it reads {', '.join(sorted(read)) or 'no variables'}); "
                "check the spelling against the template"
            )

    def _check_fits(self, vocab_size: int) -> None:
        """Every id the tokenizer can produce is below the model's vocab_size: its token count alone
        does not say so, as a tokenizer.json may leave gaps between its ids."""
        if len(self.tokenizer) > vocab_size:
            raise ChatTemplateError(
                f"{self.target_dir}: the tokenizer has {len(self.tokenizer)} tokens, more than the model's "
                f"vocab_size {vocab_size}: tokenizer and config.json belong to different models"
            )
        token, top = max(self.tokenizer.get_vocab().items(), key=lambda item: item[1])
        if top >= vocab_size:
            raise ChatTemplateError(
                f"{self.target_dir / 'tokenizer.json'}: token {token!r} has id {top}, outside the model's "
                f"vocab_size {vocab_size} (config.json): tokenizer and config.json belong to different models"
            )

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict] | None = None, add_generation_prompt: bool = False
    ) -> str:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=self.thinking,
                **self.template_kwargs,
            )
        except TemplateError as e:
            raise DataError(f"the chat template refuses this conversation: {e}") from e

    def _probe(self) -> TurnMarkers:
        """The template's assistant header, end-of-turn token and prefill (see the module docstring)."""
        where = f"{self.target_dir / 'chat_template.jinja'}"
        user1, user2 = {"role": "user", "content": "Q1"}, {"role": "user", "content": "Q2"}
        try:
            base = self.render([user1])
            # An assistant turn before a later user query: templates render no think block there.
            full = self.render([user1, {"role": "assistant", "content": _SENTINEL}, user2])
            prompt = self.render([user1], add_generation_prompt=True)
        except DataError as e:
            raise ChatTemplateError(f"{where}: the chat template fails on a plain user/assistant exchange ({e})") from e
        at = full.find(_SENTINEL)
        if not full.startswith(base) or at < 0 or not prompt.startswith(base):
            raise ChatTemplateError(
                f"{where}: cannot locate assistant turns (the rendering of a conversation does not start with "
                f"the rendering of its first turn); this template is not supported"
            )
        header = full[len(base) : at]
        after = full[at + len(_SENTINEL) :]
        special = sorted(
            set(self.tokenizer.all_special_tokens) | set(self.tokenizer.get_added_vocab()), key=len, reverse=True
        )
        end = next((t for t in special if t and after.startswith(t)), None)
        if not header or end is None:
            raise ChatTemplateError(
                f"{where}: cannot find the assistant header or an end-of-turn special token after the "
                f"assistant's text (found {after[:20]!r}); this template is not supported"
            )
        generation = prompt[len(base) :]
        if not generation.startswith(header):
            raise ChatTemplateError(
                f"{where}: the generation prompt {generation!r} does not start with the assistant header {header!r}"
            )
        return TurnMarkers(header=header, end=end, prefill=generation[len(header) :])

    def prepare_messages(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        """Messages as the template should see them in this mode; returns (messages, turns whose
        reasoning was removed because thinking is off)."""
        if self.thinking:
            return messages, 0
        out, dropped = [], 0
        for m in messages:
            if m["role"] == "assistant" and (m.get("reasoning_content") or "<think>" in m.get("content", "")):
                m = {k: v for k, v in m.items() if k != "reasoning_content"}
                m["content"] = _THINK_BLOCK.sub("", m.get("content", ""))
                dropped += 1
            out.append(m)
        return out, dropped

    def supervised_spans(self, text: str) -> list[tuple[int, int]]:
        """[start, end) character spans of the generated part of every assistant turn in `text`."""
        mk = self.markers
        spans, pos = [], 0
        while (head := text.find(mk.header, pos)) >= 0:
            body = head + len(mk.header)
            close = text.find(mk.end, body)
            if close < 0:
                raise DataError(f"an assistant turn at character {head} has no end-of-turn token {mk.end!r}")
            start = body + len(mk.prefill) if mk.prefill and text.startswith(mk.prefill, body) else body
            spans.append((start, close + len(mk.end)))
            pos = close + len(mk.end)
        return spans

    def _refuse_end_text(self, messages: list[dict[str, Any]], where: str) -> None:
        """An assistant message holding the end-of-turn text: the rendering would close its turn there
        and the rest of the reply would be neither supervised nor the model's turn."""
        end = self.markers.end
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and any(end in text for text in _strings(m)):
                raise DataError(
                    f"{where}: messages[{i}] (assistant) contains the end-of-turn text {end!r}, which would end "
                    "its turn early in the rendering; remove it from the reply or drop the row"
                )

    def _written(self, span: tuple[int, int], message: dict[str, Any], text: str) -> tuple[int, int]:
        """The part of an assistant turn's span the model wrote. A reply cut at max_tokens did not
        write the end token; one cut inside its reasoning (no content, no tool call) wrote only the
        reasoning, not the think block's closing the template adds after it."""
        start, stop = span
        if message.get(FINISH_REASON) != "length":
            return span
        stop -= len(self.markers.end)
        if (message.get("content") or "").strip() or message.get("tool_calls"):
            return start, stop
        reasoning = (message.get("reasoning_content") or "").strip()  # templates render it trimmed
        at = text.find(reasoning, start, stop) if reasoning else -1
        return (start, at + len(reasoning)) if at >= 0 else (start, start)  # not rendered: nothing written

    def encode(self, conv: Conversation) -> tuple[np.ndarray, np.ndarray, int]:
        """(input_ids int32, loss_mask uint8, reasoning turns dropped) of one conversation."""
        if conv.num_assistant_turns == 0:
            raise DataError(f"{conv.where}: the conversation has no assistant turn; nothing to train on")
        messages, dropped = self.prepare_messages(conv.messages)
        self._refuse_end_text(messages, conv.where)
        try:
            text = self.render(messages, conv.tools)
            spans = self.supervised_spans(text)
        except DataError as e:
            raise DataError(f"{conv.where}: {e}") from e
        if len(spans) != conv.num_assistant_turns:
            raise DataError(
                f"{conv.where}: the rendering holds {len(spans)} assistant turns, the conversation "
                f"{conv.num_assistant_turns}; does a message contain the template's markup ({self.markers.header!r})?"
            )
        replies = [m for m in messages if m["role"] == "assistant"]
        spans = [self._written(span, m, text) for span, m in zip(spans, replies)]
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64).reshape(-1)
        mask = np.zeros(ids.shape[0], dtype=np.uint8)
        for a, b in spans:
            mask[(starts >= a) & (starts < b)] = 1
        return ids.astype(np.int32), mask, dropped


def _strings(value: Any) -> Iterator[str]:
    """Every string in a message, object keys included (tool-call argument names are rendered too)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
