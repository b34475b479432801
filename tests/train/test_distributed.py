"""Two CPU gloo ranks under torchrun take the same step as one process averaging their two batches."""

from __future__ import annotations

import subprocess

import pytest
import torch
from safetensors.torch import load_file

from shards import ShardReader, epoch_shard_order
from tests.helpers.process import child_env, torchrun_command
from tests.helpers.train import hand_step_loss, read_records, tiny_cache, tiny_cli_args, tiny_config
from train.drafter.model import DFlashDrafter
from train.resolve import resolve_run


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process_averaging_both_batches(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=4)
    out = tmp_path / "run"
    cmd = torchrun_command("train.cli", *tiny_cli_args(cache, out, "--max-steps", "1", "--grad-clip", "0.05"))
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = read_records(out)[0]  # the step record (events such as the schedule's left out)
    trained = load_file(str(out / "step-00000001" / "model.safetensors"))

    # Reference: one process, both ranks' batches and anchors, gradients averaged by hand, then the same
    # clip and a plain (non-fused) AdamW step.
    cfg = tiny_config(cache, tmp_path / "unused", max_steps=1, grad_clip=0.05)
    run = resolve_run(cfg, world_size=2)
    torch.manual_seed(cfg.seed)
    model = DFlashDrafter(run.drafter)
    losses = []
    for rank in (0, 1):
        loss = hand_step_loss(model, run.drafter, cache, cfg, rank=rank, world_size=2)
        loss.total.backward()
        losses.append(float(loss.total.detach()))
    params = list(model.parameters())
    for p in params:
        p.grad /= 2
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    for p in params:
        p.grad *= min(1.0, 0.05 / (float(norm) + 1e-6))
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=False)
    opt.step()

    assert record["loss/total"] == pytest.approx(sum(losses) / 2, abs=1e-6)
    # Token counts are the job's: both ranks' shards of the step, in metrics.jsonl and the summary.
    reader = ShardReader(cache)
    tokens = sum(reader.info(epoch_shard_order(run.train_ids, 0, cfg.seed, r, 2)[0]).num_tokens for r in (0, 1))
    assert record["data/tokens_seen"] == tokens
    assert f"1 step, {tokens:,} tokens" in proc.stdout + proc.stderr
    assert record["opt/grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    worst = max((p.detach() - trained[name]).abs().max().item() for name, p in model.named_parameters())
    assert worst <= 1e-6, f"max abs parameter diff after one step: {worst}"


@pytest.mark.slow
def test_a_setting_resolved_differently_on_two_ranks_is_refused_on_both():
    """--fp8 auto resolves on each rank's machine; ranks that disagree must stop, not train different steps."""

    def ranks_offering(rank0: str, rank1: str) -> subprocess.CompletedProcess:
        command = torchrun_command("tests.helpers.rank_values", rank0, rank1)
        return subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=120)

    agreed = ranks_offering("off", "off")
    assert agreed.returncode == 0 and agreed.stdout.count("agreed") == 2, agreed.stdout + agreed.stderr[-2000:]
    mixed = ranks_offering("linears+head", "off")
    assert mixed.returncode != 0, mixed.stdout
    refusal = "refused: --fp8 came out differently on the ranks (rank 0: linears+head, rank 1: off)"
    assert mixed.stdout.count(refusal) == 2, mixed.stdout + mixed.stderr[-2000:]
