"""The frozen target: a Qwen3.5-style hybrid text decoder over packed sequences (inference only).

What is unusual about this model (exact math: shared/reference/qwen35-target.md section 2; the
pointwise math: extract/target/ops.py):
- Two kinds of layer in a 3:1 layout: GatedDeltaNet (linear attention with a gated delta-rule
  state) and gated full attention; both pre-norm, each followed by a SwiGLU MLP.
- Every RMSNorm is zero-centred, y = norm(x) * (1 + w), computed in fp32, except the GatedDeltaNet
  output norm: plain w, norm first, then a silu(z) gate.
- Full attention: q_proj rows are per head [q_h | gate_h]; q/k RMSNorm per head before RoPE; RoPE
  (NeoX rotate-half) on the first rotary_dim dims only; output * sigmoid(gate) before o_proj.
- GatedDeltaNet: one causal depthwise conv + silu over [q | k | v] channels; value head h reads
  q/k head h // ratio; log-decay g = -exp(A_log) * softplus(a + dt_bias) in fp32.
The layers run their pointwise ops through one shared `Pointwise` table (extract/target/pointwise.py:
fused by torch.compile on CUDA, FP8 twins under --compute fp8) and their linear layers through
`linear` / `grouped_linears` (extract/target/fp8/linear.py: dense, or e4m3 after use_fp8_compute).
Packed batches: tokens of several sequences lie end to end; `cu_seqlens` marks the boundaries and
every op (conv, recurrence, attention) restarts at each one; position ids restart at 0.

Memory-traffic cuts (`ForwardOptions`, extract/target/options.py; all on by default, each switchable
so one benchmark run can measure it): the MLP's residual add runs inside the next layer's input norm;
the GatedDeltaNet conv runs per q / k / v group, so fla's kernel gets contiguous inputs and copies
nothing; under FP8 compute, linear layers that read the same input are one matmul (`LINEAR_GROUPS`).

Public API: `TargetModel.from_pretrained`, `forward_packed`, `topk_next_tokens`.
Parameter names equal HF's text-model names (model.language_model.* or model.* stripped), so
the checkpoint mapping is one prefix (extract/target/checkpoint.py).

Legend: T packed tokens, H hidden size, K taps, E conv channels (q|k|v), W conv width,
Mk GDN q/k heads, Mv GDN value heads, Dk/Dv GDN head dims, Nq/Nkv attention heads, D attention
head dim, R rotary dims, F MLP width, V vocab, Kt stored target top-k.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from torch import nn

from extract.target import ops
from extract.target.config import TargetConfig
from extract.target.fp8.linear import (
    BLOCKWISE_TOKEN_MULTIPLE,
    Fp8Input,
    check_blockwise_device,
    check_fp8_compute,
    convert_linears,
    fp8_kernel_report,
    fp8_weight_names,
    grouped_linears,
    linear,
)
from extract.target.fp8.quantization import Fp8BlockFormat
from extract.target.kernels import KernelChoice, VarlenBatch, select_kernels
from extract.target.options import ForwardOptions
from extract.target.pointwise import Pointwise

logger = logging.getLogger(__name__)


class ZeroCentredRMSNorm(nn.Module):
    """Holds w of y = x / rms(x) * (1 + w) (weight initialised to zeros in HF)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps


class GatedRMSNorm(ZeroCentredRMSNorm):
    """Holds the plain weight of the GatedDeltaNet output norm (initialised to ones in HF)."""


