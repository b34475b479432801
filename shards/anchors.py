"""The anchor rule, part of the cache contract: which positions of a packed batch may hold the anchor
of a draft block.

Position t may hold an anchor iff loss_mask[t] == 1 and token t+1 lies in the same sequence with
loss_mask[t+1] == 1 (SpecForge's rule): a block's first label is the token after its anchor, so an
anchor whose successor is unsupervised, in another sequence or padding teaches the drafter nothing.
Training samples its anchors among these positions (train/blocks.py); extraction counts them over the
dataset and refuses one without any (extract/dataset/index.py). Both call `valid_anchors`, so what
extraction counts is what training can sample.

Layout as a shard holds it: the tokens of several sequences back to back, `cu_seqlens` marking the
boundaries; cu_seqlens may be padded by repeating the total, and the tokens past it (the padded tail)
belong to no sequence.

Legend: T packed tokens, S sequences (cu_seqlens has S+1 entries).
"""

from __future__ import annotations

import torch


def sequence_bounds(cu_seqlens_S1: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(start_T, end_T): packed index range [start, end) of each token's sequence; padding gets [total, total)."""
    token_T = torch.arange(num_tokens, device=cu_seqlens_S1.device, dtype=cu_seqlens_S1.dtype)
    cu_S1 = cu_seqlens_S1.contiguous()
    # right=True: the first boundary strictly after t; repeated totals send padding past the last sequence.
    upper_T = torch.searchsorted(cu_S1, token_T, right=True)
    last = cu_S1.shape[0] - 1
    start_T = cu_S1[(upper_T - 1).clamp(0, last)]
    end_T = cu_S1[upper_T.clamp(max=last)]
    end_T = torch.where(token_T < end_T, end_T, start_T)  # padding: empty range
    return start_T, end_T


def valid_anchors(loss_mask_T: torch.Tensor, cu_seqlens_S1: torch.Tensor) -> torch.Tensor:
    """[T] bool: supervised positions whose next token is supervised and in the same sequence.

    t + 1 lies in t's sequence iff t is inside the packed sequences (t < total) and is not a sequence's
    last token. Last tokens are scattered from cu_seqlens (O(T), no search, no host sync): an empty
    sequence's "last token" is the previous sequence's, already marked, and one at the very start
    (end 0) goes to a spare slot T."""
    num_tokens = loss_mask_T.shape[0]
    supervised_T = loss_mask_T.bool()
    next_supervised_T = torch.cat([supervised_T[1:], supervised_T.new_zeros(1)])
    ends_S = cu_seqlens_S1[1:].long()
    last_index_S = torch.where(ends_S > 0, ends_S - 1, num_tokens).clamp(max=num_tokens)
    is_last_T1 = torch.zeros(num_tokens + 1, dtype=torch.bool, device=loss_mask_T.device)
    is_last_T1.index_fill_(0, last_index_S, True)  # a scalar fill: no host tensor, so CUDA graphs capture it
    token_T = torch.arange(num_tokens, device=loss_mask_T.device)
    inside_T = token_T < cu_seqlens_S1[-1]
    return supervised_T & next_supervised_T & inside_T & ~is_last_T1[:num_tokens]
