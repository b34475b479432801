"""A small real tokenizer and a Qwen3.5-shaped chat template for the tiny target (tests, demo).

The files are the ones an official Qwen3.5 release ships and `dflash-data` reads:
    tokenizer.json          byte-level BPE trained here with `tokenizers` (offline, deterministic:
                            a fixed built-in corpus, one trainer thread's worth of work)
    tokenizer_config.json   eos <|im_end|>, pad <|endoftext|>, the tokenizer class
    chat_template.jinja     ChatML (<|im_start|>role ... <|im_end|>) with Qwen3.5's rules: <think>
                            blocks only on assistant turns after the last user query (reasoning of
                            earlier turns is dropped), tool calls as <tool_call><function=...>,
                            tool results as a user turn of <tool_response> blocks, and a generation
                            prompt that opens <think> (thinking on) or closes an empty one (off)
Every id is below the tiny target's vocab_size; the top ids stay unused so a MASK id (511 in the
demo) never collides with a real token.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

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


def _corpus(num_lines: int = 3000, seed: int = 0) -> list[str]:
    """Deterministic training text: seeded word salad in sentences, plus chat and tool markup."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        sentence = " ".join(words).capitalize() + rng.choice(".?!")
        lines.append(sentence if i % 7 else sentence + "\n" + _SNIPPETS[(i // 7) % len(_SNIPPETS)])
    return lines


@functools.lru_cache(maxsize=4)
def _trained_json(vocab_size: int) -> str:
    return train_tokenizer(vocab_size).to_str()


def train_tokenizer(vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` whose ids all lie below `vocab_size`.

    Merges fill the ids up to `vocab_size - 8 - len(added tokens)`; the added tokens come next
    (as in Qwen, after the BPE vocabulary), the last 8 ids are left free (room for a MASK id)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    num_free = 8
    num_added = len(SPECIAL_TOKENS) + len(MARKUP_TOKENS)
    num_bpe = vocab_size - num_free - num_added
    if num_bpe < 256 + 16:
        raise ValueError(f"vocab_size={vocab_size} leaves {num_bpe} BPE ids; byte-level BPE needs 256 + some merges")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=num_bpe,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    if tok.get_vocab_size() > vocab_size - num_free:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} ids, more than {vocab_size - num_free}")
    return tok


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
