"""One logging set-up for the four CLIs: `HH:MM:SS LEVEL logger: message` on stderr, and under
torchrun every rank but 0 prefixed `[rank N]`, so the interleaved lines of a job's processes say
whose they are. Rank 0 keeps the plain format: a single process and a job's rank 0 read the same.

dflash-train passes `other_ranks_level=logging.WARNING`: its ranks run the same steps and rank 0
reports them, so the others speak only to warn. Extraction ranks each work on their own shards and
keep INFO. The rank comes from torchrun's RANK variable, read here rather than through
shards.common.runtime so that setting up logging does not import torch.
"""

from __future__ import annotations

import logging
import os

from shards.common.terminal import escaped

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"


class SafeFormatter(logging.Formatter):
    """A formatter whose lines carry no terminal control: log messages quote data (ids, file names)."""

    def format(self, record: logging.LogRecord) -> str:
        return escaped(super().format(record))


class RankFormatter(SafeFormatter):
    """FORMAT with `[rank N] ` before the level, except on a message that already opens with that tag
    (extraction's progress lines name their rank on every rank, rank 0 included): never said twice."""

    def __init__(self, rank: str):
        super().__init__(FORMAT, DATE_FORMAT)
        self.tag = f"[rank {rank}] "
        self.tagged = SafeFormatter(f"%(asctime)s {self.tag}%(levelname)s %(name)s: %(message)s", DATE_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if record.getMessage().startswith(self.tag):
            return super().format(record)
        return self.tagged.format(record)


def setup_logging(*, other_ranks_level: int = logging.INFO) -> None:
    """Configure the root logger (as logging.basicConfig does: a no-op once it has a handler)."""
    rank = os.environ.get("RANK", "0")
    stderr = logging.StreamHandler()
    stderr.setFormatter(SafeFormatter(FORMAT, DATE_FORMAT))
    if rank == "0":
        logging.basicConfig(level=logging.INFO, handlers=[stderr])
        return
    logging.basicConfig(level=other_ranks_level, handlers=[stderr])
    for handler in logging.getLogger().handlers:
        handler.setFormatter(RankFormatter(rank))
