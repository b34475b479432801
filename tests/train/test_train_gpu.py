"""GPU: the captured CUDA-graph step computes what the eager step computes; fp8 caches train; resume
under graphs continues the same loss sequence."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tests.helpers.train import read_records, tiny_cache, tiny_config
from train.loop import run_training

GPU_CACHE = dict(hidden_size=256, vocab_size=2048, token_budget=1024, max_seqs=4, tap_layer_ids=(1, 3, 5))


# bf16 (--fp8 off): these tests hold the captured step to the eager one at bf16's tolerances; the default
# --fp8 auto has its own test below.
ON_GPU = dict(device="cuda", attention="flex", compute_dtype="bfloat16", fp8="off")
GPU_DRAFTER = dict(num_blocks=16, block_size=16, num_layers=2, mask_token_id=GPU_CACHE["vocab_size"] - 1)


def gpu_config(cache, out, **overrides):
    """tiny_config on the GPU: flex attention, bf16, a 2-layer drafter with 16 blocks of 16."""
    return tiny_config(cache, out, **{**ON_GPU, **GPU_DRAFTER, **overrides})


def losses(run_dir):
    return {r["step"]: r["loss/total"] for r in read_records(run_dir)}


@pytest.mark.gpu
def test_cuda_graph_step_equals_eager_step(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=4, **GPU_CACHE)
    run_training(gpu_config(cache, tmp_path / "eager", cuda_graphs=False))
    run_training(gpu_config(cache, tmp_path / "graph", cuda_graphs=True))
    eager, graph = losses(tmp_path / "eager"), losses(tmp_path / "graph")
    assert sorted(eager) == sorted(graph) == list(range(1, 9))
    diffs = {s: abs(eager[s] - graph[s]) / abs(eager[s]) for s in eager}
    # bf16 activations: kernels may differ in reduction order between capture and eager runs.
    assert max(diffs.values()) <= 2e-2, f"max relative loss diff graph vs eager {max(diffs.values()):.3e}: {diffs}"
    metrics = [r for r in read_records(tmp_path / "graph") if "acc/slot_01" in r]
    assert [r["step"] for r in metrics] == [1, 3, 5, 7]


@pytest.mark.gpu
def test_cuda_graph_step_equals_eager_step_with_sliding_layers(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=4, **GPU_CACHE)
    sliding = dict(layer_types=["sliding", "full"], sliding_window=100)  # sequences are longer than 100 tokens
    run_training(gpu_config(cache, tmp_path / "eager", cuda_graphs=False, **sliding))
    run_training(gpu_config(cache, tmp_path / "graph", cuda_graphs=True, **sliding))
    eager, graph = losses(tmp_path / "eager"), losses(tmp_path / "graph")
    assert sorted(eager) == sorted(graph) == list(range(1, 9))
    diffs = {s: abs(eager[s] - graph[s]) / abs(eager[s]) for s in eager}
    assert max(diffs.values()) <= 2e-2, f"max relative loss diff graph vs eager {max(diffs.values()):.3e}: {diffs}"


@pytest.mark.gpu
def test_cuda_graph_resume_continues_the_loss_sequence(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=4, **GPU_CACHE)
    full = tmp_path / "full"
    run_training(gpu_config(cache, full, checkpoint_every=3, keep_checkpoints=5))
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "step-00000003", resumed / "step-00000003")
    run_training(gpu_config(cache, resumed, checkpoint_every=3, keep_checkpoints=5, resume=True))
    a, b = losses(full), losses(resumed)
    diffs = {s: abs(a[s] - b[s]) / abs(a[s]) for s in range(4, 9)}
    assert max(diffs.values()) <= 1e-2, f"resumed vs uninterrupted relative loss diffs {diffs}"


@pytest.mark.gpu
def test_fp8_cache_trains_under_graphs(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=3, storage_dtype="fp8", **GPU_CACHE)
    summary = run_training(gpu_config(cache, tmp_path / "run", epochs=1, eval_shards=1))
    assert summary.steps == 2 and math.isfinite(summary.last_record["loss/total"])
    assert summary.eval is not None and summary.eval.num_blocks > 0


STEP_OPTIONS = {
    "checkpoint_layers": dict(checkpoint_layers=True),
    # The default step has the elementwise cuts on; this one has them all off.
    "no_elementwise_cuts": dict(weight_copies=False, fused_loss=False, compile_pointwise=False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("option", sorted(STEP_OPTIONS))
def test_step_options_under_graphs_follow_the_default_loss_sequence(tmp_path, option):
    """Activation checkpointing, or the step without the elementwise cuts, inside the captured step:
    the same losses as the default step."""
    cache = tiny_cache(tmp_path / "cache", num_batches=4, **GPU_CACHE)
    run_training(gpu_config(cache, tmp_path / "default"))
    run_training(gpu_config(cache, tmp_path / "option", **STEP_OPTIONS[option]))
    default, changed = losses(tmp_path / "default"), losses(tmp_path / "option")
    assert sorted(default) == sorted(changed) == list(range(1, 9))
    diffs = {s: abs(default[s] - changed[s]) / abs(default[s]) for s in default}
    assert max(diffs.values()) <= 1e-2, f"{option} vs default relative loss diffs {diffs}"


@pytest.mark.gpu
def test_the_default_trains_fp8_on_an_fp8_gpu_and_a_resume_keeps_its_checkpoints_mode(tmp_path):
    """--fp8 auto on a GPU with FP8 tensor cores (the H200) trains linears+head, records it and follows the
    bf16 run's losses within FP8's error (tests/train/test_fp8_training.py: 1e-2 relative per loss, here
    over 8 steps of training that each carry it: 5e-2); a run that trained --fp8 linears, resumed under
    auto, goes on in linears (the checkpoint's mode, not the one auto would pick here)."""
    pytest.importorskip("torchao.float8")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (compute capability 8.9+)")
    cache = tiny_cache(tmp_path / "cache", num_batches=4, **GPU_CACHE)
    auto = {k: v for k, v in {**ON_GPU, **GPU_DRAFTER}.items() if k != "fp8"}
    run_training(tiny_config(cache, tmp_path / "bf16", **ON_GPU, **GPU_DRAFTER))
    run_training(tiny_config(cache, tmp_path / "auto", **auto))
    assert json.loads((tmp_path / "auto" / "run.json").read_text())["config"]["fp8"] == "linears+head"
    bf16, fp8 = losses(tmp_path / "bf16"), losses(tmp_path / "auto")
    assert sorted(bf16) == sorted(fp8) == list(range(1, 9))
    diffs = {s: abs(bf16[s] - fp8[s]) / abs(bf16[s]) for s in bf16}
    assert 0 < max(diffs.values()) <= 5e-2, f"fp8 vs bf16 relative loss diffs {diffs}"

    run_training(tiny_config(cache, tmp_path / "linears", checkpoint_every=4, **{**auto, "fp8": "linears"}))
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "linears" / "step-00000004", resumed / "step-00000004")
    run_training(tiny_config(cache, resumed, checkpoint_every=4, resume=True, **auto))
    assert json.loads((resumed / "run.json").read_text())["config"]["fp8"] == "linears"
    linears, again = losses(tmp_path / "linears"), losses(resumed)
    assert max(abs(again[s] - linears[s]) / abs(linears[s]) for s in range(5, 9)) <= 1e-2
