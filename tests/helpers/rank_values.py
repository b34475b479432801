"""Run under torchrun by tests/train/test_distributed.py (no tests here): rank 0 offers argv[1] and every
other rank argv[2] to train.distributed.same_on_every_rank; prints "agreed", or exits 3 printing the refusal."""

from __future__ import annotations

import sys

import torch

from shards.common.errors import UserError
from shards.common.runtime import process_group_scope
from train.distributed import init_distributed, same_on_every_rank

if __name__ == "__main__":
    info = init_distributed("cpu")
    try:
        with process_group_scope():
            same_on_every_rank(sys.argv[1] if info.rank == 0 else sys.argv[2], "--fp8", torch.device("cpu"))
    except UserError as e:
        print(f"refused: {e}", flush=True)
        sys.exit(3)
    print("agreed", flush=True)
