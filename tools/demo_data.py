"""Demo data: the target's own greedy continuations of random prompts, as a JSON Lines dataset.

A drafter learns to predict what its target would say, so the demo trains on exactly that: each
sample is a random prompt (loss_mask 0) followed by the target's greedy continuation (loss_mask 1).
Generation re-runs the packed forward for every new token (no KV cache): fine for the tiny target.
"""

from __future__ import annotations

import logging
from pathlib import Path

import click
import numpy as np
import torch

from extract.data import Sample, write_jsonl
from extract.model import TargetModel

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
    seqs = [list(rng.integers(0, vocab, size=int(rng.integers(prompt_len[0], prompt_len[1] + 1)))) for _ in range(num_samples)]
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


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False), help="Target checkpoint directory.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="JSON Lines file to write.")
@click.option("--num-samples", default=64, show_default=True, help="Samples (prompts) to generate.")
@click.option("--new-tokens", default=64, show_default=True, help="Greedy tokens generated per prompt (supervised).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random prompts.")
def main(target: str, out: str, num_samples: int, new_tokens: int, seed: int) -> None:
    """Write a dataset of the target's greedy continuations of random prompts (for demos and tests)."""
    logging.basicConfig(level=logging.WARNING)
    samples = greedy_continuations(target, num_samples=num_samples, new_tokens=new_tokens, seed=seed)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(out, samples)
    click.echo(f"wrote {len(samples)} samples ({sum(len(s) for s in samples)} tokens) to {out}")


if __name__ == "__main__":
    main()
