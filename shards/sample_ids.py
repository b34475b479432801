"""Which sample ids a cache holds: one set of bounds for the dataset scan (extract/dataset), the shard
writer and the shard reader, so that the writer never writes what its reader refuses.

A 65 MB sample id once produced shards and then a shard header its own reader refused as "truncated?",
and a re-run would have redone that batch forever. Ids are therefore bounded where the data are first
read, naming file and row, before any work:
  length     at most MAX_SAMPLE_ID_BYTES bytes of UTF-8;
  encoding   no lone surrogate (not encodable as UTF-8: it failed deep in the writer, naming nothing);
  controls   no control character (tab, newline, escape, C1, bidirectional controls...): an id is
             printed in messages and reports, and one carrying escape sequences drove the terminal.
A shard header holds every sample's id, so the bounds also bound a header: MAX_SHARD_SAMPLES ids of
the worst kind fit in the MAX_HEADER_BYTES a reader accepts (shards/container.py).
"""

from __future__ import annotations

import re

from shards.common.terminal import CONTROL_CHARACTERS
from shards.container import MAX_HEADER_BYTES

MAX_SAMPLE_ID_BYTES = 512
# A sample's entry in a shard header: its id is JSON inside the header's JSON, so escaped twice (a
# quote or backslash becomes 4 bytes, any other byte of UTF-8 at most 3.5), plus four numbers (offset,
# length, loss tokens and, in a cache of several serving modes, the mode index).
MAX_SAMPLE_ENTRY_BYTES = 4 * MAX_SAMPLE_ID_BYTES + 80
# The tensor entries and other metadata of a header take under 4 KB; 64 KB is left for them.
MAX_SHARD_SAMPLES = (MAX_HEADER_BYTES - (64 << 10)) // MAX_SAMPLE_ENTRY_BYTES
_FORBIDDEN = re.compile(f"[\t\n{CONTROL_CHARACTERS}]")
_PREVIEW_CHARS = 40


def sample_id_problem(sample_id: str) -> str | None:
    """Why `sample_id` cannot be a cache's sample id (a phrase completing "id ..."), or None."""
    try:
        size = len(sample_id.encode("utf-8"))
    except UnicodeEncodeError as e:
        return f"{preview(sample_id)} holds a lone surrogate (U+{ord(sample_id[e.start]):04X} at character {e.start}), not valid Unicode"
    if size > MAX_SAMPLE_ID_BYTES:
        return f"{preview(sample_id)} is {size} bytes long (UTF-8), more than the {MAX_SAMPLE_ID_BYTES} allowed"
    bad = _FORBIDDEN.search(sample_id)
    if bad is not None:
        return f"{preview(sample_id)} holds the control character {bad.group()!r} at character {bad.start()}"
    return None


def preview(sample_id: str) -> str:
    """The id as a message quotes it: repr (every control escaped), cut after _PREVIEW_CHARS characters."""
    if len(sample_id) <= _PREVIEW_CHARS:
        return repr(sample_id)
    return f"{sample_id[:_PREVIEW_CHARS]!r}... ({len(sample_id)} characters)"
