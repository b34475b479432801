"""Process plumbing both stages share: torchrun ranks, device choice, the `--gpus` relaunch.

It lives here because `shards` is the one package that extract and train both import; nothing in it
knows about either stage.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shards.common.progress import plural

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_info() -> DistInfo:
    """This process's place under torchrun (rank 0 of 1 when started alone)."""
    return DistInfo(
        int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    )


def resolve_device(spec: str, local_rank: int) -> torch.device:
    """ "auto" = cuda:LOCAL_RANK when CUDA exists, else cpu; a bare "cuda" also means this rank's GPU."""
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise ValueError(f"--device {spec!r} is not a device (use auto, cpu, cuda or cuda:N): {e}") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"--device {spec}: CUDA is not available on this machine "
                f"(torch {torch.__version__}, no visible GPU); use --device cpu or auto"
            )
        if device.index >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA device(s), 0..{count - 1}")
    return device


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order ([obj] without a process group); a collective: all ranks call it."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def init_process_group(backend: str, **kwargs: Any) -> None:
    """dist.init_process_group, with torch.distributed.nn imported first.

    Its functions take `group=group.WORLD` as a default argument, evaluated when the module is imported:
    imported after the group exists (torch._dynamo imports it, and the target model and the drafter's
    attention import torch._dynamo), they hold the group past destroy_process_group, so gloo's threads
    run on into interpreter exit, where a rank aborted with "terminate called without an active
    exception" (a gloo thread taking the GIL to free a collective's tensor while the interpreter
    finalizes). Imported before, the defaults are None. tests/test_process_teardown.py checks it.
    """
    import torch.distributed.nn  # noqa: F401

    dist.init_process_group(backend, **kwargs)


@contextmanager
def process_group_scope() -> Iterator[None]:
    """Around the part of a run that uses the process group: on success every rank passes a barrier (each
    is past its last collective) and destroys the group, which joins gloo's threads before exit; after a
    failure only a gloo group is destroyed (its teardown is local). An NCCL group is then left to the
    process's exit: its teardown may wait on ranks still inside a collective, for good (torchtitan#1342)."""
    try:
        yield
    except BaseException:
        if dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
        raise
    barrier()
    if dist.is_initialized():
        dist.destroy_process_group()


def relaunch_under_torchrun(module: str, gpus: str, argv: list[str], device: str = "auto") -> None:
    """Replace this process with `torchrun --nproc-per-node N -m module argv-without---gpus`.

    N processes need N GPUs: more than the machine has is refused, unless `--device cpu` asks for N
    CPU processes (gloo), which is then said, so that a missing GPU never silently becomes CPU ranks."""
    if gpus != "all" and not gpus.isdigit():
        raise ValueError(f"--gpus {gpus}: expected a number of GPUs or 'all'")
    available = torch.cuda.device_count()
    n = available if gpus == "all" else int(gpus)
    if n < 1:
        raise ValueError(f"--gpus {gpus}: no CUDA devices found" if gpus == "all" else f"--gpus {gpus}: must be >= 1")
    if device == "cpu":
        log.warning(
            "--gpus %d --device cpu: starting %s on the CPU (gloo), no GPU used", n, plural(n, "process", "processes")
        )
    elif n > available:
        raise ValueError(
            f"--gpus {gpus}: this machine has {plural(available, 'CUDA device')}; pass --gpus {available} or fewer"
            + (f", or add --device cpu to start {n} CPU processes instead" if available == 0 else "")
        )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        "-m",
        module,
        *without_option(argv, "--gpus"),
    ]
    log.info("starting: %s", " ".join(cmd))
    os.execv(sys.executable, cmd)


def without_option(argv: list[str], name: str) -> list[str]:
    """argv minus `name VALUE` / `name=VALUE`, so the ranks torchrun starts do not launch again."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out
