"""Static device input buffers: one packed batch, at fixed addresses, refilled every step.

The captured CUDA graph reads its inputs from these tensors, so a new batch is *copied into* them
(never rebound). Host shards come from shards.ShardLoader in (pinned) buffers; the copy is
asynchronous on CUDA, and the host buffer is handed back to the loader only once the copy has
finished (an event checked at the next load, by which time it has long completed).

Legend: T token budget, K taps, H hidden, S max sequences, Kt stored target top-k.
"""

from __future__ import annotations

import torch

from shards import CacheConfig, LoadedShard, decode_context, tensor_specs

# What a shard stores of the target (the taps or a projected cache's codes, with their fp8 scales).
_STORED_CONTEXT = ("hidden", "hidden_scale", "codes", "code_scale")


class StaticBatch:
    """Device tensors of one shard's shapes: hidden_TKH (compute dtype; a projected cache's codes as
    [T, 1, R]), input_ids_T, position_ids_T, loss_mask_T, anchor_mask_T (ones for a version 2 cache, which
    has none), cu_seqlens_S1, batch_id (int64 [1]), optional target top-k."""

    def __init__(self, cache_cfg: CacheConfig, device: torch.device, dtype: torch.dtype, with_topk: bool):
        T, S = cache_cfg.token_budget, cache_cfg.max_seqs
        K, H = cache_cfg.context_shape
        self.cache_cfg, self.device, self.dtype = cache_cfg, device, dtype
        self.fp8 = cache_cfg.storage_dtype == "fp8"
        self.hidden_TKH = torch.zeros(T, K, H, dtype=dtype, device=device)
        self.input_ids_T = torch.zeros(T, dtype=torch.int32, device=device)
        self.position_ids_T = torch.zeros(T, dtype=torch.int32, device=device)
        self.loss_mask_T = torch.zeros(T, dtype=torch.uint8, device=device)
        self.anchor_mask_T = torch.ones(T, dtype=torch.uint8, device=device)
        self.cu_seqlens_S1 = torch.zeros(S + 1, dtype=torch.int32, device=device)
        self.batch_id = torch.full((1,), -1, dtype=torch.int64, device=device)
        self.topk_ids_TK: torch.Tensor | None = None
        self.topk_logprobs_TK: torch.Tensor | None = None
        if with_topk:
            Kt = cache_cfg.target_topk
            self.topk_ids_TK = torch.zeros(T, Kt, dtype=torch.int32, device=device)
            self.topk_logprobs_TK = torch.zeros(T, Kt, dtype=torch.bfloat16, device=device)
        # fp8 shards are copied as stored (half the bytes) and decoded on the device.
        specs = tensor_specs(cache_cfg)
        self._stored = {
            name: torch.zeros(specs[name].shape, dtype=specs[name].dtype, device=device)
            for name in _STORED_CONTEXT
            if self.fp8 and name in specs
        }
        self._pending: tuple[torch.cuda.Event | None, LoadedShard] | None = None

    def load(self, shard: LoadedShard) -> None:
        """Copy a loaded shard into the static buffers (async on CUDA); its host buffer is released later."""
        self._release_pending()
        t = shard.tensors
        nb = self.device.type == "cuda"
        if self.fp8:
            for name, stored in self._stored.items():
                stored.copy_(t[name], non_blocking=nb)
            self.hidden_TKH.copy_(decode_context(self._stored, self.cache_cfg))
        else:
            self.hidden_TKH.copy_(decode_context(t, self.cache_cfg), non_blocking=nb)  # bf16 -> compute dtype
        self.input_ids_T.copy_(t["input_ids"], non_blocking=nb)
        self.position_ids_T.copy_(t["position_ids"], non_blocking=nb)
        self.loss_mask_T.copy_(t["loss_mask"], non_blocking=nb)
        if "anchor_mask" in t:
            self.anchor_mask_T.copy_(t["anchor_mask"], non_blocking=nb)
        self.cu_seqlens_S1.copy_(t["cu_seqlens"], non_blocking=nb)
        self.batch_id.fill_(shard.batch_id)
        if self.topk_ids_TK is not None:
            self.topk_ids_TK.copy_(t["target_topk_ids"], non_blocking=nb)
            self.topk_logprobs_TK.copy_(t["target_topk_logprobs"], non_blocking=nb)
        if nb:
            event = torch.cuda.Event()
            event.record()
            self._pending = (event, shard)
        else:
            shard.release()

    def _release_pending(self) -> None:
        if self._pending is not None:
            event, shard = self._pending
            event.synchronize()  # the copy was queued one step ago: long finished in steady state
            shard.release()
            self._pending = None

    def close(self) -> None:
        self._release_pending()
