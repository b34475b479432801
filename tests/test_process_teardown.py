"""Every multi-rank run ends its gloo process group before the interpreter exits, in both stages.

Why: a rank whose gloo threads still run while the interpreter finalizes can abort at exit ("terminate
called without an active exception", SIGABRT: a 2-rank dflash-extract did once, right after "cache
complete"): a gloo thread that drops the last reference to a collective's tensor takes the GIL to free its
Python buffer, and a thread taking the GIL during finalization is ended mid-destructor. destroy_process_group
joins those threads, but only when nothing else holds the group: torch.distributed.nn binds `group.WORLD`
as a default argument when imported, and torch._dynamo (which the target model and the drafter import)
imports it, after the group exists. Training did not destroy its group at all.

How: each CLI runs on two CPU ranks under torchrun through a wrapper whose atexit hook, registered first so
it runs after every other one (torch's too), records the threads the process still has; no gloo thread may
be among them. Deterministic (the threads are there or not), unlike the abort itself, which needs the
scheduler's help.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.extract import cli_args
from tests.helpers.process import REPO, child_env
from tests.helpers.train import tiny_cache, tiny_cli_args

_GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")  # gloo's transport loop and torch's work queue

_WRAPPER = """
import atexit, os, runpy, sys

def threads_at_exit():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{{tid}}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    with open(os.path.join({out!r}, "threads-rank" + os.environ["RANK"]), "w") as f:
        f.write("\\n".join(sorted(names)) + "\\n")

atexit.register(threads_at_exit)
sys.argv[0] = {module!r}
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
"""


def threads_at_exit(tmp_path: Path, module: str, args: list[str]) -> dict[str, list[str]]:
    """Run `python -m module args` on 2 gloo ranks; each rank's thread names at interpreter exit."""
    probe = tmp_path / "probe"
    probe.mkdir()
    script = tmp_path / "run_with_probe.py"
    script.write_text(_WRAPPER.format(out=str(probe), module=module))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), *args]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {p.name: p.read_text().split() for p in sorted(probe.iterdir())}


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
@pytest.mark.parametrize("stage", ["dflash-extract", "dflash-train"])
def test_no_gloo_thread_outlives_the_run(stage, target, data, tmp_path):
    if stage == "dflash-extract":
        found = threads_at_exit(tmp_path, "extract.cli", cli_args(target, data, tmp_path / "cache", "--device", "cpu"))
    else:
        cache = tiny_cache(tmp_path / "cache", num_batches=4)
        found = threads_at_exit(tmp_path, "train.cli", tiny_cli_args(cache, tmp_path / "run", "--max-steps", "2"))
    assert sorted(found) == ["threads-rank0", "threads-rank1"], found
    alive = {rank: [t for t in names if t in _GLOO_THREADS] for rank, names in found.items()}
    assert not any(alive.values()), f"gloo threads still running at interpreter exit: {alive}"
