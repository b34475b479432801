"""Training's start-up per phase (shards/common/startup.py): logged once and recorded once in metrics.jsonl,
after the first step, with the phases in the order the run went through them."""

import json
import logging
import os

import pytest
import torch
from torch._dynamo.utils import counters

from tests.helpers.train import tiny_cache, tiny_config
from train.loop import run_training


def test_start_up_is_recorded_once_after_the_first_step(tmp_path, caplog):
    cache = tiny_cache(tmp_path / "cache", num_batches=3)
    with caplog.at_level(logging.INFO):
        run_training(tiny_config(cache, tmp_path / "run", epochs=1, eval_shards=1))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    (startup,) = [r for r in map(json.loads, lines) if r.get("event") == "startup"]
    phases = [k for k in startup if k.endswith("_s")]
    # On CPU the step runs eagerly: no compile, warm-up or capture phase; the held-out eval runs before it.
    assert phases == ["model_s", "eval_before_s", "first_step_s", "since_process_start_s"], startup
    assert startup["step"] == 1 and all(startup[k] >= 0 for k in phases)
    assert startup["since_process_start_s"] > startup["model_s"] + startup["eval_before_s"] + startup["first_step_s"]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up of rank 0's training")]
    assert len(said) == 1 and "model " in said[0] and "first step " in said[0], said


@pytest.mark.slow  # inductor's C++ compiles of the drafter's pointwise regions, forward and backward, on CPU
def test_the_compiled_step_compiles_in_the_first_step_only(tmp_path, monkeypatch):
    """The step's shapes are the token budget's, fixed: every graph is compiled in the first step (the
    phase that compiles on CPU, where the step runs without CUDA graphs), none in the steps after it."""
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "FLA_CACHE_RESULTS"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # the run points them at --compile-cache: put back
    torch._dynamo.reset()
    cache = tiny_cache(tmp_path / "cache", num_batches=3)
    cfg = tiny_config(cache, tmp_path / "run", epochs=1, compile_pointwise=True, compile_cache=str(tmp_path / "cc"))
    run_training(cfg)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    (startup,) = [r for r in map(json.loads, lines) if r.get("event") == "startup"]
    steps = [r["step"] for r in map(json.loads, lines) if "event" not in r]
    assert startup["first_step_graphs"] > 0 and steps[-1] >= 3, (startup, steps)
    assert counters["stats"]["unique_graphs"] == startup["compile_counts"]["graphs"], "a later step compiled"
    assert (tmp_path / "cc" / "inductor").is_dir(), "--compile-cache was not used"