class GatedDeltaNet(nn.Module):
    # Linear layers reading the normed input: q|k|v|z on FP8 (one matmul under concat_linears), b|a
    # dense (they feed beta and the decay: 0.6% of the FLOPs) and one matmul of 2 Mv rows.
    LINEAR_GROUPS = {"qkvz": ("in_proj_qkv", "in_proj_z"), "ba": ("in_proj_b", "in_proj_a")}

    def __init__(self, cfg: TargetConfig, kernels: KernelChoice, pw: Pointwise, options: ForwardOptions):
        super().__init__()
        H, E = cfg.hidden_size, cfg.linear_conv_dim
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernels, self.pw, self.options = kernels, pw, options
        self.in_proj_qkv = nn.Linear(H, E, bias=False)
        self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(H, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(H, self.num_v_heads, bias=False)
        self.conv1d = nn.Module()  # HF names the depthwise conv weight conv1d.weight [E, 1, W]
        self.conv1d.weight = nn.Parameter(torch.empty(E, 1, cfg.linear_conv_kernel_dim), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)

    def forward(self, x_TH: torch.Tensor | Fp8Input, batch: VarlenBatch) -> torch.Tensor:
        T = x_TH.x8_TX.shape[0] if isinstance(x_TH, Fp8Input) else x_TH.shape[0]
        qkv_TE, z_TV = grouped_linears(self, "qkvz", x_TH, self.options)
        sizes = [self.key_dim, self.key_dim, self.value_dim]
        conv_EW = self.conv1d.weight.squeeze(1)
        if self.options.split_conv:  # the conv is depthwise: per channel group it is the same op
            q_TC, k_TC, v_TC = (
                self.kernels.conv1d_silu(x_TC, w_CW, batch)
                for x_TC, w_CW in zip(torch.split(qkv_TE, sizes, dim=-1), torch.split(conv_EW, sizes, dim=0))
            )
        else:
            q_TC, k_TC, v_TC = torch.split(self.kernels.conv1d_silu(qkv_TE, conv_EW, batch), sizes, dim=-1)
        q_TMK = q_TC.view(T, self.num_k_heads, self.head_k_dim)
        k_TMK = k_TC.view(T, self.num_k_heads, self.head_k_dim)
        v_TMV = v_TC.view(T, self.num_v_heads, self.head_v_dim)
        b_TM, a_TM = grouped_linears(self, "ba", x_TH, self.options)
        beta_TM, g_TM = self.pw.gdn_gates(b_TM, a_TM, self.A_log, self.dt_bias)
        o_TMV = self.kernels.gated_delta_rule(q_TMK, k_TMK, v_TMV, g_TM, beta_TM, batch)
        z_TMV = z_TV.view(T, self.num_v_heads, self.head_v_dim)
        y_TMV = self.pw.feed("gated_rmsnorm", o_TMV.to(z_TMV.dtype), z_TMV, self.norm.weight, self.norm.eps)
        return linear(self.out_proj, y_TMV if isinstance(y_TMV, Fp8Input) else y_TMV.reshape(T, self.value_dim))


class GatedAttention(nn.Module):
    LINEAR_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: TargetConfig, kernels: KernelChoice, pw: Pointwise, options: ForwardOptions):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.scale = D**-0.5  # tied to the head dim, not the rotary dim
        self.kernels, self.pw, self.options = kernels, pw, options
        self.q_proj = nn.Linear(H, self.num_heads * D * 2, bias=False)  # rows per head: [q_h | gate_h]
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        self.q_norm = ZeroCentredRMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(D, cfg.rms_norm_eps)

    def forward(
        self, x_TH: torch.Tensor | Fp8Input, rope: tuple[torch.Tensor, torch.Tensor], batch: VarlenBatch
    ) -> torch.Tensor:
        T, D = rope[0].shape[0], self.head_dim
        qg_TX, k_TX, v_TX = grouped_linears(self, "qkv", x_TH, self.options)
        qg_TN2D = qg_TX.view(T, self.num_heads, 2 * D)
        q_TND, gate_TND = qg_TN2D[..., :D], qg_TN2D[..., D:]
        k_TMD = k_TX.view(T, self.num_kv_heads, D)
        v_TMD = v_TX.view(T, self.num_kv_heads, D)
        q_TND, k_TMD = self.pw.qk_norm_rope(
            q_TND, k_TMD, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, *rope
        )
        o_TND = self.kernels.attention(q_TND, k_TMD, v_TMD, batch, self.scale)
        o_TX = self.pw.feed("sigmoid_gate", o_TND, gate_TND)
        return linear(self.o_proj, o_TX)


