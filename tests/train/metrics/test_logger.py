"""Loss is not metrics: every logged step carries its loss; monitoring metrics follow their own cadence."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from click.testing import CliRunner

from tests.helpers.train import mix_modes, read_records, tiny_cache, tiny_config
from train.cli import main as train_cli
from train.loop import run_training
from train.metrics.logger import MetricsLogger, StepTotals


def test_loss_logged_every_step_and_metrics_on_their_own_cadence(tmp_path):
    """The old bug: with metrics_every=8 and log_every=1, steps without metrics logged no loss."""
    cache = tiny_cache(tmp_path / "cache", num_batches=4)
    run_training(tiny_config(cache, tmp_path / "run", epochs=5, max_steps=17, metrics_every=8, log_every=1))
    records = read_records(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 18))
    for r in records:
        assert math.isfinite(r["loss/ce"]) and r["loss/ce"] > 0, f"step {r['step']} lost its loss: {r}"
        assert "loss/total" in r and "perf/tokens_per_s" in r and "perf/eta_s" in r
    with_metrics = [r["step"] for r in records if "acc/slot_01" in r]
    assert with_metrics == [1, 9, 17], f"metrics on steps {with_metrics}, expected [1, 9, 17]"
    for r in records:
        if r["step"] in (1, 9, 17):
            assert {"acc/top4_slot_01", "accept/streak", "accept/top4_streak"} <= set(r)
            assert 0 <= r["acc/slot_01"] <= 1


def test_metrics_every_below_one_is_clamped_with_a_warning(tmp_path, caplog):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    with caplog.at_level(logging.WARNING):
        cfg = tiny_config(cache, tmp_path / "run", metrics_every=0)
    assert cfg.metrics_every == 1
    assert "--metrics-every 0 < 1: clamped to 1" in caplog.text


def test_log_divides_summed_pairs_like_a_naive_average(tmp_path):
    """Two metric steps with different counts: the logged accuracy is total correct / total labels,
    not the mean of per-step ratios; loss is the mean over steps."""
    B = 3
    totals = StepTotals(B, torch.device("cpu"))
    ml = MetricsLogger(
        out_dir=tmp_path,
        total_steps=10,
        log_every=1,
        metrics_every=1,
        metrics_topk=4,
        is_main=True,
        device=torch.device("cpu"),
    )
    steps = [((2.0, 3.0), [3.0, 1.0], [4.0, 2.0], 5.0, 4.0), ((4.0, 1.0), [0.0, 1.0], [1.0, 1.0], 1.0, 1.0)]
    for i, ((total, ce), correct, count, streak, blocks) in enumerate(steps):
        parts = [torch.tensor(total), torch.tensor(ce), torch.tensor(0.0), torch.tensor(0.0)]
        totals.add_step(
            parts,
            torch.tensor(1.0),
            torch.ones(2, B, dtype=torch.bool),
            torch.ones(2, dtype=torch.bool),
            torch.tensor(float(i), dtype=torch.float64),
            torch.tensor([i]),
            torch.tensor(True),
        )
        zeros = torch.zeros(B - 1)
        c = torch.tensor(count)
        totals.add_metrics(
            {
                "top1_slot": (torch.tensor(correct), c),
                "topk_slot": (zeros, c),
                "ce_slot": (zeros, c),
                "accept_streak": (torch.tensor(streak), torch.tensor(blocks)),
                "topk_streak": (torch.tensor(0.0), torch.tensor(blocks)),
                "expected_accept": (torch.tensor(0.0), torch.tensor(blocks)),
            }
        )
    rec = ml.log(2, 0, totals, lr=1e-3)
    ml.close()
    assert rec["loss/total"] == pytest.approx(3.0) and rec["loss/ce"] == pytest.approx(2.0)
    assert rec["acc/slot_01"] == pytest.approx(3 / 5) and rec["acc/slot_02"] == pytest.approx(2 / 3)
    assert rec["accept/streak"] == pytest.approx(6 / 5)
    assert float(totals.sums.flat.abs().sum()) == 0, "totals must reset after a log"


def _all_records(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_exact_key_sets_of_training_and_eval_records(tmp_path):
    """A key that vanishes from (or sneaks into) the logs fails here: the exact set of a training
    record with and without monitoring metrics, and of an eval record (block size 4: 3 draft slots)."""
    cache = tiny_cache(tmp_path / "cache", num_batches=3)
    run_training(tiny_config(cache, tmp_path / "run", max_steps=2, metrics_every=2, eval_shards=1))
    records = _all_records(tmp_path / "run")
    steps = [r for r in records if "event" not in r]
    evals = [r for r in records if r.get("event") == "eval"]
    base = {
        "time",
        "step",
        "epoch",
        "loss/total",
        "loss/ce",
        "loss/kl",
        "loss/cap",
        "opt/lr",
        "opt/grad_norm",
        "data/labels_per_step",
        "data/blocks_per_step",
        "data/tokens_seen",
        "data/skipped_shards",
        "perf/tokens_per_s",
        "perf/data_wait_frac",
        "perf/eta_s",
        "perf/eval_s",
    }
    slots = {f"{prefix}{k:02d}" for prefix in ("acc/slot_", "acc/top4_slot_", "ce/slot_") for k in (1, 2, 3)}
    monitoring = slots | {"accept/streak", "accept/top4_streak", "accept/expected"}
    assert [r["step"] for r in steps] == [1, 2]
    assert set(steps[0]) == base | monitoring, sorted(set(steps[0]) ^ (base | monitoring))
    assert set(steps[1]) == base, sorted(set(steps[1]) ^ base)
    assert 0 <= steps[1]["perf/data_wait_frac"] <= 1
    want_eval = {
        "time",
        "event",
        "step",
        "eval/acceptance_length",
        "eval/acceptance_length_pooled",
        "eval/heldout_loss",
        "eval/random_anchor_chain_length",
        "eval/batch_ids",
        "eval/seconds",
        "eval/slot_acceptance_01",
        "eval/slot_acceptance_02",
        "eval/slot_acceptance_03",
        "eval/acceptance_length_ctx_0-2K",  # the context buckets with steps: the tiny cache's are all short
    }  # no eval/tree_acceptance_*: the in-training eval walks trees only with --eval-tree-budgets
    assert [r["step"] for r in evals] == [0, 2]  # the untrained drafter, then the end of training
    for r in evals:
        assert set(r) == want_eval, sorted(set(r) ^ want_eval)


def test_the_in_training_eval_logs_acceptance_per_mode_of_a_mixed_cache(tmp_path):
    """Each mode with responses in the held-out shard gets its curve (eval/acceptance_length_mode_*)."""
    modes = [
        {"thinking": "on", "template_kwargs": {}},
        {"thinking": "off", "template_kwargs": {"reasoning_effort": "low"}},
    ]
    cache = mix_modes(tiny_cache(tmp_path / "cache", num_batches=3), modes)
    run_training(tiny_config(cache, tmp_path / "run", max_steps=2, metrics_every=2, eval_shards=1))
    evals = [r for r in _all_records(tmp_path / "run") if r.get("event") == "eval"]
    keys = {"eval/acceptance_length_mode_thinking_on", "eval/acceptance_length_mode_thinking_off,reasoning_effort=low"}
    assert evals and all(keys <= set(r) for r in evals), sorted(evals[0])
    for r in evals:  # the responses' mean over both modes lies between the modes' own means
        low, high = sorted(r[k] for k in keys)
        assert low - 1e-9 <= r["eval/acceptance_length"] <= high + 1e-9
    # `dflash-train eval` on the same held-out shard: the same figures per mode, in its JSON and table.
    out = tmp_path / "eval.json"
    args = ["eval", "--drafter", str(tmp_path / "run"), "--cache", str(cache), "--eval-shards", "1"]
    result = CliRunner().invoke(train_cli, [*args, "--budgets", "", "--out", str(out)])
    assert result.exit_code == 0, result.output
    by_mode = json.loads(out.read_text())["acceptance_by_mode"]
    assert by_mode == {"thinking on": pytest.approx(evals[-1]["eval/acceptance_length_mode_thinking_on"])} | {
        'thinking off, reasoning_effort="low"': pytest.approx(
            evals[-1]["eval/acceptance_length_mode_thinking_off,reasoning_effort=low"]
        )
    }
    assert "acceptance by serving mode" in result.output


def test_named_sums_against_a_float64_loop():
    """Scalars and vectors added by name land in their own slices; mean divides by the paired count
    (None where it is 0), a 1-element count divides a whole vector, reset zeroes everything."""
    from train.metrics.sums import Sums

    gen = torch.Generator().manual_seed(0)
    sums = Sums({"steps": 1, "loss": 1, "slot": 3, "slot.count": 3, "blocks": 1}, "cpu")
    want = {"steps": [0.0], "loss": [0.0], "slot": [0.0] * 3, "slot.count": [0.0] * 3, "blocks": [0.0]}
    for i in range(20):
        loss = torch.rand((), generator=gen, dtype=torch.float32)
        slot = torch.randint(0, 5, (3,), generator=gen)
        count = torch.tensor([2, 0, 1]) * (i % 3)
        sums.add("steps", 1.0)
        sums.add("loss", loss)
        sums.add("slot", slot)
        sums.add("slot.count", count)
        sums.add("blocks", torch.tensor(True))
        want["steps"][0] += 1
        want["loss"][0] += float(loss)
        want["blocks"][0] += 1
        for k in range(3):
            want["slot"][k] += float(slot[k])
            want["slot.count"][k] += float(count[k])
    host = sums.reduce_to_host(local=torch.tensor([-1, 7]))
    for name, values in want.items():
        assert host[name] == pytest.approx(values, abs=1e-12), name
    assert host.local == [-1.0, 7.0]
    assert host.mean("slot") == [
        pytest.approx(want["slot"][0] / want["slot.count"][0]),
        None,
        pytest.approx(want["slot"][2] / want["slot.count"][2]),
    ]
    assert host.mean("slot", "steps") == pytest.approx([s / 20 for s in want["slot"]])
    assert host.scalar("loss") == pytest.approx(want["loss"][0])
    sums.reset()
    assert float(sums.flat.abs().sum()) == 0
    with pytest.raises(ValueError, match="'bad' needs a size >= 1"):
        Sums({"bad": 0}, "cpu")
