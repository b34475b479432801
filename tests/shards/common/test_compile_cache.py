"""The persistent compile cache (shards/common/compile_cache.py) on CPU, as whole processes compile
through it: a later process loads what an earlier one compiled (inductor's FX graph and AOTAutograd
cache-hit counters), two ranks compiling at once into one directory both succeed and leave it usable,
a damaged entry is compiled again and rewritten; and the directories it makes never follow a link."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shards.common.compile_cache import CompileCacheConfig, default_compile_cache_base, use_compile_cache
from shards.common.owned import OwnershipError

REPO = Path(__file__).resolve().parents[3]

# One process of a run: the cache switched on, one compiled function called, its result checked
# against eager, inductor's cache counters printed as the last line.
CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from shards.common.compile_cache import CompileCacheConfig, use_compile_cache
    use_compile_cache(CompileCacheConfig(compile_cache=sys.argv[1]))
    from torch._dynamo.utils import counters

    def norm_gate(x, w):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
        return y * torch.sigmoid(x)

    x, w = torch.randn(24, 32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    torch.testing.assert_close(torch.compile(norm_gate, fullgraph=True)(x, w), norm_gate(x, w))
    print(json.dumps({**counters["inductor"], **counters["aot_autograd"]}))
    """
)


def _start(cache: Path, tmp_path: Path) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(script), str(cache)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _run(cache: Path, tmp_path: Path) -> dict:
    return _finish(_start(cache, tmp_path))


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A cache two ranks filled at the same time, with what each rank's process counted."""
    tmp = tmp_path_factory.mktemp("compile_cache")
    cache = tmp / "cache"
    ranks = [_start(cache, tmp) for _ in range(2)]
    return cache, [_finish(p) for p in ranks]


@pytest.mark.slow
def test_two_ranks_compile_into_one_directory(shared_cache):
    cache, ranks = shared_cache
    for counted in ranks:  # each rank compiled (or loaded what the other had just written) and was right
        assert counted.get("fxgraph_cache_miss", 0) + counted.get("fxgraph_cache_hit", 0) == 1, counted
    assert any(counted.get("fxgraph_cache_miss") for counted in ranks)
    assert not list(cache.rglob("*.tmp*")), "a temporary was left behind"
    assert (cache / "inductor" / "fxgraph").is_dir() and (cache / "triton").is_dir()


@pytest.mark.slow
def test_a_later_process_loads_what_an_earlier_one_compiled(shared_cache, tmp_path):
    cache, _ = shared_cache
    counted = _run(cache, tmp_path)
    assert counted.get("fxgraph_cache_hit") == 1 and not counted.get("fxgraph_cache_miss"), counted
    assert counted.get("autograd_cache_hit") == 1, counted


@pytest.mark.slow
def test_a_damaged_entry_is_compiled_again_and_rewritten(shared_cache, tmp_path):
    source, _ = shared_cache
    cache = tmp_path / "cache"
    subprocess.run(["cp", "-a", str(source), str(cache)], check=True)
    entries = [p for d in ("fxgraph", "aotautograd") for p in (cache / "inductor" / d).rglob("*") if p.is_file()]
    assert entries
    for entry in entries:  # as a full disk or a killed copy leaves them: cut short
        entry.write_bytes(entry.read_bytes()[:20])
    counted = _run(cache, tmp_path)
    assert counted.get("fxgraph_cache_miss") == 1 and counted.get("autograd_cache_miss") == 1, counted
    counted = _run(cache, tmp_path)
    assert counted.get("fxgraph_cache_hit") == 1 and counted.get("autograd_cache_hit") == 1, counted


@pytest.fixture
def restored_settings(monkeypatch):
    """use_compile_cache sets process-wide state: put every piece of it back after the test."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "FLA_CACHE_RESULTS"):
        monkeypatch.setenv(name, os.environ.get(name, ""))
    # Set back by hand: monkeypatch's undo deletes the attribute, which hides a torch config entry for good.
    switches = [(inductor_config, "fx_graph_cache"), (inductor_config, "autotune_local_cache")]
    switches.append((functorch_config, "enable_autograd_cache"))
    saved = [(config, name, getattr(config, name)) for config, name in switches]
    yield
    for config, name, value in saved:
        setattr(config, name, value)


def test_default_directory_is_under_the_users_cache_dir(tmp_path, monkeypatch, restored_settings):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    where = use_compile_cache(CompileCacheConfig())
    assert where == str((tmp_path / "xdg" / "dflash-pipeline" / "compile").resolve())
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(where, "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == os.path.join(where, "triton")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1" and os.environ["FLA_CACHE_RESULTS"] == "1"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the spec: a relative value is invalid
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_compile_cache_base() == tmp_path / "home" / ".cache"


def test_off_switches_the_persistent_caches_off(restored_settings):
    import torch._functorch.config as functorch_config

    assert use_compile_cache(CompileCacheConfig(no_compile_cache=True)) is None
    assert not torch._inductor.config.fx_graph_cache and not functorch_config.enable_autograd_cache
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0" and os.environ["FLA_CACHE_RESULTS"] == "0"
    # Nothing from an earlier run can be loaded: a new private folder each time.
    inductor_dir = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert not os.path.exists(inductor_dir) and os.path.basename(os.path.dirname(inductor_dir)).startswith("dflash-")
    use_compile_cache(CompileCacheConfig(no_compile_cache=True))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] != inductor_dir


def test_both_flags_are_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match="--compile-cache .* and --no-compile-cache contradict"):
        CompileCacheConfig(compile_cache=str(tmp_path), no_compile_cache=True)


@pytest.mark.parametrize("planted", ["inductor", "triton"])
def test_a_link_where_our_folder_belongs_is_refused(tmp_path, planted, restored_settings):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / planted).symlink_to(elsewhere)
    with pytest.raises(OwnershipError, match=f"{planted} is a symbolic link"):
        use_compile_cache(CompileCacheConfig(compile_cache=str(cache)))
    assert not list(elsewhere.iterdir())


def test_a_link_planted_at_the_default_directory_is_refused(tmp_path, monkeypatch, restored_settings):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "xdg" / "dflash-pipeline").mkdir(parents=True)
    (tmp_path / "xdg" / "dflash-pipeline" / "compile").symlink_to(elsewhere)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(OwnershipError, match="compile is a symbolic link"):
        use_compile_cache(CompileCacheConfig())
    assert not list(elsewhere.iterdir())
