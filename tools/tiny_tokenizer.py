"""A small real tokenizer and a Qwen3.5-shaped chat template for the tiny target (tests, demo).

The files are the ones an official Qwen3.5 release ships and `dflash-data` reads:
    tokenizer.json          a word-level tokenizer trained here with `tokenizers` (offline,
                            deterministic: a fixed built-in corpus), lowercase, one token per word,
                            ASCII punctuation mark or digit; whitespace separates tokens and is not
                            itself a token; decoding joins tokens with single spaces
    tokenizer_config.json   eos <|im_end|>, pad <|endoftext|>, the tokenizer class
    chat_template.jinja     ChatML (<|im_start|>role ... <|im_end|>) with Qwen3.5's rules: <think>
                            blocks only on assistant turns after the last user query (reasoning of
                            earlier turns is dropped), tool calls as <tool_call><function=...>,
                            tool results as a user turn of <tool_response> blocks, and a generation
                            prompt that opens <think> (thinking on) or closes an empty one (off)
Every id is below the tiny target's vocab_size; the top ids stay unused so a MASK id (511 in the
demo) never collides with a real token.

Why word-level: the demo's data must be the tiny target's own greedy output, token for token, after
the round trip ids -> text (the server) -> chat template -> ids (`dflash-data prepare`). A byte-level
BPE breaks it (the generated ids are rarely the canonical encoding of their text, and the template
trims a reply's edge whitespace). Here every id the target can emit is a token without
whitespace, so the text of any sequence of them is the tokens joined by single spaces, with nothing
for `| trim` to remove, and encodes back to the same ids, in any context. The tiny target's LM head
gives the other ids (unused ids, <|unk|>, <|im_start|>, <|endoftext|>, <think>, </think>) zero
logits (`unemittable_ids`, tools/tiny_target.py), so greedy decoding never picks them: its replies never think, and a
reply ends with <|im_end|> or at max_tokens. Encoding is lossy the other way (case and spacing are
normalised; unknown words become <|unk|>), which the pipeline never relies on.
"""

from __future__ import annotations

import functools
import json
import random
import string
from pathlib import Path

UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # never split, skipped when decoding
# Added but not "special" (as in Qwen's tokenizer): they stay in decoded text, so a server can find them.
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

WORDS = (
    "the a an and or but if then so because of to in on at for with from by as is are was were be "
    "have has had do does did can could will would should may might must not no yes it this that "
    "these those there here what which who when where why how all some any each every many much more "
    "most few one two three four five first last next new old good bad big small long short high low "
    "time day year way thing people world life hand part place case week work number point home water "
    "room mother area money story fact month lot right study book eye job word business issue side "
    "kind head house service friend father power hour game line end member law car city name team "
    "weather rain sun cold warm wind snow today tomorrow question answer think know see look find give "
    "tell ask use make take come go want need feel try leave call keep let begin seem help show hear "
    "play run move live believe hold bring write provide sit stand lose pay meet include continue set "
    "learn change lead understand watch follow stop create speak read spend grow open walk win offer"
).split()
_SNIPPETS = (
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "<think>\nLet me think about this step by step.\n</think>\n\n",
    '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>',
    "1 + 1 = 2. 12 * 3 = 36. The answer is 42.",
    "def add(a, b):\n    return a + b\n",
)


# Words of the chat template, the demo's and the tests' conversations: in the vocabulary too.
_EXTRA_TEXT = (
    "system user assistant tool tools tool_call tool_response function parameter arguments name value arg "
    "you are a helpful brief assistant what weather paris city unit celsius temperature sky clear degrees "
    "thanks and tomorrow no data i do not know two plus three four times twelve multiply add them sunny "
    "call it answer now summarise also the check let me step hello reasoning get_time zone cet days "
    + string.punctuation
    + " "
    + " ".join(string.digits)
)


