"""The cache format, version 3: the one place that says what a cache holds.

A cache directory:

    CACHE/
      cache.json                 CacheConfig below (format version, target, taps, shapes, provenance)
      target_head.safetensors    frozen target weights the drafter needs (TARGET_HEAD_TENSORS)
      projection.safetensors     projected caches only: P and D (shards/projection.py)
      shards/b{batch:08d}.safetensors   one packed batch per file, every tensor of fixed shape
      manifest.parquet           one row per sample (manifest.py); rebuildable from the shards

Shard tensors (T = token_budget, K = number of taps, H = target hidden size, S = max_seqs, Kt = target_topk):

    hidden               [T, K, H]   bf16, or fp8 e4m3 with hidden_scale [T, K] fp32 (per token, per tap)
    input_ids            [T]         int32
    position_ids         [T]         int32, the sample's true positions: 0, 1, ... in every whole sequence, the
                                     absolute positions start..end-1 in a piece of a long sample; 0 on padding
    loss_mask            [T]         uint8, 0 on padding
    anchor_mask          [T]         uint8, 1 where a draft block may be anchored as far as piecing goes: every
                                     token of a whole sequence, a piece's own part (PiecesRecord); 0 on padding
    cu_seqlens           [S + 1]     int32, padded by repeating the total of real tokens
    target_topk_ids      [T, Kt]     int32, only when Kt > 0
    target_topk_logprobs [T, Kt]     bf16, only when Kt > 0

A projected cache (cache.json "projection", R = its rank, G its group size) stores, in place of hidden and
hidden_scale, codes z = (P D) concat_k(h_k) of every token:

    codes                [T, R]      bf16, or fp8 e4m3 with code_scale [T, ceil(R / G)] fp32 (per group of G codes)

Shard metadata (safetensors __metadata__, all strings): format_version, batch_id, cache_id (the
CacheConfig.cache_id() of the cache it was written for), storage_dtype, num_tokens, samples, checksum.
samples is a JSON list of [id, offset, length, loss tokens] per sequence, in cu_seqlens order; in a cache
of data in several serving modes (cache.json "chat_modes") each carries a fifth element, the sample's
index into that list. Caches of one mode (or none recorded) keep four elements: still version 3.

Long samples (cache.json "pieces", PiecesRecord): a sample longer than T went through the target whole and
is stored as pieces of T tokens, one per shard, each holding `context` tokens before its own part (the
window a sliding drafter looks back) and `label_reach` after it (the labels of its last blocks); pieces
overlap by context + label_reach and every position is in exactly one piece's own part.

Version history: 3 added projected caches (cache.json "projection", codes in the shards,
projection.safetensors), anchor_mask and the absolute positions of long samples' pieces (cache.json
"pieces"); version 2 caches are read as before (no anchor_mask: every real token may hold an anchor).
2 added cache_id to every shard header, so that a shard copied in from another cache of the same shapes
(other target weights, other data) is refused by name; version 1 caches are refused with the advice to
re-extract.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from shards.common.crc import crc32
from shards.common.errors import UserError
from shards.common.json_input import InputFileError, parse_json
from shards.common.schema import record

FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)  # version 2: no projection, no anchor_mask, no pieces
CACHE_CONFIG_FILE = "cache.json"
TARGET_HEAD_FILE = "target_head.safetensors"
MANIFEST_FILE = "manifest.parquet"
PROJECTION_FILE = "projection.safetensors"
SHARDS_DIR = "shards"
# Precision names: two vocabularies, on purpose.
#   Compute dtypes, what a model runs in (dflash-extract --dtype, dflash-train --compute-dtype, eval --dtype,
#     TargetInfo.dtype, the exported drafter's config.json "dtype"): torch's names, as torch.bfloat16 and
#     HF config.json spell them: "bfloat16", "float16", "float32".
#   Storage encodings of the cached hidden states (dflash-extract --storage, cache.json storage_dtype): the
#     codec's short names "bf16" and "fp8" (codec.py), as "fp8" is no torch dtype (e4m3 values plus a
#     per-token-per-tap fp32 scale), and cache.json keeps the names every existing cache was written with:
#     a renamed value would make old caches refuse to resume (storage_dtype is part of a cache's identity).
# Input takes either spelling of bf16 (and fp16/fp32 for the torch names): canonical_precision, which the
# CLI choices (cli_options) and the configs' __post_init__ apply, so only the canonical name is stored.
StorageDtype = Literal["bf16", "fp8"]
STORAGE_DTYPES = get_args(StorageDtype)
PRECISION_ALIASES = {"bf16": "bfloat16", "bfloat16": "bf16", "fp16": "float16", "fp32": "float32"}
# Names inside target_head.safetensors. lm_head is always present (a copy of embed_tokens when tied).
TARGET_HEAD_TENSORS = ("embed_tokens", "lm_head", "final_norm")
# TargetInfo's fields the drafter export copies (special tokens, context length); not part of a cache's
# identity, so caches written before each was recorded resume.
TARGET_EXPORT_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
# Largest finite float8 e4m3fn value; per-row scales map each row's amax onto it.
FP8_E4M3_MAX = 448.0


def canonical_precision(name: Any, choices: Sequence[str]) -> Any:
    """`name` as `choices` spell it: itself when listed, else its other spelling when that is listed
    (`--storage bfloat16` is bf16, `--dtype bf16` is bfloat16); anything else unchanged, for the caller
    to refuse naming the value as given."""
    if name in choices:
        return name
    other = PRECISION_ALIASES.get(name) if isinstance(name, str) else None
    return other if other in choices else name


class CacheFormatError(UserError, ValueError):
    """A cache file is missing, malformed or inconsistent; the message names the file."""


@dataclass(kw_only=True)
class TargetInfo:
    """What identifies the target model whose hidden states a cache holds."""

    name: str  # the checkpoint directory or model name, for humans
    config_hash: str  # sha256 of the target's text config; equal hashes mean the same architecture
    hidden_size: int  # H, width of every stored hidden state
    num_layers: int  # decoder layers of the full target (taps index into these)
    vocab_size: int  # rows of embed_tokens and lm_head
    dtype: str  # dtype the target ran in, e.g. "bfloat16"
    intermediate_size: int | None = None  # the target's MLP width, which a DFlash drafter copies
    # The checkpoint's weight quantization and how the run used it ("fp8 e4m3, 128x128 blocks (dequantised
    # at load)", or "(kept as stored: ...)" under compute fp8); None = none.
    quantization: str | None = None
    compute: str = "dense"  # the target's linear layers: "dense" (matmuls in `dtype`) or "fp8" (e4m3 matmuls)
    # The target's special token ids from its config.json (None = not declared / older cache); an
    # exported drafter's config.json carries them as the published drafters do.
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # The target's context length (config.json max_position_embeddings), which an exported drafter's
    # config.json carries (vLLM sizes the drafter's RoPE table by it); None = an older cache.
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "vocab_size", "intermediate_size"):
            value = getattr(self, name)
            if value is not None and value < 1:  # shapes are made of them
                raise ValueError(f"{name} must be positive, found {value}")


@dataclass(kw_only=True)
class PackingRecord:
    """How the extraction packed the dataset into shards (cache.json "packing")."""

    algorithm: str  # packing algorithm and version: another one gives other batch ids
    long_seqs: str  # policy for samples longer than token_budget: truncate | skip | error
    num_batches: int  # shards the plan holds: batch ids 0 .. num_batches-1
    padding_efficiency: float  # real tokens / (num_batches * token_budget)
    num_truncated: int  # samples cut to token_budget
    num_skipped: int  # samples longer than token_budget left out (long_seqs skip)
    num_empty: int  # empty samples left out


@dataclass(kw_only=True)
class DatasetRecord:
    """Which dataset a cache was extracted from (cache.json "dataset"): a reordered or edited
    dataset has another fingerprint, so a resume cannot mix two datasets."""

    path: str  # the --data argument (file, directory or glob), or a name for generated data
    fingerprint: str  # hash of the sample ids and lengths in dataset order
    num_samples: int  # non-empty samples scanned
    num_tokens: int  # their tokens, before packing
    # How --data became token rows when it held conversations (dflash-extract renders them with the
    # target's chat template: thinking mode, template and tokenizer digests); None = token rows as given.
    # Like the path, not part of cache_id: the shards equal those of the same tokens prepared beforehand.
    prepared: dict[str, Any] | None = None
    # The longest run of consecutive supervised tokens in the shards (the longest reply a drafter trained
    # on this cache has seen), which `dflash-train eval --target` warns about decoding past; None = a
    # cache written before it was recorded. Derived from the data: not part of cache_id or the identity.
    longest_response: int | None = None


@dataclass(kw_only=True)
class ProjectionRecord:
    """A projected cache (cache.json "projection"): the shards hold codes z = P D h of each token's
    concatenated taps h [K*H]; P [rank, K*H] has orthonormal rows, D is a fixed diagonal scaling, both in
    projection.safetensors (shards/projection.py says how they are made and used)."""

    rank: int  # R: codes per token
    normalize: str  # the scaling D folded in before P: "none" (D = 1) or "per-tap" (1 / rms of each tap)
    group_size: int  # fp8 codes: one fp32 scale per this many consecutive codes (the last group may be shorter)
    sample_tokens: int  # tokens the estimate of P was drawn from, across the whole dataset
    seed: int  # seed of that draw
    # Derived when P is estimated (not settings: a resume compares the settings above, the shards' cache_id
    # names the checksum): checksum() of projection.safetensors' tensors, and the share of the sample's
    # (uncentred, scaled) energy the R components keep.
    checksum: str | None = None
    variance_kept: float | None = None

    def __post_init__(self) -> None:
        if self.normalize not in PROJECTION_NORMALIZE:
            raise ValueError(f"projection.normalize must be one of {PROJECTION_NORMALIZE}, got {self.normalize!r}")
        for name in ("rank", "group_size", "sample_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"projection.{name} must be positive, got {getattr(self, name)}")

    @property
    def num_groups(self) -> int:
        return -(-self.rank // self.group_size)


ProjectionNormalize = Literal["none", "per-tap"]
PROJECTION_NORMALIZE = get_args(ProjectionNormalize)
# ProjectionRecord fields derived from the estimate rather than set by the run.
_PROJECTION_DERIVED = ("checksum", "variance_kept")


@dataclass(kw_only=True)
class PiecesRecord:
    """How samples longer than token_budget were stored (cache.json "pieces"; absent = none were)."""

    max_seq_len: int  # longest sample run through the target whole (longer ones follow long_seqs)
    context: int  # tokens each piece holds before its own part: a sliding drafter's window - 1 fits in it
    label_reach: int  # tokens each piece holds after its own part: labels of a block of label_reach + 1
    num_pieced_samples: int  # samples longer than token_budget stored as pieces
    longest_sample: int  # tokens of the longest sample stored (after any truncation to max_seq_len)


# DatasetRecord fields that describe the dataset without deciding which one it is (the fingerprint does):
# older caches, which lack them, keep their cache_id and resume.
_DATASET_DESCRIPTION = ("prepared", "longest_response")


def _record(cls: type, value: Any, name: str) -> Any:
    """A record from its JSON mapping; None (or the {} older caches wrote) when absent."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be an object with {[f.name for f in dataclasses.fields(cls)]}, got {value!r}")
    if not value:
        return None
    known = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
    if not required <= set(value) <= known:  # fields added later (with a default) may be absent
        raise ValueError(f"{name} has fields {sorted(value)}, expected {sorted(known)}")
    return cls(**value)


