"""Per-op kernel choice for the target's forward, made once at start-up and announced.

Kept whole (~460 lines): the choice (`select_kernels` and the probes behind it), its record
(`KernelChoice`) and the dispatch it drives (KernelChoice's ops and per-batch `prepare`) are one
decision, each backend named in all three; apart, no part reads without the others open.

Three ops need sequence-boundary-aware kernels over packed batches:
  gated delta rule   fla-core `chunk_gated_delta_rule` (varlen cu_seqlens, native GVA) | torch chunked
  causal conv1d      Dao `causal_conv1d_fn` (seq_idx) | fla Triton `causal_conv1d` (cu_seqlens) | torch
  attention          torch varlen flash attention (`torch.nn.attention.varlen`) | fla `parallel_attn` |
                     per-sequence SDPA
`select_kernels` picks the fastest available backend per op and logs one line per op naming the
backend and why (plus one for the pointwise ops: eager, or fused by torch.compile on CUDA). On CUDA a torch fallback raises (naming the op and the missing package) unless
`allow_slow_kernels=True`: a silent fallback once cost 48 of 64 layers their fast path.
fla and causal_conv1d are imported lazily: they need triton and a GPU.

`KernelChoice.prepare(cu_seqlens_S1, num_tokens)` turns a shard's cu_seqlens (padded by repeating
the total, possibly ending before the padded tail) into `VarlenBatch`: deduplicated boundaries,
the padded tail as one more (isolated) sequence, host copies and the per-batch index tensors the
kernels want. It is the one host sync of a forward; every layer then reuses the same objects
(fla memoises some indices on the identity of the cu_seqlens tensor).

Legend: T packed tokens, S sequences (+1 boundaries), E conv channels, W conv width,
M q/k heads (GDN) or kv heads (attention), H value heads (GDN) or query heads (attention),
K/V/D head dims.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from extract.target.fp8 import kernels as fp8_kernels
from extract.target.gated_delta import chunk_gated_delta_rule_torch

logger = logging.getLogger(__name__)

GDN_BACKENDS = ("fla", "torch")
CONV_BACKENDS = ("causal_conv1d", "fla", "torch")
ATTENTION_BACKENDS = ("torch_varlen", "fla", "sdpa")
HALF_DTYPES = (torch.float16, torch.bfloat16)  # what the flash attention backends accept
FLA_CHUNK_SIZE = 64  # chunk_gated_delta_rule's default chunk; chunk_indices are built for it


@dataclasses.dataclass(frozen=True)
class VarlenBatch:
    """Sequence boundaries of one packed batch, prepared once and shared by every layer."""

    cu_seqlens: torch.Tensor  # [S+1] int32 on the compute device, strictly increasing, ends at T
    cu_seqlens_cpu: torch.Tensor  # [S+1] int64 on the host, same values
    max_seqlen: int  # longest sequence, for varlen flash attention
    seq_idx: torch.Tensor | None  # [1, T] int32 sequence id per token, for Dao's causal_conv1d
    chunk_indices: torch.Tensor | None  # fla's (sequence, chunk) table for 64-token chunks

    @property
    def bounds(self) -> list[int]:
        return self.cu_seqlens_cpu.tolist()


@dataclasses.dataclass(kw_only=True)
class KernelChoice:
    """The backend of each op and the reason it was chosen."""

    gated_delta_backend: str  # one of GDN_BACKENDS
    conv_backend: str  # one of CONV_BACKENDS
    attention_backend: str  # one of ATTENTION_BACKENDS
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)  # op -> why this backend
    attention_expand_kv: bool = False  # varlen flash without GQA support: repeat kv heads first
    compile_pointwise: bool = False  # fuse norms, gates, RoPE and silu-mul with torch.compile
    fp8_feed_kernels: bool = False  # --compute fp8: the ops feeding FP8 matmuls as Triton kernels
    _fns: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for field, allowed in (
            ("gated_delta_backend", GDN_BACKENDS),
            ("conv_backend", CONV_BACKENDS),
            ("attention_backend", ATTENTION_BACKENDS),
        ):
            if getattr(self, field) not in allowed:
                raise ValueError(f"KernelChoice.{field}={getattr(self, field)!r}, expected one of {allowed}")

    def log_lines(self) -> list[str]:
        return [
            f"kernel gated_delta_rule: {self.gated_delta_backend} ({self.reasons.get('gated_delta', '')})",
            f"kernel causal_conv1d: {self.conv_backend} ({self.reasons.get('conv', '')})",
            f"kernel attention: {self.attention_backend} ({self.reasons.get('attention', '')})"
            + (
                ""
                if self.attention_backend == "sdpa"
                else "; float32 inputs: per-sequence SDPA (flash takes fp16/bf16)"
            ),
            f"kernel pointwise: {'torch.compile' if self.compile_pointwise else 'eager'} "
            f"({self.reasons.get('pointwise', '')})",
        ]

    def fp8_feeds_line(self) -> str:
        """The kernels feeding FP8 matmuls: announced when --compute fp8 switches them on, never otherwise."""
        return (
            f"kernel fp8 feeds: "
            f"{'triton, norm/silu-mul and per-token e4m3 quantisation in one read' if self.fp8_feed_kernels else 'the pointwise functions'} "
            f"({self.reasons.get('fp8_feeds', '')})"
        )

    # ---- per-batch preparation ---------------------------------------------------------
    def prepare(self, cu_seqlens_S1: torch.Tensor, num_tokens: int, device: torch.device) -> VarlenBatch:
        """One host sync: normalise boundaries and build what the chosen kernels index by."""
        cu_cpu = cu_seqlens_S1.detach().to("cpu", torch.int64)
        if cu_cpu.ndim != 1 or cu_cpu.numel() < 2 or int(cu_cpu[0]) != 0:
            raise ValueError(f"cu_seqlens must be 1-D, start at 0 and have >= 2 entries, found {cu_cpu.tolist()[:8]}")
        if bool((cu_cpu[1:] < cu_cpu[:-1]).any()) or int(cu_cpu[-1]) > num_tokens:
            raise ValueError(
                f"cu_seqlens must be non-decreasing and end at <= {num_tokens} tokens, found {cu_cpu.tolist()[:8]}..."
            )
        # A shard pads cu_seqlens by repeating the total: drop empty sequences; the padded tail of
        # the batch becomes one more sequence so every kernel sees boundaries that end at T.
        cu_cpu = torch.unique_consecutive(cu_cpu)
        if int(cu_cpu[-1]) < num_tokens:
            cu_cpu = torch.cat([cu_cpu, torch.tensor([num_tokens])])
        lens_cpu = cu_cpu[1:] - cu_cpu[:-1]
        cu_dev = cu_cpu.to(device=device, dtype=torch.int32, non_blocking=False)
        seq_idx = None
        if self.conv_backend == "causal_conv1d":
            seq_idx = (
                torch.repeat_interleave(torch.arange(lens_cpu.numel(), dtype=torch.int32), lens_cpu)
                .to(device)
                .unsqueeze(0)
            )
        chunk_indices = None
        if self.gated_delta_backend == "fla" and "fla_chunk_indices" in self._fns:
            chunk_indices = self._fns["fla_chunk_indices"](cu_dev, FLA_CHUNK_SIZE, cu_seqlens_cpu=cu_cpu)
        return VarlenBatch(
            cu_seqlens=cu_dev,
            cu_seqlens_cpu=cu_cpu,
            max_seqlen=int(lens_cpu.max()),
            seq_idx=seq_idx,
            chunk_indices=chunk_indices,
        )

    # ---- ops ------------------------------------------------------------------------------
    def gated_delta_rule(self, q_TMK, k_TMK, v_THV, g_TH, beta_TH, batch: VarlenBatch) -> torch.Tensor:
        """o_THV of the gated delta rule; q/k raw (l2norm and K^-0.5 inside), g fp32 log-decay."""
        if self.gated_delta_backend == "torch":
            return chunk_gated_delta_rule_torch(q_TMK, k_TMK, v_THV, g_TH, beta_TH, batch.bounds)
        o_1THV, _ = self._fns["fla_gdn"](
            q_TMK.unsqueeze(0),
            k_TMK.unsqueeze(0),
            v_THV.unsqueeze(0),
            g=g_TH.unsqueeze(0),
            beta=beta_TH.unsqueeze(0),
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=batch.cu_seqlens,
            cu_seqlens_cpu=batch.cu_seqlens_cpu,
            chunk_indices=batch.chunk_indices,
        )
        return o_1THV.squeeze(0)

    def conv1d_silu(self, x_TE: torch.Tensor, weight_EW: torch.Tensor, batch: VarlenBatch) -> torch.Tensor:
        """silu(depthwise causal conv) with zero history at every sequence start."""
        if self.conv_backend == "causal_conv1d":
            # Channel-last [1, E, T] view (stride(1) == 1) is what seq_idx requires; no copy.
            y_1ET = self._fns["dao_conv"](
                x_TE.unsqueeze(0).transpose(1, 2), weight_EW, None, seq_idx=batch.seq_idx, activation="silu"
            )
            return y_1ET.transpose(1, 2).squeeze(0)
        if self.conv_backend == "fla":
            y_1TE, _ = self._fns["fla_conv"](
                x_TE.unsqueeze(0),
                weight_EW,
                activation="silu",
                cu_seqlens=batch.cu_seqlens,
                cu_seqlens_cpu=batch.cu_seqlens_cpu,
            )
            return y_1TE.squeeze(0)
        return causal_conv1d_silu_torch(x_TE, weight_EW, batch.cu_seqlens)

    def attention(self, q_THD, k_TMD, v_TMD, batch: VarlenBatch, scale: float) -> torch.Tensor:
        """Causal GQA attention within each packed sequence; query head h reads kv head h // (H/M).

        float32 inputs (--dtype float32, fp32 reference models) take per-sequence SDPA whatever the
        backend: torch's varlen flash refuses them ("FlashAttention only support fp16 and bf16")."""
        if q_THD.dtype not in HALF_DTYPES and self.attention_backend != "sdpa":
            return sdpa_per_sequence(q_THD, k_TMD, v_TMD, batch.bounds, scale)
        if self.attention_backend == "torch_varlen":
            if self.attention_expand_kv:
                ratio = q_THD.shape[1] // k_TMD.shape[1]
                k_TMD = k_TMD.repeat_interleave(ratio, dim=1)
                v_TMD = v_TMD.repeat_interleave(ratio, dim=1)
            return self._fns["varlen"](q_THD, k_TMD, v_TMD, batch.cu_seqlens, batch.max_seqlen, scale)
        if self.attention_backend == "fla":
            o_1THD = self._fns["fla_attn"](
                q_THD.unsqueeze(0), k_TMD.unsqueeze(0), v_TMD.unsqueeze(0), scale=scale, cu_seqlens=batch.cu_seqlens
            )
            return o_1THD.squeeze(0)
        return sdpa_per_sequence(q_THD, k_TMD, v_TMD, batch.bounds, scale)