def _corpus(num_lines: int = 3000, seed: int = 0) -> list[str]:
    """Deterministic training text: seeded word salad in sentences, plus chat and tool markup."""
    rng = random.Random(seed)
    lines = [_EXTRA_TEXT]
    for i in range(num_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        sentence = " ".join(words).capitalize() + rng.choice(".?!")
        lines.append(sentence if i % 7 else sentence + "\n" + _SNIPPETS[(i // 7) % len(_SNIPPETS)])
    return lines


@functools.lru_cache(maxsize=4)
def _trained_json(vocab_size: int) -> str:
    return train_tokenizer(vocab_size).to_str()


def train_tokenizer(vocab_size: int):
    """A word-level `tokenizers.Tokenizer` whose ids all lie below `vocab_size` (see the module doc).

    <|unk|> is id 0, the corpus' words, punctuation marks and digits follow, then the added tokens
    (as in Qwen, after the learned vocabulary); the last 8 ids below `vocab_size` are left free
    (room for a MASK id)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    num_free = 8
    num_added = len(SPECIAL_TOKENS) + len(MARKUP_TOKENS)
    num_words = vocab_size - num_free - num_added
    tok = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
    tok.normalizer = normalizers.Lowercase()
    # Decoding joins tokens with single spaces: WordPiece's decoder with a continuation prefix no token
    # has ("#" is a token of its own) and no clean-up (which would glue punctuation to words).
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Punctuation("isolated"),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    trainer = trainers.WordLevelTrainer(
        vocab_size=num_words, min_frequency=1, show_progress=False, special_tokens=[UNK_TOKEN]
    )
    if num_words < 128:
        raise ValueError(f"vocab_size={vocab_size} leaves {num_words} word ids; the tiny tokenizer needs ~300")
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    if tok.get_vocab_size() > vocab_size - num_free:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} ids, more than {vocab_size - num_free}")
    return tok


def unemittable_ids(vocab_size: int) -> list[int]:
    """Ids the tiny target must never generate: the text of a sequence holding one of them does not
    encode back to it (unused ids and <|unk|> have no text of their own, <|im_start|> and
    <|endoftext|> are dropped when a server decodes, think tags are parsed by the server and the template)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_trained_json(vocab_size))
    vocab = tok.get_vocab()
    named = [vocab[t] for t in (UNK_TOKEN, "<|im_start|>", "<|endoftext|>", "<think>", "</think>")]
    return sorted(set(named) | set(range(tok.get_vocab_size(), vocab_size)))


# Qwen3.5's rules in ChatML; only string content (or a list of {"type": "text"} parts) is rendered.
CHAT_TEMPLATE = r"""{%- macro text_of(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content is none or content is undefined -%}{{- '' -}}
    {%- else -%}{%- for part in content -%}{{- part.text -}}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if not messages -%}{{- raise_exception('No messages provided.') -}}{%- endif -%}
{%- if tools -%}
    {{- '<|im_start|>system\n# Tools\n\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nCall a function as <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>' -}}
    {%- if messages[0].role == 'system' -%}{{- '\n\n' + text_of(messages[0].content) | trim -}}{%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' + text_of(messages[0].content) | trim + '<|im_end|>\n' -}}
{%- endif -%}
{#- The last user query: a user turn that is not only tool results. Assistant turns after it keep
    their reasoning; earlier ones lose it (Qwen3.5 drops the reasoning of finished turns). -#}
{%- set ns = namespace(last_query_index=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set text = text_of(message.content) | trim -%}
        {%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
            {%- set ns.last_query_index = loop.index0 -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if ns.last_query_index < 0 -%}{{- raise_exception('No user query found in messages.') -}}{%- endif -%}
{%- for message in messages -%}
    {%- set content = text_of(message.content) | trim -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}{{- raise_exception('System message must be at the beginning.') -}}{%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] | trim -%}
        {%- endif -%}
        {%- if loop.index0 > ns.last_query_index -%}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning | trim + '\n</think>\n\n' + content -}}
        {%- else -%}
            {{- '<|im_start|>assistant\n' + content -}}
        {%- endif -%}
        {%- for call in message.tool_calls or [] -%}
            {%- set call = call.function if call.function is defined else call -%}
            {%- if not loop.first -%}{{- '\n' -}}{%- elif content -%}{{- '\n\n' -}}{%- endif -%}
            {{- '<tool_call>\n<function=' + call.name + '>\n' -}}
            {%- for name, value in (call.arguments or {}).items() -%}
                {{- '<parameter=' + name + '>\n' -}}
                {{- value if value is string else value | tojson -}}
                {{- '\n</parameter>\n' -}}
            {%- endfor -%}
            {{- '</function>\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- else -%}
        {{- raise_exception('Unexpected message role: ' + message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- else -%}
        {{- '<think>\n' -}}
    {%- endif -%}
{%- endif -%}
"""


def write_tokenizer(out_dir: str | Path, vocab_size: int) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(_trained_json(vocab_size), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "add_prefix_space": False,
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
    }
    with open(out_dir / "tokenizer_config.json", "w", encoding="ascii") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="ascii")
    return [out_dir / name for name in TOKENIZER_FILES]
