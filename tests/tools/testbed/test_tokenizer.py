"""The proxy target's tokenizer (tools/testbed/tokenizer.py): deterministic, byte-level (any text
round-trips), Qwen's added tokens after the learned ids, the committed files equal a fresh training
on the committed corpus, and the chat template renders a corpus chat as dflash-data prepare does."""

from __future__ import annotations

import pytest

from extract.chats.conversations import conversation_from_row
from extract.chats.template import ChatRenderer
from shards.common.errors import UserError
from tools.fixtures.tiny_tokenizer import CHAT_TEMPLATE, MARKUP_TOKENS, SPECIAL_TOKENS
from tools.testbed.corpus import Chat
from tools.testbed.proxy_config import PROXY_TARGET_DIR
from tools.testbed.tokenizer import NUM_FREE_IDS, canonical_json, train_tokenizer, write_proxy_tokenizer

TEXT = 'def f(x):\n    """Caf\u00e9 \u2713 \u4e2d\u6587."""\n\treturn x  # tab, spaces   \n\n'


def _chats(n=60):
    code = "```python\n    for item in self.items:\n        yield item.name\n```"
    return [
        Chat(f"s:{i}", "code", "s", "train" if i % 5 else "heldout", f"Complete number {i} please.", code)
        for i in range(n)
    ]


def test_training_is_deterministic_and_round_trips_any_text():
    first, second = train_tokenizer(_chats(), 512), train_tokenizer(_chats(), 512)
    assert canonical_json(first) == canonical_json(second)
    for text in (TEXT, "held-out words never seen: zxqv \U0001f600", "<think>\n\n</think>\n\nok<|im_end|>"):
        assert first.decode(first.encode(text).ids, skip_special_tokens=False) == text
    vocab = first.get_vocab()
    added = [vocab[t] for t in (*SPECIAL_TOKENS, *MARKUP_TOKENS)]
    learned = [i for t, i in vocab.items() if t not in SPECIAL_TOKENS + MARKUP_TOKENS]
    assert min(added) > max(learned) and max(added) == first.get_vocab_size() - 1 <= 512 - NUM_FREE_IDS - 1
    assert first.encode("a<|im_end|>b<think>").tokens[1::2] == ["<|im_end|>", "<think>"]


def test_committed_tokenizer_is_the_training_of_the_committed_corpus(tmp_path, corpus):
    write_proxy_tokenizer(tmp_path, corpus)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (PROXY_TARGET_DIR / name).read_bytes(), name
    assert (PROXY_TARGET_DIR / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    with pytest.raises(UserError, match="already holds tokenizer.json"):
        write_proxy_tokenizer(tmp_path, corpus)


def test_a_corpus_chat_renders_with_its_reply_supervised(corpus):
    chat = next(c for c in corpus if c.split == "heldout" and c.kind == "code")
    renderer = ChatRenderer(PROXY_TARGET_DIR, thinking=False)
    ids, mask, _ = renderer.encode(conversation_from_row(chat.to_row(), "corpus", 0))
    tok = renderer.tokenizer
    assert tok.decode(ids[mask == 1]) == chat.continuation + "<|im_end|>"
    text = renderer.render([{"role": "user", "content": chat.prompt}], add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert list(ids[: (mask == 0).sum() - 1]) == tok(text, add_special_tokens=False)["input_ids"]