@dataclass(kw_only=True)
class CacheConfig:
    """Everything a reader needs to validate and interpret a cache; stored as cache.json."""

    target: TargetInfo
    tap_layer_ids: list[int]  # tap j = output of decoder layer tap_layer_ids[j] (HF hidden_states[j+1])
    token_budget: int  # T: tokens per shard, real plus padding
    max_seqs: int  # S: most sequences packed into one shard
    storage_dtype: str = "bf16"  # "bf16" or "fp8" (e4m3 with a per-token-per-tap fp32 scale)
    target_topk: int = 0  # Kt: the target's top-Kt next-token ids and log-probs stored per position; 0 = none
    mask_token_id: int | None = None  # the drafter's MASK token id, when known at extraction
    pad_token_id: int = 0  # token id written on padding positions
    packing: PackingRecord | None = None  # how the shards were planned; None for generated caches
    dataset: DatasetRecord | None = None  # dataset identity; None for generated caches
    provenance: dict[str, Any] = field(default_factory=dict)  # git sha, versions, argv, time
    # checksum() of target_head.safetensors' tensors: the same architecture with other weights (a
    # fine-tune) has the same config_hash, and its head must not be mixed with this cache's states.
    target_head_checksum: str | None = None
    projection: ProjectionRecord | None = None  # None = the taps themselves are stored (hidden)
    pieces: PiecesRecord | None = None  # how samples longer than token_budget were stored; None = none were
    # The serving mode the data were rendered in (shards/common/chat_mode.py): {"thinking": "on"|"off",
    # "template_kwargs": {...}}; dflash-train eval warns when it is run in another. None = unknown (token
    # rows without a record, caches written before it was recorded). A description: not in the identity.
    chat_mode: dict[str, Any] | None = None
    # Data in more than one mode (rows stating their own, or files prepared in different modes): every mode
    # present, in order of first appearance (None = rows of unknown mode), and chat_mode None. A shard
    # header's sample rows then carry a fifth element, the sample's index into this list.
    chat_modes: list[dict[str, Any] | None] | None = None
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if isinstance(self.target, Mapping):
            self.target = TargetInfo(**self.target)
        self.packing = _record(PackingRecord, self.packing, "packing")
        self.dataset = _record(DatasetRecord, self.dataset, "dataset")
        self.projection = _record(ProjectionRecord, self.projection, "projection")
        width = self.num_taps * self.target.hidden_size
        if self.projection is not None and self.projection.rank >= width:
            raise ValueError(f"projection.rank {self.projection.rank} must be below the taps' width K*H = {width}")
        self.pieces = _record(PiecesRecord, self.pieces, "pieces")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {STORAGE_DTYPES}, got {self.storage_dtype!r}")
        if self.token_budget <= 0:
            raise ValueError(f"token_budget must be positive, got {self.token_budget}")
        if self.max_seqs <= 0:
            raise ValueError(f"max_seqs must be positive, got {self.max_seqs}")
        if self.target_topk < 0:
            raise ValueError(f"target_topk must be >= 0, got {self.target_topk}")
        if self.chat_modes is not None and (len(self.chat_modes) < 2 or self.chat_mode is not None):
            raise ValueError("chat_modes lists two or more modes, and then chat_mode is null")
        if not self.tap_layer_ids:
            raise ValueError("tap_layer_ids must name at least one target layer")
        bad = [i for i in self.tap_layer_ids if not 0 <= i < self.target.num_layers]
        if bad:
            raise ValueError(f"tap_layer_ids {bad} outside the target's {self.target.num_layers} layers")

    @property
    def modes(self) -> list[dict[str, Any] | None]:
        """The modes a sample's mode index points into: chat_modes, else the one chat_mode (None = unknown)."""
        return list(self.chat_modes) if self.chat_modes is not None else [self.chat_mode]

    @property
    def num_taps(self) -> int:
        return len(self.tap_layer_ids)

    @property
    def context_shape(self) -> tuple[int, int]:
        """Per token, what the drafter's fc reads of a shard (codec.decode_context): the taps (K, H), or a
        projected cache's codes as one "tap" (1, R)."""
        if self.projection is not None:
            return 1, self.projection.rank
        return self.num_taps, self.target.hidden_size

    @property
    def planned_batches(self) -> int | None:
        """Shards the extraction planned (batch ids 0..n-1), when cache.json records it."""
        return self.packing.num_batches if self.packing is not None else None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, source: str = CACHE_CONFIG_FILE) -> CacheConfig:
        try:
            raw = parse_json(text, source)
        except InputFileError as e:
            raise CacheFormatError(str(e)) from e
        return cls.from_value(raw, source)

    @classmethod
    def from_value(cls, raw: Any, source: str = CACHE_CONFIG_FILE) -> CacheConfig:
        """The config a parsed cache.json holds: version first (an older cache gets the advice to
        re-extract, not a list of fields), then every field and type (shards/common/schema.py)."""
        if not isinstance(raw, dict):
            raise CacheFormatError(f"{source}: not a JSON object")
        version = raw.get("format_version")
        if version == 1:
            raise CacheFormatError(
                f"{source}: cache format version 1 (shards without a cache identity); this dflash-pipeline "
                f"reads version {FORMAT_VERSION}: re-run dflash-extract into a new --out to rebuild the cache"
            )
        if version not in READABLE_VERSIONS:
            raise CacheFormatError(
                f"{source}: cache format version {version!r:.40}, this dflash-pipeline reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}; re-run dflash-extract with this version to rebuild the cache"
            )
        older = {name: None for name in ("packing", "dataset") if raw.get(name) == {}}  # older caches wrote {}
        try:
            return record(cls, {**raw, **older}, source)
        except InputFileError as e:
            raise CacheFormatError(str(e)) from e

    def identity(self) -> dict[str, Any]:
        """The settings that must match for a resumed extraction to add to this cache."""
        d = dataclasses.asdict(self)
        d.pop("provenance")
        d.pop("chat_mode")  # follows the dataset, whose fingerprint is in the identity already
        d.pop("chat_modes")  # so do these (the fingerprint holds each sample's mode when there are several)
        if d["dataset"] is not None:
            for name in _DATASET_DESCRIPTION:  # how the tokens were made and what they hold, not which
                d["dataset"].pop(name)
        for name in TARGET_EXPORT_FIELDS:  # metadata for export, not the hidden states: older caches resume
            d["target"].pop(name)
        if d["projection"] is None:
            d.pop("projection")  # a cache without one has the identity it had before projections existed
        else:
            for name in _PROJECTION_DERIVED:  # estimated by the run, not chosen: the settings decide a resume
                d["projection"].pop(name)
        return d

    def cache_id(self) -> str:
        """What every shard header names: a digest of everything that decides a shard's content.

        The target's weights (head checksum) and architecture, the dataset's content fingerprint, the
        packing plan (batch count, policy) and the shapes and taps; not paths (a moved cache or target
        is the same cache) nor settings that do not change the bytes (MASK id, provenance). Needs
        target_head_checksum, which create_cache fills in.
        """
        if self.target_head_checksum is None:
            raise ValueError("cache_id needs target_head_checksum: create the cache with create_cache first")
        what = {
            "target_head_checksum": self.target_head_checksum,
            "target_config_hash": self.target.config_hash,
            "target_dtype": self.target.dtype,
            "target_quantization": self.target.quantization,
            "target_compute": self.target.compute,
            "dataset": _dataset_identity(self.dataset),
            "packing": _plain(self.packing),
            "tap_layer_ids": list(self.tap_layer_ids),
            "token_budget": self.token_budget,
            "max_seqs": self.max_seqs,
            "storage_dtype": self.storage_dtype,
            "target_topk": self.target_topk,
            "pad_token_id": self.pad_token_id,
        }
        if self.projection is not None:  # absent otherwise: unprojected caches keep version 2's cache_id
            what["projection"] = _plain(self.projection)
        if self.pieces is not None:  # only then: the caches written before pieces keep their cache_id
            what["pieces"] = _plain(self.pieces)
        digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
        return f"sha256:{digest[:16]}"


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def tensor_specs(cfg: CacheConfig) -> dict[str, TensorSpec]:
    """Name -> fixed shape and dtype of every tensor in one shard of this cache."""
    t, k, h = cfg.token_budget, cfg.num_taps, cfg.target.hidden_size
    specs = {
        "input_ids": TensorSpec((t,), torch.int32),
        "position_ids": TensorSpec((t,), torch.int32),
        "loss_mask": TensorSpec((t,), torch.uint8),
        "cu_seqlens": TensorSpec((cfg.max_seqs + 1,), torch.int32),
    }
    if cfg.format_version >= 3:
        specs["anchor_mask"] = TensorSpec((t,), torch.uint8)
    if cfg.projection is not None:
        r, fp8 = cfg.projection.rank, cfg.storage_dtype == "fp8"
        specs["codes"] = TensorSpec((t, r), torch.float8_e4m3fn if fp8 else torch.bfloat16)
        if fp8:
            specs["code_scale"] = TensorSpec((t, cfg.projection.num_groups), torch.float32)
    elif cfg.storage_dtype == "bf16":
        specs["hidden"] = TensorSpec((t, k, h), torch.bfloat16)
    else:
        specs["hidden"] = TensorSpec((t, k, h), torch.float8_e4m3fn)
        specs["hidden_scale"] = TensorSpec((t, k), torch.float32)
    if cfg.target_topk > 0:
        specs["target_topk_ids"] = TensorSpec((t, cfg.target_topk), torch.int32)
        specs["target_topk_logprobs"] = TensorSpec((t, cfg.target_topk), torch.bfloat16)
    return specs