class SwiGLU(nn.Module):
    LINEAR_GROUPS = {"gate_up": ("gate_proj", "up_proj")}

    def __init__(self, cfg: TargetConfig, pw: Pointwise, options: ForwardOptions):
        super().__init__()
        self.pw, self.options = pw, options
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x_TH: torch.Tensor | Fp8Input) -> torch.Tensor:
        gate_TF, up_TF = grouped_linears(self, "gate_up", x_TH, self.options)
        return linear(self.down_proj, self.pw.feed("silu_mul", gate_TF, up_TF))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer_id: int, kernels: KernelChoice, pw: Pointwise, options: ForwardOptions):
        super().__init__()
        self.pw = pw
        self.is_full_attention = cfg.is_full_attention(layer_id)
        if self.is_full_attention:
            self.self_attn = GatedAttention(cfg, kernels, pw, options)
        else:
            self.linear_attn = GatedDeltaNet(cfg, kernels, pw, options)
        self.mlp = SwiGLU(cfg, pw, options)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h_TH: torch.Tensor,
        delta_TH: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: VarlenBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm: h += mixer(norm(h)); h += mlp(norm(h)), with the last add left to the caller:
        the layer's input is h + delta (delta None: h alone) and it returns (h, mlp output), so the
        next layer's input norm does that add in the same pass (ForwardOptions.fuse_residual)."""
        pre, post = self.input_layernorm, self.post_attention_layernorm
        # GatedDeltaNet's dense a/b projections read the normed input too: keep it beside the FP8 copy.
        dense = not self.is_full_attention
        if delta_TH is None:
            x_TH = self.pw.feed("zero_centred_rmsnorm", h_TH, pre.weight, pre.eps, keep_dense=dense)
        else:
            h_TH, x_TH = self.pw.feed("add_zero_centred_rmsnorm", h_TH, delta_TH, pre.weight, pre.eps, keep_dense=dense)
        mixed_TH = self.self_attn(x_TH, rope, batch) if self.is_full_attention else self.linear_attn(x_TH, batch)
        h_TH, x_TH = self.pw.feed("add_zero_centred_rmsnorm", h_TH, mixed_TH, post.weight, post.eps)
        return h_TH, self.mlp(x_TH)


