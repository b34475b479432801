"""The hidden-state cache: the contract between dflash-extract and dflash-train.

The format (its version is `FORMAT_VERSION`, in shards/format.py) lives in this package's modules: schema
(format), encodings (codec), the safetensors container, writer, reader, manifest, shard order, the
prefetching loader, whole-cache inspection and which files of a cache are ours (ownership).
`shards/common/` is the plumbing both stages share and is not part of the format.
"""

from shards.codec import decode_codes, decode_context, decode_hidden, encode_codes, encode_hidden
from shards.format import (
    FORMAT_VERSION,
    CacheConfig,
    CacheFormatError,
    TargetInfo,
    bytes_per_shard,
    shard_path,
    tensor_specs,
)
from shards.loader import LoadedShard, ShardLoader
from shards.manifest import read_manifest, rebuild_manifest, write_manifest
from shards.order import epoch_shard_order
from shards.reader import (
    ShardError,
    ShardInfo,
    ShardReader,
    allocate_shard_buffers,
    list_shards,
    load_target_head,
    read_cache_config,
)
from shards.writer import (
    SampleEntry,
    create_cache,
    write_cache_config,
    write_shard,
    write_target_head,
)

__all__ = [
    "FORMAT_VERSION",
    "CacheConfig",
    "CacheFormatError",
    "TargetInfo",
    "bytes_per_shard",
    "shard_path",
    "tensor_specs",
    "decode_codes",
    "decode_context",
    "decode_hidden",
    "encode_codes",
    "encode_hidden",
    "LoadedShard",
    "ShardLoader",
    "read_manifest",
    "rebuild_manifest",
    "write_manifest",
    "epoch_shard_order",
    "ShardError",
    "ShardInfo",
    "ShardReader",
    "allocate_shard_buffers",
    "list_shards",
    "load_target_head",
    "read_cache_config",
    "SampleEntry",
    "create_cache",
    "write_cache_config",
    "write_shard",
    "write_target_head",
]
