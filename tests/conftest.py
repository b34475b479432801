"""Shared test setup: one rule for GPU tests (marked `gpu`, skipped where CUDA is absent), one torch
thread, the module-scoped extraction fixtures of the fault tests (each module gets its own), and the
proxy target's smoke run (once per session)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # The Triton kernels (extract/target/fp8/kernels.py) run on CPU tensors under Triton's interpreter; it
    # must be chosen before the kernels are defined, i.e. before anything imports extract.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers.extract import dataset_file, extract_reference, tiny_target_dir  # noqa: E402
from tests.helpers.testbed import proxy_smoke_dir  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_dynamo_for_gpu_tests(request):
    # GPU tests run in one process: without a reset, the compiles of earlier tests count towards
    # dynamo's per-function recompile limit of later ones, so a test's outcome depended on its order.
    if "gpu" in request.keywords:
        torch._dynamo.reset()
    yield


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    # Tiny matmuls on a shared 2-core machine: OpenMP spinning makes 2 threads ~10x slower than 1.
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Qwen3.5-style checkpoint directory (fp32)."""
    return tiny_target_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A JSON Lines dataset of NUM_SAMPLES random samples over the tiny target's vocabulary."""
    return dataset_file(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(target, data, tmp_path_factory):
    """The uninterrupted extraction of `data` by `target`, which faulted runs must reproduce."""
    return extract_reference(target, data, tmp_path_factory)


@pytest.fixture(scope="session")
def proxy_smoke(tmp_path_factory):
    """The proxy target's training script run once in --smoke mode (tools/testbed/train_target.py): its
    output directory (checkpoint, tokenizer, metrics.json, README.md), shared by the tests that read it."""
    return proxy_smoke_dir(tmp_path_factory)


@pytest.fixture
def no_work(monkeypatch):
    """Each stage's first work (dflash-extract's dataset scan, dflash-train's trainer, the checkpoint an
    export loads, the drafter eval loads) fails the test if it starts: for refusals that must come before any work."""
    import extract.runner
    import train.checkpoint.export
    import train.eval.run
    import train.loop

    def started(*a, **kw):
        raise AssertionError("work started: the refusal must come before any work")

    monkeypatch.setattr(extract.runner, "scan_dataset", started)
    monkeypatch.setattr(train.loop, "Trainer", started)
    monkeypatch.setattr(train.checkpoint.export, "drafter_from_checkpoint", started)
    monkeypatch.setattr(train.eval.run, "load_drafter", started)
