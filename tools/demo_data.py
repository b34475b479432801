"""Demo data: chat conversations to regenerate, or the target's own greedy continuations of random prompts.

With --conversations: OpenAI-format chats (a word-salad user prompt, some with a system prompt, the
assistant turn left empty), the input of `dflash-data regenerate`, which fills them with the target's
replies. One user turn each: Qwen3.5's template renders an earlier assistant turn without the empty
think block its reply was generated after, so in a multi-turn chat the earlier replies are not the
target's greedy output in the context they are trained in; single-turn replies are, token for token. Without: token samples, a random prompt (loss_mask 0) followed by the
target's greedy continuation (loss_mask 1). Generation re-runs the packed forward for every new token
(no KV cache): fine for the tiny target.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import click
import numpy as np
import torch

from extract.data import Sample, write_jsonl
from extract.model import TargetModel
from shards.cli_options import CONTEXT_SETTINGS
from tools.tiny_tokenizer import WORDS

log = logging.getLogger(__name__)


def greedy_continuations(
    target_dir: str | Path,
    *,
    num_samples: int,
    prompt_len: tuple[int, int] = (4, 24),
    new_tokens: int = 64,
    seed: int = 0,
    device: str = "cpu",
) -> list[Sample]:
    model = TargetModel.from_pretrained(target_dir, device, dtype=torch.float32, with_head=True)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)
    seqs = [
        list(rng.integers(0, vocab, size=int(rng.integers(prompt_len[0], prompt_len[1] + 1))))
        for _ in range(num_samples)
    ]
    prompt_lens = [len(s) for s in seqs]
    taps = [0]
    for _ in range(new_tokens):
        lengths = [len(s) for s in seqs]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
        ids = torch.tensor(np.concatenate(seqs), dtype=torch.long, device=device)
        pos = torch.cat([torch.arange(n) for n in lengths]).to(device)
        _, top_ids, _ = model.topk_next_tokens(ids, pos, cu, taps, k=1)
        last = (cu[1:] - 1).long()
        for s, t in zip(seqs, top_ids[last, 0].tolist()):
            s.append(int(t))
    return [
        Sample(f"demo-{i}", np.array(s, dtype=np.int32), (np.arange(len(s)) >= p).astype(np.uint8))
        for i, (s, p) in enumerate(zip(seqs, prompt_lens))
    ]


def demo_conversations(num_conversations: int, seed: int = 0) -> list[dict]:
    """OpenAI-format conversations whose assistant turns are to be regenerated (empty here)."""
    rng = random.Random(seed)

    def prompt() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() + "?"

    rows = []
    for i in range(num_conversations):
        messages = [{"role": "system", "content": "You are a helpful assistant."}] if i % 3 == 0 else []
        messages.append({"role": "user", "content": prompt()})
        rows.append({"id": f"chat-{i}", "messages": messages})
    return rows


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option(
    "--target",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="Target checkpoint directory (token samples).",
)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="JSON Lines file to write.")
@click.option("--num-samples", default=64, show_default=True, help="Samples (prompts) to generate.")
@click.option("--new-tokens", default=64, show_default=True, help="Greedy tokens generated per prompt (supervised).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random prompts.")
@click.option(
    "--conversations",
    is_flag=True,
    help="Write chat conversations to regenerate (no target needed) instead of token samples.",
)
def main(target: str | None, out: str, num_samples: int, new_tokens: int, seed: int, conversations: bool) -> None:
    """Write a dataset of the target's greedy continuations of random prompts, or chats to regenerate."""
    logging.basicConfig(level=logging.WARNING)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    if conversations:
        rows = demo_conversations(num_samples, seed)
        with open(out, "w", encoding="ascii") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        click.echo(f"wrote {len(rows)} conversations to {out}")
        return
    if target is None:
        raise click.UsageError("--target is needed to generate token samples (or pass --conversations)")
    samples = greedy_continuations(target, num_samples=num_samples, new_tokens=new_tokens, seed=seed)
    write_jsonl(out, samples)
    click.echo(f"wrote {len(samples)} samples ({sum(len(s) for s in samples)} tokens) to {out}")


if __name__ == "__main__":
    main()