def target_head_shapes(target: TargetInfo) -> dict[str, tuple[int, ...]]:
    """Shape of each TARGET_HEAD_TENSORS entry for this target: [vocab, hidden] twice, then [hidden]."""
    vocab, hidden = target.vocab_size, target.hidden_size
    return {"embed_tokens": (vocab, hidden), "lm_head": (vocab, hidden), "final_norm": (hidden,)}


def bytes_per_shard(cfg: CacheConfig) -> int:
    return sum(_numel(s.shape) * _itemsize(s.dtype) for s in tensor_specs(cfg).values())


def shard_name(batch_id: int) -> str:
    return f"b{batch_id:08d}.safetensors"


def shard_path(cache_dir: str | Path, batch_id: int) -> Path:
    return Path(cache_dir) / SHARDS_DIR / shard_name(batch_id)


def batch_id_of(path: str | Path) -> int | None:
    """The batch id encoded in a shard file name, or None for any other file."""
    name = Path(path).name
    if len(name) != len(shard_name(0)) or not name.startswith("b") or not name.endswith(".safetensors"):
        return None
    digits = name[1:9]
    return int(digits) if digits.isdigit() else None


def checksum(tensors: Mapping[str, Any]) -> str:
    """crc32 over every tensor's name and raw bytes, in name order.

    zlib's CRC-32 (shards/common/crc.py: ISA-L's when installed, ~9 GB/s), so a 2.5 GB shard costs about
    0.3 s in the writer thread, and it catches any flipped byte or truncation of the data section.
    """
    crc = 0
    for name in sorted(tensors):
        crc = crc32(name.encode(), crc)
        crc = crc32(raw_bytes(tensors[name]), crc)
    return f"crc32:{crc:08x}"


def raw_bytes(t: Any) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (or anything with the buffer protocol)."""
    if isinstance(t, torch.Tensor):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("raw_bytes needs a contiguous CPU tensor")
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())
    return memoryview(t).cast("B")


def _plain(record: Any) -> dict[str, Any]:
    """A record (dataclass, dict or None) as a plain dict."""
    if record is None:
        return {}
    return dataclasses.asdict(record) if dataclasses.is_dataclass(record) else dict(record)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dataset_identity(dataset: DatasetRecord | None) -> dict[str, Any]:
    """The dataset fields that decide a shard's bytes: not where the data lie nor how they were tokenised."""
    return {k: v for k, v in _plain(dataset).items() if k not in ("path", *_DATASET_DESCRIPTION)}
