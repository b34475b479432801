"""Training samples of the proxy target: corpus chats rendered as `dflash-data prepare` renders them,
and length-bucketed batches of them.

A sample is one chat (user = prompt, assistant = continuation) through the target's chat template
with thinking off (extract/chats/template.py: the same text and tokens as `prepare --thinking off`),
ids [T] and loss_mask [T] (1 on the reply and its <|im_end|>). Samples longer than max_seq_len are
cut to it and counted (`Samples.num_truncated`).

Batches hold whole samples, right-padded to the longest in the batch (rounded up to PAD_MULTIPLE),
at most `batch_tokens` padded tokens (a longer sample makes a batch of its own): each chat is a sequence of its own, as it is when served (starting from an empty state).
Packing several chats into one row would let a chat see the ones before it, and HF's qwen3_5 keeps
packed sequences apart only through fla's varlen kernels (its CPU path refuses them); right padding
needs nothing of the kind, as a causal model's real tokens never see the padding after them. Each
epoch shuffles the samples (seeded), sorts windows of BUCKET_BATCHES batches by length (little
padding), cuts them into batches and shuffles the batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from extract.chats.conversations import conversation_from_row
from extract.chats.template import ChatRenderer
from tools.testbed.corpus import Chat

BUCKET_BATCHES = 64  # batches per length-sorted window: less padding, still a varied batch order
PAD_LABEL = -100  # cross_entropy's ignore_index
# Batches are padded to a multiple of this many tokens (fla's chunk size): a few distinct shapes, so
# kernels specialised on the sequence length compile a few times, not once per length.
PAD_MULTIPLE = 64


def padded_length(num_tokens: int) -> int:
    return -(-num_tokens // PAD_MULTIPLE) * PAD_MULTIPLE


@dataclass
class Samples:
    ids: list[np.ndarray]  # per sample: token ids [T], int64
    loss_mask: list[np.ndarray]  # per sample: 1 where the token is the reply's (assistant) [T], uint8
    num_truncated: int  # samples cut to max_seq_len

    @property
    def num_tokens(self) -> int:
        return sum(len(x) for x in self.ids)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, padded with the pad id
    labels: torch.Tensor  # [B, T] int64: the next token at every position, PAD_LABEL where none
    assistant_labels: torch.Tensor  # [B, T] int64: labels on reply tokens only, PAD_LABEL elsewhere
    num_real_tokens: int  # tokens that are not padding


def encode_chats(chats: list[Chat], target_dir, max_seq_len: int) -> Samples:
    """Render and tokenize `chats` with the chat template and tokenizer in `target_dir`."""
    renderer = ChatRenderer(target_dir, thinking=False)
    ids, masks, truncated = [], [], 0
    for i, chat in enumerate(chats):
        conv = conversation_from_row(chat.to_row(), "corpus", i)
        sample_ids, mask, _ = renderer.encode(conv)
        truncated += len(sample_ids) > max_seq_len
        ids.append(sample_ids[:max_seq_len].astype(np.int64))
        masks.append(mask[:max_seq_len])
    return Samples(ids, masks, truncated)


def make_batch(samples: Samples, order: list[int], pad_id: int) -> Batch:
    """Right-padded tensors of the samples at `order`."""
    length = padded_length(max(len(samples.ids[i]) for i in order))
    input_ids = np.full((len(order), length), pad_id, dtype=np.int64)
    labels = np.full((len(order), length), PAD_LABEL, dtype=np.int64)
    assistant = np.full((len(order), length), PAD_LABEL, dtype=np.int64)
    for row, i in enumerate(order):
        x, mask = samples.ids[i], samples.loss_mask[i]
        input_ids[row, : len(x)] = x
        labels[row, : len(x) - 1] = x[1:]
        assistant[row, : len(x) - 1] = np.where(mask[1:] == 1, x[1:], PAD_LABEL)
    real = sum(len(samples.ids[i]) for i in order)
    return Batch(torch.from_numpy(input_ids), torch.from_numpy(labels), torch.from_numpy(assistant), real)


def epoch_batches(samples: Samples, batch_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """One epoch's batches (lists of sample indices), every sample once, padded size <= batch_tokens."""
    order = rng.permutation(len(samples.ids))
    window = max(1, BUCKET_BATCHES * batch_tokens // max(1, samples.num_tokens // len(samples.ids)))
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        batches += _cut_by_length(samples, order[start : start + window].tolist(), batch_tokens)
    return [batches[i] for i in rng.permutation(len(batches))]


def sequential_batches(samples: Samples, batch_tokens: int) -> list[list[int]]:
    """Every sample once, in length order, for evaluation (no shuffling: the same figures every time)."""
    return _cut_by_length(samples, list(range(len(samples.ids))), batch_tokens)


def _cut_by_length(samples: Samples, indices: list[int], batch_tokens: int) -> list[list[int]]:
    """`indices` sorted by length and cut into batches whose padded size stays within batch_tokens."""
    batches: list[list[int]] = []
    for i in sorted(indices, key=lambda i: len(samples.ids[i])):
        # Ascending lengths: sample i is the longest of the batch it joins.
        if batches and padded_length(len(samples.ids[i])) * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(int(i))
        else:
            batches.append([int(i)])
    return batches