class TargetModel(nn.Module):
    """Layers 0..last_layer of the target (plus final norm and LM head when `with_head`)."""

    def __init__(
        self,
        cfg: TargetConfig,
        kernels: KernelChoice,
        *,
        last_layer: int | None = None,
        with_head: bool = False,
        options: ForwardOptions | None = None,
    ):
        super().__init__()
        last = cfg.num_hidden_layers - 1 if last_layer is None else last_layer
        if not 0 <= last < cfg.num_hidden_layers:
            raise ValueError(f"last_layer={last_layer} is outside 0..{cfg.num_hidden_layers - 1}")
        if with_head and last != cfg.num_hidden_layers - 1:
            raise ValueError(
                f"with_head=True needs every layer (last_layer={last_layer}, model has {cfg.num_hidden_layers})"
            )
        self.config = cfg
        self.kernels = kernels
        self.with_head = with_head
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        # One instance shared by every layer: set_forward_options changes it in place.
        self.options = ForwardOptions() if options is None else dataclasses.replace(options)
        self.pw = Pointwise(kernels.compile_pointwise, kernels.fp8_feed_kernels, self.options)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, kernels, self.pw, self.options) for i in range(last + 1))
        if with_head:
            self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
        kernels: KernelChoice | None = None,
        last_layer: int | None = None,
        with_head: bool = False,
        compute: str = "dense",
    ) -> TargetModel:
        """Build on the meta device, then stream the checkpoint's tensors onto `device` one by one.

        kernels: None selects them for `device` (raising on CUDA when a fast kernel is missing).
        last_layer: the deepest layer to build (usually max(tap_layer_ids)); None = all.
        with_head: also load the final norm and LM head (needed by `topk_next_tokens`).
        compute: "dense", or "fp8" (use_fp8_compute after loading). On an FP8 checkpoint, fp8 keeps
            the FP8_LINEARS weights as stored (e4m3 and block scales, not dequantised) and runs them
            block-scaled; dense dequantises every weight while streaming.
        """
        from extract.target.fp8.quantization import checkpoint_quantization
        from extract.target.weights import load_weights_into

        cfg = TargetConfig.from_dir(path)
        device = torch.device(device)
        if kernels is None:
            kernels = select_kernels(device)
        with torch.device("meta"):
            model = cls(cfg, kernels, last_layer=last_layer, with_head=with_head)
        block = checkpoint_quantization(path) if compute == "fp8" else None
        if block is not None:
            check_blockwise_device(device)  # before any tensor is read
        keep = fp8_weight_names(model) if block is not None else ()
        stored = load_weights_into(model, path, device=device, dtype=dtype, keep_fp8=keep)
        return model.set_compute(compute, block=block, stored=stored).eval()

    @staticmethod
    def check_checkpoint(path: str | Path, *, last_layer: int | None = None, with_head: bool = False) -> None:
        """Refuse, before any work, a checkpoint that from_pretrained(path, last_layer=, with_head=) and
        the cache's target head could not load: every tensor they read must be present with the shape
        config.json implies (safetensors headers only, no tensor data; see check_tensors)."""
        from extract.target.checkpoint import check_tensors

        cfg = TargetConfig.from_dir(path)
        kernels = KernelChoice(gated_delta_backend="torch", conv_backend="torch", attention_backend="sdpa")
        with torch.device("meta"):  # shapes only: nothing is allocated
            model = TargetModel(cfg, kernels, last_layer=last_layer, with_head=with_head)
        expected = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
        # The cache's target_head.safetensors also takes the LM head and the final norm, whatever layers run.
        expected.setdefault("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
        expected.setdefault("norm.weight", (cfg.hidden_size,))
        check_tensors(path, expected, cfg.tie_word_embeddings)

    @classmethod
    def from_state_dict(
        cls,
        cfg: TargetConfig,
        state: dict[str, torch.Tensor],
        kernels: KernelChoice,
        dtype: torch.dtype = torch.bfloat16,
        last_layer: int | None = None,
        with_head: bool = False,
        compute: str = "dense",
    ) -> TargetModel:
        """Build from in-memory tensors named like our parameters (tests, benchmarks); tensors are
        cast to `dtype` on their own device, except A_log and dt_bias which stay fp32."""
        from extract.target.weights import storage_dtype

        with torch.device("meta"):
            model = cls(cfg, kernels, last_layer=last_layer, with_head=with_head)
        wanted = dict(model.named_parameters(remove_duplicate=False))
        if with_head and cfg.tie_word_embeddings and "lm_head.weight" not in state:
            state = {**state, "lm_head.weight": state["embed_tokens.weight"]}
        missing = sorted(set(wanted) - set(state))
        if missing:
            raise KeyError(f"state lacks {len(missing)} parameters, first {missing[:3]}")
        cast = {name: state[name].to(storage_dtype(name, dtype)) for name in wanted}
        model.load_state_dict(cast, strict=True, assign=True)
        return model.requires_grad_(False).set_compute(compute).eval()

    def set_compute(
        self,
        compute: str,
        *,
        block: Fp8BlockFormat | None = None,
        stored: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> TargetModel:
        """ "dense" (as loaded) or "fp8" (use_fp8_compute(block, stored)); announces the linear-layer kernel."""
        if compute == "fp8":
            return self.use_fp8_compute(block=block, stored=stored)
        if compute != "dense":
            raise ValueError(f"compute={compute!r}, expected 'dense' or 'fp8'")
        logger.info("kernel linear: dense matmuls in %s", self.embed_tokens.weight.dtype)
        return self

    def use_fp8_compute(
        self,
        *,
        block: Fp8BlockFormat | None = None,
        stored: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> TargetModel:
        """Put the FP8_LINEARS on e4m3 matmuls, in place (extract/target/fp8/linear.py), their dense copies
        freed; activations are quantised by the pointwise op before them (Pointwise.feed).
        block None (a bf16 checkpoint): rowwise, each weight quantised once with one scale per output
        channel (amax / 448), activations one scale per token. block set (an FP8 checkpoint's format):
        block-scaled, the weights in `stored` (our weight name -> e4m3 and block scales, as the
        checkpoint holds them) kept unchanged, the other FP8_LINEARS quantised into the same blocks,
        activations one scale per token per block.block_k channels. Needs bf16 weights, and on CUDA sm_89+."""
        device = self.embed_tokens.weight.device
        check_fp8_compute(device, self.embed_tokens.weight.dtype, block, stored)
        done = convert_linears(self, block, stored or {})
        self.pw.fp8 = True
        self.pw.fp8_group = 0 if block is None else block.block_k
        for level, line in fp8_kernel_report(done, block, device, self.pw.compiled, self.options.concat_linears):
            logger.log(level, line)
        logger.info(self.kernels.fp8_feeds_line())
        return self

    def set_forward_options(self, options: ForwardOptions) -> TargetModel:
        """Switch the forward's memory-traffic cuts for the next forwards (in place, every layer)."""
        for field in dataclasses.fields(options):
            setattr(self.options, field.name, getattr(options, field.name))
        logger.info("forward options: %s", self.options)
        return self

    # ---- forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_packed(
        self,
        input_ids_T: torch.Tensor,
        position_ids_T: torch.Tensor,
        cu_seqlens_S1: torch.Tensor,
        tap_layer_ids: list[int],
    ) -> torch.Tensor:
        """hidden_TKH[:, j] = output of decoder layer tap_layer_ids[j] (HF hidden_states[j + 1]);
        stops after the deepest tapped layer. cu_seqlens may be padded by repeating the total and
        may end before T (the tail is treated as one more, isolated, sequence)."""
        hidden_TKH, _ = self._run(input_ids_T, position_ids_T, cu_seqlens_S1, tap_layer_ids, to_end=False)
        return hidden_TKH

    @torch.inference_mode()
    def topk_next_tokens(
        self,
        input_ids_T: torch.Tensor,
        position_ids_T: torch.Tensor,
        cu_seqlens_S1: torch.Tensor,
        tap_layer_ids: list[int],
        k: int,
        chunk_tokens: int = 4096,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden_TKH, topk_ids_TKt int32, topk_logprobs_TKt fp32): taps as forward_packed, plus the
        target's top-k next-token log-probs from final norm + LM head, `chunk_tokens` rows at a time
        (a full [T, V] logits tensor is never built)."""
        if not self.with_head:
            raise ValueError("topk_next_tokens needs the LM head: build with from_pretrained(..., with_head=True)")
        if not 0 < k <= self.config.vocab_size:
            raise ValueError(f"top-k k={k} must be in 1..vocab_size={self.config.vocab_size}")
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, found {chunk_tokens}")
        hidden_TKH, last_TH = self._run(input_ids_T, position_ids_T, cu_seqlens_S1, tap_layer_ids, to_end=True)
        T = last_TH.shape[0]
        ids_TKt = torch.empty(T, k, dtype=torch.int32, device=last_TH.device)
        logprobs_TKt = torch.empty(T, k, dtype=torch.float32, device=last_TH.device)
        for start in range(0, T, chunk_tokens):
            rows = slice(start, min(start + chunk_tokens, T))
            logits_cV = self._head_logits(last_TH[rows])
            # log-softmax of the k winners only: one [c, V] temporary instead of two.
            top = torch.topk(logits_cV, k, dim=-1)
            ids_TKt[rows] = top.indices.to(torch.int32)
            logprobs_TKt[rows] = top.values - torch.logsumexp(logits_cV, dim=-1, keepdim=True)
        return hidden_TKH, ids_TKt, logprobs_TKt

    @torch.inference_mode()
    def last_logits(
        self, input_ids_T: torch.Tensor, tap_layer_ids: list[int], num_last: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden_TKH, logits_nV fp32): taps of one sequence as forward_packed, plus the full next-token
        logits after its last `num_last` positions (what sampling at a temperature needs)."""
        if not self.with_head:
            raise ValueError("last_logits needs the LM head: build with from_pretrained(..., with_head=True)")
        T = input_ids_T.shape[0]
        if not 0 < num_last <= T:
            raise ValueError(f"num_last={num_last} must be in 1..{T} (the sequence's length)")
        device = self.embed_tokens.weight.device
        cu = torch.tensor([0, T], dtype=torch.int32, device=device)
        positions_T = torch.arange(T, device=device)
        rows = torch.arange(T - num_last, T, device=device)
        return self.rows_logits(input_ids_T, positions_T, cu, tap_layer_ids, rows)

    @torch.inference_mode()
    def rows_logits(
        self,
        input_ids_T: torch.Tensor,
        position_ids_T: torch.Tensor,
        cu_seqlens_S1: torch.Tensor,
        tap_layer_ids: list[int],
        rows_X: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden_TKH, logits_XV fp32): taps of packed sequences as forward_packed, plus the full next-token
        logits after the positions `rows_X` (several sequences' last positions in one forward)."""
        if not self.with_head:
            raise ValueError("rows_logits needs the LM head: build with from_pretrained(..., with_head=True)")
        hidden_TKH, last_TH = self._run(input_ids_T, position_ids_T, cu_seqlens_S1, tap_layer_ids, to_end=True)
        return hidden_TKH, self._head_logits(last_TH[rows_X])

    def _head_logits(self, last_XH: torch.Tensor) -> torch.Tensor:
        """Next-token logits [X, V] fp32 from the last layer's output: final norm + LM head."""
        return self.lm_head(ops.zero_centred_rmsnorm(last_XH, self.norm.weight, self.norm.eps)).float()

    def _run(self, input_ids_T, position_ids_T, cu_seqlens_S1, tap_layer_ids, to_end: bool):
        taps = [int(i) for i in tap_layer_ids]
        if not taps:
            raise ValueError("tap_layer_ids is empty")
        built = len(self.layers)
        bad = [i for i in taps if not 0 <= i < built]
        if bad:
            raise ValueError(f"tap_layer_ids {bad} outside the built layers 0..{built - 1}")
        if input_ids_T.ndim != 1 or position_ids_T.shape != input_ids_T.shape:
            raise ValueError(
                f"input_ids_T {tuple(input_ids_T.shape)} and position_ids_T {tuple(position_ids_T.shape)} "
                f"must be equal 1-D shapes"
            )
        device = self.embed_tokens.weight.device
        T = input_ids_T.shape[0]
        pad = -T % BLOCKWISE_TOKEN_MULTIPLE if self.pw.fp8_group and device.type == "cuda" else 0
        # Block-scaled FP8 on CUDA: the batch is padded for cuBLAS's blockwise kernel (fp8_linear) once
        # here rather than in every matmul; padding tokens join the batch's isolated tail (kernels.prepare)
        # and are dropped after (all ops are causal: the real tokens never read them).
        if pad:
            input_ids_T = torch.cat([input_ids_T, input_ids_T.new_zeros(pad)])
            position_ids_T = torch.cat(
                [position_ids_T, torch.arange(pad, dtype=position_ids_T.dtype, device=position_ids_T.device)]
            )
            hidden_TKH, h_TH = self._run(input_ids_T, position_ids_T, cu_seqlens_S1, tap_layer_ids, to_end)
            return hidden_TKH[:T], h_TH[:T]
        batch = self.kernels.prepare(cu_seqlens_S1, T, device)
        h_TH = self.embed_tokens(input_ids_T.to(device, non_blocking=True).long())
        rope = ops.rope_cos_sin(position_ids_T.to(device, non_blocking=True), self.config, h_TH.dtype)
        hidden_TKH = torch.empty(T, len(taps), self.config.hidden_size, dtype=h_TH.dtype, device=device)
        stop = built - 1 if to_end else max(taps)
        delta_TH = None  # the last layer's MLP output, not yet added to h (the next input norm adds it)
        for layer_id in range(stop + 1):
            h_TH, delta_TH = self.layers[layer_id](h_TH, delta_TH, rope, batch)
            tapped = [j for j, tap in enumerate(taps) if tap == layer_id]
            if tapped or layer_id == stop or not self.options.fuse_residual:
                h_TH, delta_TH = h_TH + delta_TH, None
            for j in tapped:
                hidden_TKH[:, j] = h_TH
        return hidden_TKH, h_TH
