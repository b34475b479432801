"""Reading a cache: validated, memory-mapped shards handed back as fixed-shape tensors.

Every check raises ShardError (a CacheFormatError) whose message starts with the file's path, so a
user can find the bad file; `verify` collects those messages for a whole cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shards.common.json_input import InputFileError, json_type, parse_json, read_json
from shards.container import MAX_HEADER_BYTES, MappedContainer, read_header
from shards.format import (
    CACHE_CONFIG_FILE,
    SHARDS_DIR,
    TARGET_HEAD_FILE,
    TARGET_HEAD_TENSORS,
    CacheConfig,
    CacheFormatError,
    batch_id_of,
    checksum,
    shard_path,
    tensor_specs,
)
from shards.sample_ids import sample_id_problem
from shards.writer import SampleEntry


class ShardError(CacheFormatError):
    """One shard is unreadable or inconsistent with cache.json."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class ForeignShardError(ShardError):
    """A shard whose header names another cache: never this cache's to replace (the user decides)."""


@dataclass(frozen=True)
class ShardInfo:
    """A shard's metadata, from its header alone."""

    batch_id: int
    path: Path
    samples: list[SampleEntry]
    num_tokens: int  # real (non-padding) tokens
    checksum: str
    file_bytes: int


def read_cache_config(cache_dir: str | Path) -> CacheConfig:
    path = Path(cache_dir) / CACHE_CONFIG_FILE
    if not path.exists():  # a FIFO or a directory in its place is refused by name when read
        raise CacheFormatError(f"{path}: not found; is {cache_dir} a cache written by dflash-extract?")
    try:
        return CacheConfig.from_value(read_json(path), source=str(path))
    except InputFileError as e:
        raise CacheFormatError(str(e)) from e


def list_shards(cache_dir: str | Path) -> list[int]:
    """Batch ids of the shard files present (complete by construction: temporaries are skipped)."""
    shard_dir = Path(cache_dir) / SHARDS_DIR
    if not shard_dir.is_dir():
        return []
    ids = (batch_id_of(p) for p in shard_dir.iterdir())
    return sorted(i for i in ids if i is not None)


def load_target_head(cache_dir: str | Path, verify_checksum: bool = True) -> dict[str, torch.Tensor]:
    """embed_tokens [V, H], lm_head [V, H] and final_norm [H] of the target, as stored."""
    path = Path(cache_dir) / TARGET_HEAD_FILE
    if not path.is_file():
        raise CacheFormatError(f"{path}: not found; re-run dflash-extract to rebuild the cache")
    head, found = read_checked_tensors(path, TARGET_HEAD_TENSORS, verify_checksum)
    if verify_checksum:
        expected = read_cache_config(cache_dir).target_head_checksum
        if expected is not None and found != expected:
            raise CacheFormatError(
                f"{path}: holds another target's head (checksum {found}, cache.json records {expected}); "
                "restore the original file or re-run dflash-extract"
            )
    return head


def read_checked_tensors(
    path: Path, names: tuple[str, ...], verify_checksum: bool = True
) -> tuple[dict[str, torch.Tensor], str | None]:
    """The named tensors of a container of ours (the target head, the projection) and their checksum,
    checked against the one its header records (verify_checksum False: neither computed nor checked)."""
    with MappedContainer(path) as c:
        missing = [n for n in names if n not in c.header.entries]
        if missing:
            raise CacheFormatError(f"{path}: missing tensors {missing}")
        tensors = {n: c.tensor(n).clone() for n in names}
        stored = c.header.metadata.get("checksum")
    if not verify_checksum:
        return tensors, None
    found = checksum(tensors)
    if stored != found:
        raise CacheFormatError(f"{path}: checksum mismatch (stored {stored}, computed {found}): corrupted")
    return tensors, found


def allocate_shard_buffers(cfg: CacheConfig, pin_memory: bool = False) -> dict[str, torch.Tensor]:
    """Host tensors of one shard's shapes, to be filled again and again by ShardReader.read."""
    return {
        name: torch.empty(spec.shape, dtype=spec.dtype, pin_memory=pin_memory)
        for name, spec in tensor_specs(cfg).items()
    }