# ---- torch reference ops (CPU, tests, and the refused-by-default CUDA fallback) ----------------
def causal_conv1d_silu_torch(x_TE: torch.Tensor, weight_EW: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """y[t] = silu(sum_j w[:, j] * x[t - (W-1) + j]), taps before the sequence start read zero."""
    T, _ = x_TE.shape
    W = weight_EW.shape[1]
    lens_S = cu_seqlens[1:] - cu_seqlens[:-1]
    starts_T = torch.repeat_interleave(cu_seqlens[:-1].long(), lens_S.long(), output_size=T)
    pos_T = torch.arange(T, device=x_TE.device) - starts_T  # position within its sequence
    x32_TE = x_TE.float()
    y_TE = x32_TE * weight_EW[:, W - 1].float()
    for shift in range(1, W):
        shifted_TE = F.pad(x32_TE, (0, 0, shift, 0))[:T]
        keep_T1 = (pos_T >= shift).unsqueeze(1)
        y_TE = y_TE + torch.where(keep_T1, shifted_TE, 0.0) * weight_EW[:, W - 1 - shift].float()
    return F.silu(y_TE).to(x_TE.dtype)


def sdpa_per_sequence(q_THD, k_TMD, v_TMD, bounds: list[int], scale: float) -> torch.Tensor:
    out_THD = torch.empty_like(q_THD)
    gqa = q_THD.shape[1] != k_TMD.shape[1]
    for bos, eos in zip(bounds[:-1], bounds[1:]):
        q_1HLD, k_1MLD, v_1MLD = (x[bos:eos].transpose(0, 1).unsqueeze(0) for x in (q_THD, k_TMD, v_TMD))
        o_1HLD = F.scaled_dot_product_attention(q_1HLD, k_1MLD, v_1MLD, is_causal=True, scale=scale, enable_gqa=gqa)
        out_THD[bos:eos] = o_1HLD.squeeze(0).transpose(0, 1)
    return out_THD


# ---- selection --------------------------------------------------------------------------------
class SlowKernelError(RuntimeError):
    """A torch fallback was about to run on CUDA without allow_slow_kernels."""


def select_kernels(
    device: torch.device | str,
    *,
    allow_slow_kernels: bool = False,
    gated_delta: str | None = None,
    conv: str | None = None,
    attention: str | None = None,
    compile_pointwise: bool | None = None,
    fp8_feed_kernels: bool | None = None,
) -> KernelChoice:
    """Pick a backend per op (or use the forced ones), log one line per op, refuse slow CUDA paths.

    compile_pointwise: fuse the pointwise ops (norms, gates, RoPE, silu-mul) with torch.compile;
    None = on CUDA only (compiling costs start-up time and buys nothing on the CPU test path).
    fp8_feed_kernels: the Triton kernels of extract/target/fp8/kernels.py for the ops feeding FP8 matmuls;
    None = on CUDA when triton imports (on CPU they run only under Triton's interpreter, for tests).
    """
    device = torch.device(device)
    fns: dict[str, Callable[..., Any]] = {}
    reasons: dict[str, str] = {}
    on_cuda = device.type == "cuda"

    gdn, reasons["gated_delta"] = _pick_gdn(on_cuda, gated_delta, fns)
    cv, reasons["conv"] = _pick_conv(on_cuda, conv, fns)
    att, reasons["attention"], expand = _pick_attention(on_cuda, attention, fns, device)
    if compile_pointwise is None:
        compile_pointwise = on_cuda
        reasons["pointwise"] = "default on CUDA: one fused kernel per norm/gate" if on_cuda else "default off the GPU"
    else:
        reasons["pointwise"] = "set by caller"
    if fp8_feed_kernels is None:
        fp8_feed_kernels = on_cuda and fp8_kernels.available()
        reasons["fp8_feeds"] = (
            "default on CUDA with triton"
            if fp8_feed_kernels
            else ("triton is not installed" if on_cuda else "default off the GPU")
        )
    else:
        reasons["fp8_feeds"] = "set by caller"
    choice = KernelChoice(
        gated_delta_backend=gdn,
        conv_backend=cv,
        attention_backend=att,
        reasons=reasons,
        attention_expand_kv=expand,
        compile_pointwise=compile_pointwise,
        fp8_feed_kernels=fp8_feed_kernels,
        _fns=fns,
    )
    for line in choice.log_lines():
        logger.info(line)
    if on_cuda and not allow_slow_kernels:
        slow = {
            op: key
            for op, key, name in (
                ("gated_delta_rule", "gated_delta", gdn),
                ("causal_conv1d", "conv", cv),
                ("attention", "attention", att),
            )
            if name in ("torch", "sdpa")
        }
        if slow:
            detail = "; ".join(f"{op}: {reasons[key]}" for op, key in slow.items())
            raise SlowKernelError(
                f"slow torch fallback on CUDA for {sorted(slow)} ({detail}); install the fast kernels "
                f"(pip install 'fla-core>=0.6.0' causal-conv1d) or pass --allow-slow-kernels"
            )
    return choice


def _import_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def _choice_without_import(
    op: str, forced: str | None, backends: tuple[str, ...], fallback: str, on_cuda: bool, off_gpu: str
) -> tuple[str, str] | None:
    """The choices every op makes before importing a fast kernel: a name outside `backends` is refused,
    the torch `fallback` is taken when forced or off the GPU (where forcing a GPU kernel is refused).
    None: try the fast kernels."""
    if forced is not None and forced not in backends:
        raise ValueError(f"{op} backend {forced!r}, expected one of {backends}")
    if forced == fallback:
        return fallback, "forced by caller"
    if not on_cuda:
        if forced is not None:
            raise ValueError(f"{op} backend {forced!r} needs a CUDA device")
        return fallback, off_gpu
    return None


def _refuse_if_forced(op: str, backend: str, forced: str | None, exc: BaseException, problem: str) -> None:
    """A fast kernel failed to import or run: an error if the caller forced it, else the next one is tried."""
    if forced == backend:
        raise RuntimeError(f"{op} backend {backend!r} forced but {problem}: {_import_error(exc)}") from exc


def _pick_gdn(on_cuda: bool, forced: str | None, fns: dict) -> tuple[str, str]:
    off_gpu = "device is not CUDA: pure-torch chunked rule"
    chosen = _choice_without_import("gated_delta", forced, GDN_BACKENDS, "torch", on_cuda, off_gpu)
    if chosen is not None:
        return chosen
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # fla raises ImportError, or RuntimeError from triton without a driver
        _refuse_if_forced("gated_delta", "fla", forced, exc, "fla-core is not importable")
        return "torch", f"fla-core not importable ({_import_error(exc)}): pure-torch chunked rule"
    fns["fla_gdn"] = chunk_gated_delta_rule
    try:
        from fla.ops.utils.index import prepare_chunk_indices

        fns["fla_chunk_indices"] = prepare_chunk_indices
    except ImportError:
        pass  # older fla: the kernel derives chunk indices from cu_seqlens_cpu itself
    return "fla", f"fla-core {_version('fla-core', 'fla')} chunk_gated_delta_rule, varlen cu_seqlens, native GVA"


def _pick_conv(on_cuda: bool, forced: str | None, fns: dict) -> tuple[str, str]:
    off_gpu = "device is not CUDA: torch shifted-sum conv with sequence-start masks"
    chosen = _choice_without_import("conv", forced, CONV_BACKENDS, "torch", on_cuda, off_gpu)
    if chosen is not None:
        return chosen
    why_not = []
    if forced in (None, "causal_conv1d"):
        try:
            from causal_conv1d import causal_conv1d_fn

            fns["dao_conv"] = causal_conv1d_fn
            return (
                "causal_conv1d",
                f"causal-conv1d {_version('causal-conv1d', 'causal_conv1d')} causal_conv1d_fn with seq_idx",
            )
        except Exception as exc:
            _refuse_if_forced("conv", "causal_conv1d", forced, exc, "not importable")
            why_not.append(f"causal-conv1d not importable ({_import_error(exc)})")
    try:
        try:
            from fla.modules.causal_conv1d import causal_conv1d as fla_conv
        except ImportError:
            from fla.modules.convolution import causal_conv1d as fla_conv  # fla 0.5 layout
        fns["fla_conv"] = fla_conv
        return "fla", "; ".join(why_not + ["fla Triton causal_conv1d with cu_seqlens"])
    except Exception as exc:
        _refuse_if_forced("conv", "fla", forced, exc, "fla-core is not importable")
        why_not.append(f"fla-core not importable ({_import_error(exc)})")
    return "torch", "; ".join(why_not + ["torch shifted-sum conv"])


def _pick_attention(on_cuda: bool, forced: str | None, fns: dict, device: torch.device) -> tuple[str, str, bool]:
    off_gpu = "device is not CUDA: per-sequence SDPA"
    chosen = _choice_without_import("attention", forced, ATTENTION_BACKENDS, "sdpa", on_cuda, off_gpu)
    if chosen is not None:
        return *chosen, False  # kv heads are expanded only for torch varlen
    why_not = []
    if forced in (None, "torch_varlen"):
        try:
            fn = _torch_varlen_fn()
            expand = not _varlen_gqa_works(fn, device)
            fns["varlen"] = fn
            how = "kv heads expanded (native GQA check failed)" if expand else "native GQA"
            return "torch_varlen", f"torch {torch.__version__} nn.attention.varlen flash, causal, {how}", expand
        except Exception as exc:
            _refuse_if_forced("attention", "torch_varlen", forced, exc, "unusable")
            why_not.append(f"torch varlen attention unusable ({_import_error(exc)})")
    try:
        from fla.ops.attn import parallel_attn

        fns["fla_attn"] = parallel_attn
        return "fla", "; ".join(why_not + ["fla Triton parallel_attn with cu_seqlens, native GQA"]), False
    except Exception as exc:
        _refuse_if_forced("attention", "fla", forced, exc, "fla-core is not importable")
        why_not.append(f"fla-core not importable ({_import_error(exc)})")
    return "sdpa", "; ".join(why_not + ["per-sequence SDPA"]), False


def _torch_varlen_fn() -> Callable[..., torch.Tensor]:
    """Adapt torch.nn.attention.varlen.varlen_attn across 2.10 (is_causal) and 2.11+ (window_size)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    extra: dict[str, Any] = {}
    if "window_size" in params:
        extra["window_size"] = (-1, 0)  # (-1, 0) is causal in the window_size API
    elif "is_causal" in params:
        extra["is_causal"] = True
    else:
        raise RuntimeError(f"varlen_attn has neither window_size nor is_causal: {list(params)}")
    if "enable_gqa" in params:
        extra["enable_gqa"] = True
    has_scale = "scale" in params

    def run(q_THD, k_TMD, v_TMD, cu_seqlens, max_seqlen, scale):
        kw = dict(extra)
        if has_scale:
            kw["scale"] = scale
        elif abs(scale - q_THD.shape[-1] ** -0.5) > 1e-12:
            raise RuntimeError("this torch's varlen_attn takes no scale and the model needs a non-default one")
        return varlen_attn(q_THD, k_TMD, v_TMD, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kw)

    return run


def _varlen_gqa_works(fn: Callable[..., torch.Tensor], device: torch.device) -> bool:
    """Run a 2-sequence GQA case against per-sequence SDPA; False means: expand kv heads."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(48, 4, 64, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(48, 2, 64, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(48, 2, 64, generator=gen).to(device, torch.bfloat16)
    cu = torch.tensor([0, 20, 48], dtype=torch.int32, device=device)
    ref = sdpa_per_sequence(q.float(), k.float(), v.float(), [0, 20, 48], 0.125)
    try:
        out = fn(q, k, v, cu, 28, 0.125)
        if (out.float() - ref).abs().max().item() <= 5e-2:
            return True
        logger.info("varlen attention with fewer kv heads disagrees with SDPA; kv heads will be expanded")
    except Exception as exc:
        logger.info("varlen attention with fewer kv heads failed (%s); kv heads will be expanded", _import_error(exc))
    out = fn(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), cu, 28, 0.125)
    if (out.float() - ref).abs().max().item() > 5e-2:
        raise RuntimeError("varlen attention disagrees with per-sequence SDPA even with expanded kv heads")
    return False


def _version(dist: str, module: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        mod = __import__(module)
        return str(getattr(mod, "__version__", "unknown"))
