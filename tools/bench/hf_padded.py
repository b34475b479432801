"""The baseline tools/bench/extract.py compares with (--hf-layers): HF transformers' qwen3_5 text model
over the same samples as padded batches, the way a plain HF extraction script would run it: samples
sorted by length, rows of equal padded length up to the token budget, an attention_mask, every hidden
state returned. Timed on a subset of the layers and projected to the 64 of the 27B target.
"""

from __future__ import annotations

import time

import torch

from extract.dataset.index import load_samples


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_padded_tokens_per_s(cfg_dict, state, index, loader_rows, token_budget, layers, device) -> dict:
    """HF on length-sorted padded batches of ~token_budget tokens (rows x max_len), with attention_mask."""
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    sub = dict(cfg_dict, num_hidden_layers=layers, layer_types=cfg_dict["layer_types"][:layers])
    hf_cfg = Qwen3_5TextConfig(**{k: v for k, v in sub.items() if k not in ("architectures", "model_type", "dtype")})
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = Qwen3_5TextModel(hf_cfg)
    # Same weights as ours; the final norm (never reached by our taps) is zero-centred: zeros.
    params = {
        n: state[n] if n in state else torch.zeros(p.shape, dtype=torch.bfloat16, device=device)
        for n, p in hf.named_parameters()
    }
    hf.load_state_dict(params, strict=True, assign=True)
    hf.rotary_emb = type(hf.rotary_emb)(hf_cfg).to(device)
    hf = hf.eval()
    samples = sorted(load_samples(index, loader_rows), key=len)
    batches, cur = [], []
    for s in samples:  # rows of equal padded length until the padded batch reaches the budget
        if cur and (len(cur) + 1) * len(s) > token_budget:
            batches.append(cur)
            cur = []
        cur.append(s)
    if cur:
        batches.append(cur)
    real = padded = 0
    synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i, rows in enumerate(batches):
            width = max(len(s) for s in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, s in enumerate(rows):
                ids[r, : len(s)] = torch.from_numpy(s.input_ids)
                mask[r, : len(s)] = 1
            hf(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True, use_cache=False)
            if i == 0:  # first batch: autotune and allocator warm-up, not timed
                synchronize(device)
                t0 = time.perf_counter()
                continue
            real += sum(len(s) for s in rows)
            padded += ids.numel()
    synchronize(device)
    seconds = time.perf_counter() - t0
    del hf
    return {
        "hf_layers": layers,
        "hf_real_tokens_per_s_full_depth": real / seconds * layers / 64,
        "hf_fill": real / max(padded, 1),
        "hf_batches_timed": len(batches) - 1,
    }
