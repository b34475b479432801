"""How good the proxy target is: held-out loss against a unigram baseline, and how repetitive its
greedy replies are against the corpus' own continuations.

    heldout loss      mean next-token cross-entropy (nats) over the held-out split, on every token
                      ("all") and on the reply tokens only ("assistant": what a drafter learns)
    unigram baseline  the same mean under the train split's token frequencies (add-one smoothed over
                      the vocabulary, so a token unseen in training costs log(counts + V), not
                      infinity): the entropy-like floor any model that reads context must beat
    repetitiveness    of greedy replies to held-out prompts (template with thinking off, as served):
                      repeated_4gram_share = 4-grams of a reply already seen earlier in that reply /
                      all its 4-grams (pooled over replies; a looping reply tends to 1), distinct_n =
                      distinct n-grams / n-grams over all replies, finished = replies that ended with
                      <|im_end|> before max_new_tokens. The corpus' continuations of the same prompts,
                      cut to the same length, get the same figures: code repeats itself naturally.

Generation is plain greedy without a KV cache: each step re-runs the batch (right-padded to a
multiple of PAD_MULTIPLE, so real tokens never see padding and kernels see few shapes) and reads the
logits at each row's last token; simple and exact at this size.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F

from tools.testbed.target_data import PAD_LABEL, Samples, make_batch, padded_length, sequential_batches


def autocast(device: torch.device):
    """bf16 autocast on CUDA (the training precision), nothing on CPU (fp32 there)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def token_losses(model, input_ids: torch.Tensor, labels: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Summed cross-entropy (fp32) of `labels` [B, T] under the model's logits at `input_ids` [B, T]."""
    with autocast(device):
        logits_BTV = model(input_ids=input_ids.to(device)).logits
    return F.cross_entropy(
        logits_BTV.float().flatten(0, 1), labels.to(device).flatten(), ignore_index=PAD_LABEL, reduction="sum"
    )


@torch.no_grad()
def heldout_loss(model, samples: Samples, batch_tokens: int, pad_id: int, device: torch.device) -> dict[str, float]:
    """Mean cross-entropy (nats per token) on all next tokens and on the reply tokens."""
    was_training = model.training
    model.eval()
    sums = {"all": 0.0, "assistant": 0.0}
    counts = {"all": 0, "assistant": 0}
    for order in sequential_batches(samples, batch_tokens):
        batch = make_batch(samples, order, pad_id)
        for key, labels in (("all", batch.labels), ("assistant", batch.assistant_labels)):
            sums[key] += token_losses(model, batch.input_ids, labels, device).item()
            counts[key] += int((labels != PAD_LABEL).sum())
    model.train(was_training)
    return {key: sums[key] / max(1, counts[key]) for key in sums}


def unigram_baseline(train: Samples, heldout: Samples, vocab_size: int) -> dict[str, float]:
    """Cross-entropy (nats per token) of the held-out next tokens under the train split's add-one
    smoothed unigram distribution, on all tokens and on reply tokens (as heldout_loss)."""
    out = {}
    for key in ("all", "assistant"):
        counts = np.ones(vocab_size, dtype=np.float64)  # add-one smoothing
        for ids in _targets(train, key):
            counts += np.bincount(ids, minlength=vocab_size)
        log_p = np.log(counts / counts.sum())
        held = np.concatenate(list(_targets(heldout, key)))
        out[key] = float(-log_p[held].mean())
    return out


def _targets(samples: Samples, key: str):
    """The predicted tokens of each sample (every token after the first; reply tokens for "assistant")."""
    for ids, mask in zip(samples.ids, samples.loss_mask):
        yield ids[1:] if key == "all" else ids[1:][mask[1:] == 1]


@torch.no_grad()
def greedy_replies(
    model, prompts: list[np.ndarray], max_new_tokens: int, stop_ids: set[int], pad_id: int, device: torch.device
) -> list[tuple[list[int], bool]]:
    """(reply ids without the stop token, whether a stop token ended it) per prompt, greedy."""
    was_training = model.training
    model.eval()
    seqs = [list(map(int, p)) for p in prompts]
    starts = [len(s) for s in seqs]
    done = [False] * len(seqs)
    for _ in range(max_new_tokens):
        live = [i for i in range(len(seqs)) if not done[i]]
        if not live:
            break
        length = padded_length(max(len(seqs[i]) for i in live))
        ids = torch.full((len(live), length), pad_id, dtype=torch.long)
        for row, i in enumerate(live):
            ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
        last = torch.tensor([len(seqs[i]) - 1 for i in live], device=device)
        with autocast(device):
            hidden_BTH = model.model(input_ids=ids.to(device)).last_hidden_state
            logits_BV = model.lm_head(hidden_BTH[torch.arange(len(live), device=device), last])
        for i, token in zip(live, logits_BV.float().argmax(-1).tolist()):
            seqs[i].append(token)
            done[i] = token in stop_ids
    model.train(was_training)
    out = []
    for seq, start, finished in zip(seqs, starts, done):
        reply = seq[start:]
        out.append((reply[:-1] if finished else reply, finished))
    return out


def repetitiveness(replies: list[list[int]]) -> dict[str, float]:
    """repeated_4gram_share, distinct_1, distinct_2 and mean_tokens of token sequences (module doc)."""
    repeated = total4 = 0
    for reply in replies:
        seen: set[tuple[int, ...]] = set()
        for gram in _ngrams(reply, 4):
            repeated += gram in seen
            seen.add(gram)
            total4 += 1
    out = {"repeated_4gram_share": repeated / total4 if total4 else math.nan}
    for n in (1, 2):
        grams = Counter(g for reply in replies for g in _ngrams(reply, n))
        out[f"distinct_{n}"] = len(grams) / sum(grams.values()) if grams else math.nan
    out["mean_tokens"] = float(np.mean([len(r) for r in replies])) if replies else math.nan
    return out


def _ngrams(seq: list[int], n: int):
    return (tuple(seq[i : i + n]) for i in range(len(seq) - n + 1))