class ShardReader:
    """Reads the shards of one cache, checking each against cache.json."""

    def __init__(self, cache_dir: str | Path):
        self.cache_dir = Path(cache_dir)
        self.config = read_cache_config(self.cache_dir)
        self.specs = tensor_specs(self.config)
        if self.config.target_head_checksum is None:
            raise CacheFormatError(
                f"{self.cache_dir / CACHE_CONFIG_FILE}: no target_head_checksum; the cache "
                "was not finished by dflash-extract (re-run it)"
            )
        self.cache_id = self.config.cache_id()

    def batch_ids(self) -> list[int]:
        return list_shards(self.cache_dir)

    def path(self, batch_id: int) -> Path:
        return shard_path(self.cache_dir, batch_id)

    def info(self, batch_id: int) -> ShardInfo:
        """Header-level checks (version, names, shapes, dtypes, size, metadata); no data read."""
        path = self.path(batch_id)
        if not path.is_file():
            raise ShardError(path, "missing; re-run dflash-extract with the same arguments to write it")
        try:
            header = read_header(path)
        except CacheFormatError as e:
            raise ShardError(path, str(e).removeprefix(f"{path}: ")) from e
        meta = header.metadata
        if meta.get("format_version") != str(self.config.format_version):
            raise ShardError(
                path,
                f"format version {meta.get('format_version')!r}, cache.json says {self.config.format_version}; "
                "re-run dflash-extract to rebuild this shard",
            )
        planned = self.config.planned_batches
        if planned is not None and not 0 <= batch_id < planned:
            raise ShardError(path, f"batch {batch_id} is outside the plan of {planned} batches in cache.json")
        if meta.get("batch_id") != str(batch_id):
            raise ShardError(path, f"holds batch {meta.get('batch_id')!r}, its name says {batch_id}")
        if meta.get("cache_id") != self.cache_id:
            raise ForeignShardError(
                path,
                f"belongs to another cache (its header names cache {meta.get('cache_id')!r}, "
                f"{self.cache_dir / CACHE_CONFIG_FILE} is cache {self.cache_id!r}: other target weights, data "
                "or packing); remove it (dflash-shards verify --quarantine) and re-run dflash-extract to write "
                "this cache's own shard",
            )
        if set(header.entries) != set(self.specs):
            raise ShardError(path, f"tensors {sorted(header.entries)}, cache.json expects {sorted(self.specs)}")
        for name, spec in self.specs.items():
            e = header.entries[name]
            if e.shape != spec.shape or e.dtype != spec.dtype:
                raise ShardError(
                    path, f"tensor {name} is {e.shape} {e.dtype}, cache.json expects {spec.shape} {spec.dtype}"
                )
        missing = [k for k in ("samples", "num_tokens", "checksum") if k not in meta]
        if missing or not meta["num_tokens"].isdigit():
            raise ShardError(path, f"bad metadata (missing {missing}, num_tokens {meta.get('num_tokens')!r})")
        samples = _samples(path, meta["samples"], len(self.config.modes))
        return ShardInfo(batch_id, path, samples, int(meta["num_tokens"]), meta["checksum"], path.stat().st_size)

    def read(
        self,
        batch_id: int,
        out: dict[str, torch.Tensor] | None = None,
        verify_checksum: bool = False,
    ) -> tuple[dict[str, torch.Tensor], ShardInfo]:
        """The shard's tensors, copied into `out` (e.g. pinned buffers) when given, else fresh tensors."""
        info = self.info(batch_id)
        with MappedContainer(info.path) as c:
            views = {name: c.tensor(name) for name in self.specs}
            if verify_checksum:
                _check_checksum(info, views)
            if out is None:
                tensors = {name: v.clone() for name, v in views.items()}
            else:
                for name, v in views.items():
                    out[name].copy_(v)
                tensors = out
            del views
        return tensors, info

    def verify(self, batch_id: int) -> ShardInfo:
        """Every check: header, shapes, checksum of all data, and packing consistency.

        Works on the memory-mapped views: nothing is copied, so verifying a 2.5 GB shard reads it once.
        """
        info = self.info(batch_id)
        with MappedContainer(info.path) as c:
            views = {name: c.tensor(name) for name in self.specs}
            _check_checksum(info, views)
            check_packing(info, views, self.config)
            del views
        return info


def _samples(path: Path, text: str, num_modes: int) -> list[SampleEntry]:
    """The header's samples: [[id, offset, length, loss tokens], ...], each id within the bounds the
    writer keeps (shards/sample_ids.py); in a cache of several modes (cache.json chat_modes) each row
    carries a fifth element, the sample's mode index."""
    width = 5 if num_modes > 1 else 4
    shape = "[id, offset, length, loss tokens" + (", mode index]" if width == 5 else "]")
    try:
        rows = parse_json(text, f"{path}: header samples", max_bytes=MAX_HEADER_BYTES)
    except InputFileError as e:
        raise ShardError(path, str(e).removeprefix(f"{path}: ")) from e
    if not isinstance(rows, list):
        raise ShardError(path, f"header samples must be an array, found {json_type(rows)}")
    samples = []
    for i, row in enumerate(rows):
        if not (
            isinstance(row, list)
            and len(row) == width
            and isinstance(row[0], str)
            and all(type(x) is int and x >= 0 for x in row[1:])
            and (width == 4 or row[4] < num_modes)
        ):
            raise ShardError(
                path, f"header samples[{i}] must be {shape} (cache.json lists {num_modes} modes), found {row!r:.200}"
            )
        problem = sample_id_problem(row[0])
        if problem is not None:
            raise ShardError(path, f"header samples[{i}]: id {problem}")
        samples.append(SampleEntry(*row))
    return samples


def _check_checksum(info: ShardInfo, views: dict[str, torch.Tensor]) -> None:
    found = checksum(views)
    if found != info.checksum:
        raise ShardError(info.path, f"checksum mismatch (stored {info.checksum}, computed {found}): corrupted")


def check_packing(info: ShardInfo, tensors: dict[str, torch.Tensor], cfg: CacheConfig) -> None:
    """The samples in the metadata agree with cu_seqlens, position ids and the loss mask."""
    cu = tensors["cu_seqlens"].tolist()
    n = len(info.samples)
    lengths = [s.length for s in info.samples]
    expected = [0]
    for length in lengths:
        expected.append(expected[-1] + length)
    expected += [expected[-1]] * (cfg.max_seqs - n)
    if n > cfg.max_seqs or cu != expected:
        raise ShardError(info.path, "cu_seqlens disagree with the sample lengths in the metadata")
    if expected[-1] != info.num_tokens or info.num_tokens > cfg.token_budget:
        raise ShardError(info.path, f"num_tokens {info.num_tokens} disagrees with the samples ({expected[-1]})")
    mask = tensors["loss_mask"]
    for s in info.samples:
        if int(mask[s.offset : s.offset + s.length].sum()) != s.loss_tokens:
            raise ShardError(info.path, f"sample {s.sample_id}: loss_tokens disagrees with loss_mask")
    if int(mask[info.num_tokens :].sum()) != 0:
        raise ShardError(info.path, "loss_mask is nonzero on padding")
    if "anchor_mask" in tensors and int(tensors["anchor_mask"][info.num_tokens :].sum()) != 0:
        raise ShardError(info.path, "anchor_mask is nonzero on padding")
