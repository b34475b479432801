"""The proxy target's tokenizer: a byte-level BPE trained with `tokenizers` on the corpus' train split.

    python -m tools.testbed.tokenizer --out DIR [--corpus CORPUS.jsonl.gz] [--vocab-size 4096]

Shaped like Qwen's: NFC, Qwen2's pre-tokenizer pattern (contractions, letter runs with one leading
non-letter, single digits, punctuation runs, newline runs, space runs), byte-level alphabet (any
text encodes, no <unk>), then the added tokens after the learned ids, as Qwen numbers them: the
special ones (<|endoftext|> <|im_start|> <|im_end|>, skipped when decoding) and the markup ones
(<think> </think> <tool_call> ... kept in decoded text). The last NUM_FREE_IDS ids below the
model's vocab_size stay unused (room for a drafter's MASK id, as Qwen3's 151669 lies past its
tokenizer). The files written are the ones a Qwen3.5 release ships (tokenizer.json,
tokenizer_config.json, chat_template.jinja), with the Qwen3.5-shaped template of
tools/fixtures/tiny_tokenizer.py.

Deterministic: the same train split gives the same tokenizer.json (tests/tools/testbed checks).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from shards.common.cli_options import CONTEXT_SETTINGS
from shards.common.errors import UserError, user_errors
from tools.fixtures.tiny_tokenizer import MARKUP_TOKENS, SPECIAL_TOKENS, TOKENIZER_FILES, write_tokenizer_files
from tools.testbed.corpus import Chat, corpus_option, load_corpus

VOCAB_SIZE = 4096  # the proxy target's vocab_size (config.json): tokenizer ids plus NUM_FREE_IDS
NUM_FREE_IDS = 8
# Qwen2's pre-tokenizer pattern (tokenizer.json of the Qwen2/2.5/3 releases).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(chats: list[Chat], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE `tokenizers.Tokenizer` over the train split's prompts and continuations, whose
    ids all lie below vocab_size - NUM_FREE_IDS."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    num_learned = vocab_size - NUM_FREE_IDS - len(SPECIAL_TOKENS) - len(MARKUP_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if num_learned < len(alphabet) + 64:
        raise ValueError(
            f"vocab_size={vocab_size} leaves {num_learned} learned ids; byte-level BPE needs > {len(alphabet) + 64}"
        )
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_learned, min_frequency=2, initial_alphabet=alphabet, show_progress=False, special_tokens=[]
    )
    texts = (text for c in chats if c.split == "train" for text in (c.prompt, c.continuation))
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    if tok.get_vocab_size() > vocab_size - NUM_FREE_IDS:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} ids, more than {vocab_size - NUM_FREE_IDS}")
    return tok


def canonical_json(tokenizer) -> str:
    """tokenizer.json with sorted keys: the same tokenizer gives the same bytes."""
    return json.dumps(json.loads(tokenizer.to_str()), indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def write_proxy_tokenizer(out_dir: str | Path, chats: list[Chat], vocab_size: int = VOCAB_SIZE) -> list[Path]:
    """Train on `chats` and write the three tokenizer files into `out_dir`; refuses to replace any."""
    out_dir = Path(out_dir)
    present = [name for name in TOKENIZER_FILES if (out_dir / name).exists() or (out_dir / name).is_symlink()]
    if present:
        raise UserError(f"--out {out_dir}: already holds {', '.join(present)}; write the tokenizer to a new directory")
    return write_tokenizer_files(out_dir, canonical_json(train_tokenizer(chats, vocab_size)))


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Directory to write tokenizer.json, tokenizer_config.json and chat_template.jinja into.",
)
@corpus_option("The corpus file (its train split is the training text).")
@click.option(
    "--vocab-size",
    type=int,
    default=VOCAB_SIZE,
    show_default=True,
    help=f"The model's vocab_size; the tokenizer uses all ids but the last {NUM_FREE_IDS}.",
)
@user_errors(ValueError, OSError)
def main(out: Path, corpus: Path, vocab_size: int) -> None:
    """Train the proxy target's byte-level BPE tokenizer and write it with the chat template."""
    for path in write_proxy_tokenizer(out, load_corpus(corpus), vocab_size):
        click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()
