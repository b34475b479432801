"""extract.dataset.packing.assemble_batch / load_batch against a plain-loop reference packer."""

import numpy as np
import pytest

from extract.dataset.index import Sample, SampleLoader, scan_dataset, write_jsonl, write_parquet
from extract.dataset.packing import PackingConfig, assemble_batch, load_batch, plan_batches


def reference_pack(samples, token_budget, max_seqs, pad_token_id):
    """One packed batch built token by token, for comparison."""
    input_ids, position_ids, loss_mask, cu = [], [], [], [0]
    for s in samples:
        n = min(len(s), token_budget)
        for t in range(n):
            input_ids.append(int(s.input_ids[t]))
            position_ids.append(t)
            loss_mask.append(int(s.loss_mask[t]))
        cu.append(cu[-1] + n)
    total = cu[-1]
    while len(input_ids) < token_budget:
        input_ids.append(pad_token_id)
        position_ids.append(0)
        loss_mask.append(0)
    while len(cu) < max_seqs + 1:
        cu.append(total)
    return {"input_ids": input_ids, "position_ids": position_ids, "loss_mask": loss_mask, "cu_seqlens": cu}


def random_samples(lengths, seed=0, vocab=500):
    rng = np.random.default_rng(seed)
    return [Sample(f"x{i}", rng.integers(0, vocab, n), rng.integers(0, 2, n)) for i, n in enumerate(lengths)]


SHAPES = {"input_ids": np.int32, "position_ids": np.int32, "loss_mask": np.uint8, "cu_seqlens": np.int32}


@pytest.mark.parametrize("lengths", [[5, 1, 9, 3], [64], [], [10, 10, 10, 10, 10, 10]])
def test_matches_reference(lengths):
    cfg = PackingConfig(token_budget=64, max_seqs=6, pad_token_id=7)
    samples = random_samples(lengths)
    got = assemble_batch(samples, cfg)
    want = reference_pack(samples, cfg.token_budget, cfg.max_seqs, cfg.pad_token_id)
    for name, dtype in SHAPES.items():
        size = cfg.max_seqs + 1 if name == "cu_seqlens" else cfg.token_budget
        assert got[name].dtype == dtype and got[name].shape == (size,), (name, got[name].dtype, got[name].shape)
        diff = np.abs(got[name].astype(np.int64) - np.array(want[name])).max()
        assert diff == 0, f"{name}: max abs diff {diff}"
    np.testing.assert_array_equal(got["sample_lengths"], lengths)
    np.testing.assert_array_equal(got["sample_offsets"], want["cu_seqlens"][: len(lengths)])
    np.testing.assert_array_equal(got["sample_loss_tokens"], [int(s.loss_mask.sum()) for s in samples])


def test_truncation_keeps_the_first_tokens():
    cfg = PackingConfig(token_budget=16, max_seqs=2)
    (s,) = random_samples([40])
    got = assemble_batch([s], cfg)
    np.testing.assert_array_equal(got["input_ids"], s.input_ids[:16])
    np.testing.assert_array_equal(got["position_ids"], np.arange(16))
    assert got["cu_seqlens"].tolist() == [0, 16, 16]
    assert got["sample_loss_tokens"].tolist() == [int(s.loss_mask[:16].sum())]


@pytest.mark.parametrize(
    "lengths,cfg,match",
    [
        ([40], PackingConfig(token_budget=16, max_seqs=2, long_seqs="skip"), "more than token_budget 16"),
        ([10, 10], PackingConfig(token_budget=16, max_seqs=2), "hold 20 tokens, more than token_budget 16"),
        ([1, 1, 1], PackingConfig(token_budget=16, max_seqs=2), "3 samples exceed max_seqs 2"),
    ],
)
def test_refuses_batches_that_do_not_fit(lengths, cfg, match):
    with pytest.raises(ValueError, match=match):
        assemble_batch(random_samples(lengths), cfg)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_plan_load_assemble_round_trip(tmp_path, fmt):
    lengths = np.random.default_rng(3).integers(1, 90, 80).tolist() + [130]
    samples = random_samples(lengths, seed=4)
    path = tmp_path / f"d.{fmt}"
    (write_jsonl if fmt == "jsonl" else write_parquet)(path, samples)
    cfg = PackingConfig(token_budget=128, max_seqs=5)
    index = scan_dataset(path, vocab_size=500)
    plan = plan_batches(index, cfg)
    loader = SampleLoader(index)
    by_id = {s.sample_id: s for s in samples}
    seen = []
    for batch in plan.batches:
        arrays = load_batch(loader, batch, cfg)
        want = reference_pack([by_id[i] for i in batch.sample_ids], cfg.token_budget, cfg.max_seqs, cfg.pad_token_id)
        for name in SHAPES:
            np.testing.assert_array_equal(arrays[name], want[name], err_msg=f"batch {batch.batch_id} {name}")
        assert arrays["sample_offsets"].tolist() == [sum(batch.lengths[:i]) for i in range(len(batch.lengths))]
        seen += batch.sample_ids
    assert sorted(seen) == sorted(by_id)
    assert plan.num_truncated == 1
