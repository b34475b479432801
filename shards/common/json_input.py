"""The one reader of JSON documents and JSON Lines records: every file read may be damaged or crafted.

A cache, a run directory, a drafter or a dataset can come from anyone, so nothing read is trusted:
  size    at most `max_bytes` are read (a file or line past it is refused, never loaded whole);
  depth   nesting deeper than `max_depth` is refused (json's parser recurses: a document nested
          200,000 deep raised RecursionError as a traceback), so what walks the value never recurses far;
  kind    only a regular file is opened for reading (a FIFO would block the read forever);
  syntax  anything json refuses (bad syntax, invalid UTF-8, an integer of more than 4300 digits).
Each refusal is one InputFileError whose message starts with the file (and line) it is about. Typed
checks of the parsed value (which fields, of which types) are shards/common/schema.py's.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path
from typing import Any

from shards.common.errors import UserError

# Our own records are kilobytes (train_state.json of 64 ranks ~ 1 MB); a target's tokenizer_config.json
# or index of weights a few MB. Larger is not a file we or a model release write.
MAX_JSON_BYTES = 64 << 20
# Our records nest 4 deep, a chat with tool schemas ~20; json recurses once per level.
MAX_JSON_DEPTH = 64

_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes


class InputFileError(UserError, ValueError):
    """A file the program reads is too large, too deep, not JSON, or not of the expected shape; the
    message names the file (and line, and field)."""


def bracket_depth_bound(data: bytes) -> int:
    """An upper bound of a JSON text's nesting: the deepest running count of its brackets, those inside
    strings counted too. A pass of bytes.translate and a running sum in C: ~50 ms for 60 MB."""
    return max(accumulate(memoryview(data.translate(_STEP, _NOT_BRACKET)).cast("b")), default=0)


def value_depth(value: Any) -> int:
    """How deep arrays and objects nest in a parsed value (iterative: no recursion however deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((c, depth + 1) for c in children)
    return deepest


def parse_json(
    data: bytes | str, source: str, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH
) -> Any:
    """The value of one JSON text read from `source` (a path, or a path and line, for messages).

    The bracket bound spares the exact depth walk for all but documents near the limit or with
    brackets inside strings; json's own RecursionError (past ~1000 levels) is a refusal like the rest."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if len(raw) > max_bytes:
        raise InputFileError(f"{source}: {len(raw)} bytes of JSON, more than the {max_bytes} allowed")
    too_deep = f"{source}: JSON nested more than the {max_depth} levels allowed"
    try:
        value = json.loads(data)
    except RecursionError as e:
        raise InputFileError(too_deep) from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer past int_max_str_digits
        raise InputFileError(f"{source}: not valid JSON ({e})") from e
    if bracket_depth_bound(raw) > max_depth and value_depth(value) > max_depth:
        raise InputFileError(too_deep)
    return value


def read_json(path: str | Path, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The value of the JSON file at `path`. A missing or unreadable file raises OSError as open does."""
    with open_regular(path) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputFileError(f"{path}: larger than the {max_bytes} bytes allowed for this file")
    return parse_json(data, str(path), max_bytes=max_bytes, max_depth=max_depth)


def read_json_object(path: str | Path, **bounds: int) -> dict[str, Any]:
    """read_json, refusing anything but an object at the top."""
    value = read_json(path, **bounds)
    if not isinstance(value, dict):
        raise InputFileError(f"{path}: expected a JSON object, found {json_type(value)}")
    return value


def iter_json_lines(
    path: str | Path,
    *,
    max_line_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
    partial_last_line: bool = False,
) -> Iterator[tuple[int, Any]]:
    """(line number from 1, value) of each non-blank line of a JSON Lines file, each bounded as read_json;
    the file is streamed, so its total size is not bounded. partial_last_line: a last line that does not
    parse is left out (what a writer killed mid-line leaves) rather than refused."""
    with open_regular(path) as f:
        for number, line in enumerate(iter(lambda: f.readline(max_line_bytes + 1), b""), start=1):
            where = f"{path}, line {number}"
            if len(line) > max_line_bytes:
                raise InputFileError(f"{where}: longer than the {max_line_bytes} bytes allowed for one record")
            if not line.strip():
                continue
            try:
                value = parse_json(line, where, max_bytes=max_line_bytes, max_depth=max_depth)
            except InputFileError:
                if partial_last_line and not f.read(1):  # nothing follows it
                    return
                raise
            yield number, value


def open_regular(path: str | Path):
    """`path` opened for binary reading, refused unless it is a regular file (links followed).

    O_NONBLOCK makes opening a FIFO return at once rather than wait for a writer; it changes nothing
    for a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputFileError(f"{path}: {file_kind(mode)}, not a regular file; replace it with the file expected")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def file_kind(mode: int) -> str:
    """What a stat mode describes, in words."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "a special file"


def json_type(value: Any) -> str:
    """JSON's name for the type of a parsed value (what a message says was found)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
