"""The target as a speculative-decoding verifier (train.eval.speculative.Verifier), built from extract's
target model: for a token sequence it returns the target's greedy next token after every position
(or the full next-token logits after its last positions, for sampling) and the tapped hidden states, recomputing the whole prefix each call (no KV cache, no GatedDeltaNet
state carried between calls: simple and exact, fine for measuring acceptance and relative speed).
Several sequences go through one packed forward (verify_many, next_token_logits_many: cu_seqlens keep
them apart), so decoding prompts in lockstep costs one forward per step for all of them.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch

from extract.target.config import stop_token_ids
from extract.target.model import TargetModel

log = logging.getLogger(__name__)


class TargetVerifier:
    def __init__(
        self,
        target_dir: str | Path,
        tap_layer_ids: list[int],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ):
        self.stop_ids = stop_token_ids(target_dir)  # a reply ends there, as in serving (read before the load)
        if not self.stop_ids:
            log.warning(
                "--target %s declares no eos_token_id (config.json, generation_config.json): every reply is "
                "decoded to --max-new-tokens, as no serving engine would",
                target_dir,
            )
        self.model = TargetModel.from_pretrained(target_dir, device, dtype=dtype, with_head=True)
        n = self.model.config.num_hidden_layers
        bad = [t for t in tap_layer_ids if not 0 <= t < n]
        if bad:
            raise ValueError(f"--target {target_dir}: the drafter taps layers {bad}, the target has {n} layers")
        self.tap_layer_ids = [int(t) for t in tap_layer_ids]
        self.embed_tokens_VH = self.model.embed_tokens.weight
        self.lm_head_VH = self.model.lm_head.weight

    def __call__(self, input_ids_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        L = input_ids_L.shape[0]
        device = self.embed_tokens_VH.device
        cu = torch.tensor([0, L], dtype=torch.int32, device=device)
        hidden_LKH, top_ids_L1, _ = self.model.topk_next_tokens(
            input_ids_L.to(device), torch.arange(L, device=device), cu, self.tap_layer_ids, k=1
        )
        return top_ids_L1[:, 0].long(), hidden_LKH

    def next_token_logits(self, input_ids_L: torch.Tensor, num_last: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_LKH, logits_nV = self.model.last_logits(
            input_ids_L.to(self.embed_tokens_VH.device), self.tap_layer_ids, num_last
        )
        return logits_nV, hidden_LKH

    def verify_many(self, input_ids: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """__call__ of each sequence, all in one packed forward (one launch sequence for the batch)."""
        ids_T, positions_T, cu, lengths = self._packed(input_ids)
        hidden_TKH, top_ids_T1, _ = self.model.topk_next_tokens(ids_T, positions_T, cu, self.tap_layer_ids, k=1)
        next_T = top_ids_T1[:, 0].long()
        return list(zip(next_T.split(lengths), hidden_TKH.split(lengths), strict=True))

    def next_token_logits_many(
        self, input_ids: list[torch.Tensor], num_last: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """next_token_logits of each sequence, all in one packed forward."""
        ids_T, positions_T, cu, lengths = self._packed(input_ids)
        if not all(0 < num_last <= n for n in lengths):
            raise ValueError(f"num_last={num_last} must be in 1..the shortest sequence's length ({min(lengths)})")
        ends = cu[1:].long()
        rows_X = (ends[:, None] - num_last + torch.arange(num_last, device=ends.device)).reshape(-1)
        hidden_TKH, logits_XV = self.model.rows_logits(ids_T, positions_T, cu, self.tap_layer_ids, rows_X)
        return list(zip(logits_XV.split(num_last), hidden_TKH.split(lengths), strict=True))

    def _packed(self, input_ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """(ids [T], positions [T] restarting at 0 per sequence, cu_seqlens [S+1] int32, lengths)."""
        device = self.embed_tokens_VH.device
        lengths = [int(ids.shape[0]) for ids in input_ids]
        ids_T = torch.cat([ids.to(device) for ids in input_ids])
        positions_T = torch.cat([torch.arange(n, device=device) for n in lengths])
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        return ids_T, positions_T, cu, lengths


def target_verifier(
    target_dir: str, tap_layer_ids: list[int], device: torch.device, dtype: torch.dtype
) -> TargetVerifier:
    """The verifier factory tools/cli/dflash_train.py hands train.cli's `eval --target` (train.eval.speculative)."""
    return TargetVerifier(target_dir, tap_layer_ids, device, dtype)
