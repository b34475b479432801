"""What DFlash 2 adds to the DFlash drafter: block convolutions around every sublayer and the candidate
selector (z-lab's DFlash2DraftModel; field notes section 2.2).

- BlockConv (z-lab's GroupedDynamicCausalConv, `attention_conv` / `mlp_conv` of every layer): a causal
  convolution along each draft block, never across a block boundary, whose kernel is a learned base
  plus a per-token dynamic part shared by each group of `conv_group_size` channels:
      out[i, c] = sum_{t < T} (base[t, c] + delta[i, t, g(c)]) * x[i - t, c]     (x[j] = 0 for j < 0)
  with i, j slots of one block and delta = kernel_projection(sublayer input). `prepare` convolves the
  sublayer's input with base[0] + delta[0] and hands delta[1] to `finish`, which convolves the sublayer's
  output with base[1] + delta[1]. The context stream is never convolved.
- CandidateSelector: per draft slot the top-K of the drafter's (transformed) logits, rescored by
      score(p -> c) = unary[c] + < predecessor_codebook[p] * hidden_projection(h), successor_codebook[c] >
  and walked greedily from the anchor (p = the previously chosen token). At T > 0 the draft
  distribution of a slot is softmax(score / T) over its K candidates (`slot_candidates` gives them).
- Logits: lm_head(h) * output_multiplier, then tanh(. / cap) * cap when final_logit_softcapping is set.

Initialisation (`init_dflash2_weights_`) makes both additions inert yet trainable: base[:, 0] = 1, the
rest 0 and the projection 0 (the convolutions are the identity), the selector's hidden projection 0
with random codebooks (scores = unary; were every factor zero, no gradient would ever reach them). A
DFlash 1 drafter loaded into a DFlash 2 one is thus the same drafter (the warm start).

Parameter names equal the released checkpoint's: layers.N.{attention_conv,mlp_conv}.{base_kernel,
kernel_projection.weight}, candidate_selector.{predecessor_codebook, successor_codebook} (no .weight),
candidate_selector.hidden_projection.weight.

Legend: Q block tokens (NB blocks of B), H hidden, T conv taps, G channel groups, C = H/G channels per
group, X rows, K candidates, R selector rank, V vocab, S draft slots.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from train.drafter.linear import Linear


def causal_block_conv(
    x_QH: torch.Tensor, base_TH: torch.Tensor, delta_QTG: torch.Tensor, block_size: int
) -> torch.Tensor:
    """out[i, c] = sum_t (base[t, c] + delta[i, t, g(c)]) * x[i - t, c] inside each block of block_size."""
    Q, H = x_QH.shape
    T, G = delta_QTG.shape[-2:]
    x_NBGC = x_QH.view(Q // block_size, block_size, G, H // G)
    delta_NBTG1 = delta_QTG.reshape(Q // block_size, block_size, T, G, 1).to(x_QH.dtype)
    base_TGC = base_TH.view(T, G, H // G).to(x_QH.dtype)
    out_NBGC = torch.zeros_like(x_NBGC)
    for t in range(min(T, block_size)):  # a tap t >= block_size only ever reads before the block: zero
        # x shifted t slots later inside its block, zeros entering at the block's start.
        x_t = x_NBGC if t == 0 else F.pad(x_NBGC[:, :-t], (0, 0, 0, 0, t, 0))
        out_NBGC = out_NBGC + (base_TGC[t] + delta_NBTG1[:, :, t]) * x_t
    return out_NBGC.view(Q, H)


class BlockConv(nn.Module):
    """Grouped dynamic causal convolution around one sublayer (attention or MLP), on the block stream."""

    # train/drafter/pointwise.py sets a compiled twin on the training model's modules (one fused kernel
    # for the taps' shifts, products and sums, instead of a pass over [Q, H] each).
    conv_fn = staticmethod(causal_block_conv)

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.num_groups, self.block_size = kernel_size, hidden_size // group_size, block_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [before/after, T, H]
        self.kernel_projection = Linear(hidden_size, 2 * kernel_size * self.num_groups)

    def prepare(self, x_QH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sublayer's convolved input, the dynamic kernel [Q, T, G] its output takes in `finish`)."""
        delta_Q2TG = self.kernel_projection(x_QH).view(x_QH.shape[0], 2, self.kernel_size, self.num_groups)
        return self.conv_fn(x_QH, self.base_kernel[0], delta_Q2TG[:, 0], self.block_size), delta_Q2TG[:, 1]

    def finish(self, y_QH: torch.Tensor, delta_QTG: torch.Tensor) -> torch.Tensor:
        return self.conv_fn(y_QH, self.base_kernel[1], delta_QTG, self.block_size)


class CandidateSelector(nn.Module):
    """Rescores each slot's top-K candidates by a rank-R bilinear term in (predecessor, hidden, candidate)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        # Plain parameters, not nn.Embedding: the released checkpoint names them without ".weight". Rows
        # are read by F.embedding, so a step's gradient touches only the rows it used (no [V, R] matmul).
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = Linear(hidden_size, rank)

    def edge_scores(
        self, unary_XK: torch.Tensor, candidates_XK: torch.Tensor, predecessor_X: torch.Tensor, hidden_XH: torch.Tensor
    ) -> torch.Tensor:
        """[X, K] score of each candidate given the row's predecessor token and drafter state."""
        mix_XR = F.embedding(predecessor_X, self.predecessor_codebook) * self.hidden_projection(hidden_XH)
        successor_XKR = F.embedding(candidates_XK, self.successor_codebook)
        return unary_XK + torch.einsum("xr,xkr->xk", mix_XR.to(successor_XKR.dtype), successor_XKR)

    def greedy_path(
        self, unary_NSK: torch.Tensor, candidates_NSK: torch.Tensor, hidden_NSH: torch.Tensor, anchor_N: torch.Tensor
    ) -> torch.Tensor:
        """[N, S] tokens of the greedy walk: slot s takes its best candidate given slot s-1's choice
        (the anchor token before slot 1)."""
        predecessor_N, path = anchor_N, []
        for s in range(unary_NSK.shape[1]):
            scores_NK = self.edge_scores(unary_NSK[:, s], candidates_NSK[:, s], predecessor_N, hidden_NSH[:, s])
            predecessor_N = candidates_NSK[:, s].gather(1, scores_NK.argmax(-1, keepdim=True)).squeeze(1)
            path.append(predecessor_N)
        return torch.stack(path, dim=1)


def transform_logits(logits: torch.Tensor, output_multiplier: float, softcap: float | None) -> torch.Tensor:
    """DFlash 2's logits: scaled by output_multiplier, then soft-capped (monotone: the top-K is unchanged)."""
    if output_multiplier != 1.0:
        logits = logits * output_multiplier
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


@torch.no_grad()
def init_dflash2_weights_(module: nn.Module) -> None:
    """The inert start of the module docstring, for a BlockConv or CandidateSelector (others untouched)."""
    if isinstance(module, BlockConv) and module.base_kernel.device.type != "meta":
        module.base_kernel.zero_()
        module.base_kernel[:, 0] = 1.0
        module.kernel_projection.weight.zero_()
    elif isinstance(module, CandidateSelector) and module.hidden_projection.weight.device.type != "meta":
        # Unit-scale codebooks (nn.Embedding's default): the bilinear term then moves as fast as the
        # projection does once it leaves zero.
        nn.init.normal_(module.predecessor_codebook)
        nn.init.normal_(module.successor_codebook)
        module.hidden_projection.weight.zero_()
