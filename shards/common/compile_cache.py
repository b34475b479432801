"""The persistent compile cache: what torch.compile and Triton build once, kept for every later run.

One directory (default XDG_CACHE_HOME/dflash-pipeline/compile, i.e. ~/.cache/dflash-pipeline/compile;
--compile-cache DIR moves it, --no-compile-cache leaves it alone) holds
    inductor/  TORCHINDUCTOR_CACHE_DIR: inductor's FX graph cache (compiled graphs with their Triton
               kernels bundled), the AOTAutograd cache (forward + backward graphs of the training step's
               compiled regions), inductor's autotuning results and generated code;
    triton/    TRITON_CACHE_DIR: compiled Triton kernels and the timings of every `triton.autotune`
               (Triton's TRITON_CACHE_AUTOTUNING, fla-core's FLA_CACHE_RESULTS): fla's kernels and our
               FP8 feed kernels (extract/target/fp8/kernels.py) tune once per shape, not once per process.
A warm run still traces with dynamo (that is not cached), but skips inductor's code generation, the C++ /
PTX compiles and the autotuning benchmarks, which are most of a cold start.

Two ranks may share the directory: every writer in it (inductor's write_atomic, Triton's
FileCacheManager.put) writes a temporary of a unique name and renames it over the entry, so a reader
sees a whole entry or none, and two ranks writing the same entry write the same bytes. A damaged FX graph
or AOTAutograd entry (a truncated pickle, a foreign file) is a cache miss to inductor: it logs, compiles
again and writes the entry anew (tests/shards/common/test_compile_cache.py checks reuse, two ranks and a
damaged entry). A damaged generated module (inductor's .py / .so, named by the hash of its source) is
not: inductor loads what is at that name, and the compile fails; --no-compile-cache runs past it (a
private folder), and removing the directory rebuilds it.

The directories are made through shards.common.owned.Dir: the default's dflash-pipeline/compile and, in
any cache directory, inductor/ and triton/ are ours, and a link planted where one of them belongs is
refused rather than followed. A directory named by --compile-cache is opened as the user named it.
The libraries take paths: they get the path of the very directory opened (its /proc/self/fd target),
not a name a link could later redirect.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shards.common.cli_options import cli_field, flag_name
from shards.common.owned import Dir

log = logging.getLogger(__name__)

APP_DIR = "dflash-pipeline"
COMPILE_DIR = "compile"
INDUCTOR_DIR = "inductor"
TRITON_DIR = "triton"


@dataclass(kw_only=True)
class CompileCacheConfig:
    """Where compiled kernels persist between runs (shards/common/compile_cache.py)."""

    compile_cache: str | None = cli_field(None, path="dir", identity=False)
    """Directory of the persistent compile cache (inductor graphs, Triton kernels and autotuning), shared
    by every run and rank that names it. Default: XDG_CACHE_HOME/dflash-pipeline/compile
    (~/.cache/dflash-pipeline/compile)."""
    no_compile_cache: bool = cli_field(False, identity=False)
    """Compile from scratch: no compiled graph, kernel or autotuning result is read or kept (all of it goes
    to a private temporary folder, removed at exit)."""

    def __post_init__(self) -> None:
        if self.no_compile_cache and self.compile_cache is not None:
            raise ValueError(
                f"{flag_name(type(self), 'compile_cache')} {self.compile_cache} and "
                f"{flag_name(type(self), 'no_compile_cache')} contradict each other: pass one of them"
            )


def default_compile_cache_base() -> Path:
    """The user's cache directory, as the XDG base directory spec defines it (platformdirs' rule on Linux)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return Path(base) if os.path.isabs(base) else Path.home() / ".cache"


def use_compile_cache(cfg: CompileCacheConfig) -> str | None:
    """Point inductor and Triton at the cache directory (made when absent) and switch their persistent
    caches on; with --no-compile-cache, switch them off. Call before the first compile of the process.
    Returns the directory used (None when off), for run records."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    enabled = not cfg.no_compile_cache
    inductor_config.fx_graph_cache = enabled
    functorch_config.enable_autograd_cache = enabled
    inductor_config.autotune_local_cache = enabled
    # Every triton.autotune keeps its timings (Triton's knob; fla-core reads its own variable at import).
    os.environ["TRITON_CACHE_AUTOTUNING"] = os.environ["FLA_CACHE_RESULTS"] = "1" if enabled else "0"
    if not enabled:
        # Inductor reuses any generated module already at its content-hash name, even with its caches off:
        # a private folder, removed at exit, is what makes "from scratch" true (and what gets a run past
        # a damaged cache directory).
        scratch = tempfile.mkdtemp(prefix="dflash-compile-")
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(scratch, INDUCTOR_DIR)
        os.environ["TRITON_CACHE_DIR"] = os.path.join(scratch, TRITON_DIR)
        log.info(
            "compile cache: off (--no-compile-cache): every compile and autotuning runs from scratch in %s", scratch
        )
        return None
    root = _open_root(cfg.compile_cache)
    with root:
        paths = {name: _resolved(root, name) for name in (INDUCTOR_DIR, TRITON_DIR)}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = paths[INDUCTOR_DIR]
    os.environ["TRITON_CACHE_DIR"] = paths[TRITON_DIR]
    where = os.path.dirname(paths[INDUCTOR_DIR])
    log.info("compile cache: %s (inductor graphs, Triton kernels and autotuning; %s)", where, _how_to_move(cfg))
    return where


def _open_root(named: str | None) -> Dir:
    if named is not None:
        return Dir.open(named, create=True)
    with Dir.opened(default_compile_cache_base(), APP_DIR, create=True) as app:
        return app.child(COMPILE_DIR, create=True)


def _resolved(root: Dir, name: str) -> str:
    """The absolute path of folder `name` in `root` (made when absent, never through a link)."""
    with root.child(name, create=True) as d:
        return os.path.realpath(f"/proc/self/fd/{d.fd}") if os.path.isdir("/proc/self/fd") else str(d.path.resolve())


def _how_to_move(cfg: CompileCacheConfig) -> str:
    name = flag_name(type(cfg), "compile_cache")
    return f"set by {name}" if cfg.compile_cache is not None else f"{name} DIR moves it"
