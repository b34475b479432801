"""The safetensors container, read and written by us so that the format has one owner.

File layout (safetensors): u64 little-endian header length N, N bytes of JSON header
{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the data.
We write tensors contiguously in name order with the header padded to 8 bytes, so any safetensors
reader opens our files, and our reader memory-maps the data without copying.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from shards.common.json_input import InputFileError, open_regular, parse_json
from shards.format import CacheFormatError, raw_bytes

DTYPE_TO_ST = {
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
}
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}
# A header larger than this is not one we wrote; refuse it before allocating.
MAX_HEADER_BYTES = 64 << 20


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offset in the data section
    end: int


@dataclass(frozen=True)
class Header:
    metadata: dict[str, str]
    entries: dict[str, TensorEntry]
    data_start: int  # byte offset of the data section in the file

    @property
    def data_end(self) -> int:
        return self.data_start + max((e.end for e in self.entries.values()), default=0)


def write_container(f: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPE_TO_ST[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    if len(blob) > MAX_HEADER_BYTES:  # read_header would refuse the file: never write it
        raise ValueError(f"a header of {len(blob)} bytes, more than the {MAX_HEADER_BYTES} a reader accepts")
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name in sorted(tensors):
        f.write(raw_bytes(tensors[name].contiguous()))


def read_header(path: str | Path, check_size: bool = True) -> Header:
    """Parse and sanity-check the header; raises CacheFormatError naming the file. check_size=False
    skips only the data section's length (a damaged file's header still says who wrote it)."""
    path = Path(path)
    try:
        with open_regular(path) as f:  # a FIFO under a shard's name is refused, not waited on
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CacheFormatError(f"{path}: truncated ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CacheFormatError(
                    f"{path}: header of {n} bytes, more than the {MAX_HEADER_BYTES} a reader accepts"
                )
            if 8 + n > size:
                raise CacheFormatError(f"{path}: header length {n} does not fit a {size}-byte file (truncated?)")
            raw = parse_json(f.read(n), f"{path}: header", max_bytes=MAX_HEADER_BYTES)
    except OSError as e:
        raise CacheFormatError(f"{path}: cannot read ({e})") from e
    except InputFileError as e:
        raise CacheFormatError(str(e)) from e
    if not isinstance(raw, dict):
        raise CacheFormatError(f"{path}: header is JSON but not an object (not a safetensors file)")
    metadata = raw.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CacheFormatError(f"{path}: header __metadata__ is not an object of strings")
    entries = {name: _entry(path, name, e) for name, e in raw.items()}
    header = Header(metadata, entries, 8 + n)
    if check_size and header.data_end != size:
        raise CacheFormatError(
            f"{path}: file is {size} bytes but its header describes {header.data_end} (truncated or padded)"
        )
    return header


def _entry(path: Path, name: str, e: object) -> TensorEntry:
    """One tensor's header entry, its byte range as long as its shape and dtype say."""
    try:
        dtype = ST_TO_DTYPE[e["dtype"]]  # type: ignore[index]
        begin, end = e["data_offsets"]  # type: ignore[index]
        shape = tuple(e["shape"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError) as err:
        raise CacheFormatError(f"{path}: bad header entry for tensor {name!r} ({err!r})") from err
    if not all(type(x) is int and x >= 0 for x in (begin, end, *shape)) or begin > end:
        raise CacheFormatError(f"{path}: bad header entry for tensor {name!r} (shape {shape}, offsets {[begin, end]})")
    numel = 1
    for dim in shape:
        numel *= dim
    if end - begin != numel * dtype.itemsize:
        raise CacheFormatError(
            f"{path}: header entry for tensor {name!r} spans {end - begin} bytes, its shape {shape} "
            f"{dtype} takes {numel * dtype.itemsize}"
        )
    return TensorEntry(dtype, shape, begin, end)


class MappedContainer:
    """A memory-mapped container whose tensors are zero-copy views of the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.header = read_header(self.path)
        with open(self.path, "rb") as f:
            # ACCESS_COPY gives a writable (copy-on-write) buffer, which torch.frombuffer wants; nothing
            # is ever written back to the file.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if self.header.data_end else None

    def tensor(self, name: str) -> torch.Tensor:
        e = self.header.entries[name]
        count = e.end - e.begin
        if count == 0:
            return torch.empty(e.shape, dtype=e.dtype)
        flat = torch.frombuffer(self._map, dtype=torch.uint8, count=count, offset=self.header.data_start + e.begin)
        return flat.view(e.dtype).view(e.shape)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # tensors still view the map; it is released when the last of them goes
            self._map = None

    def __enter__(self) -> MappedContainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
