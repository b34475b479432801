"""dflash-extract --max-seq-len: a sample longer than a shard goes through the tiny target whole and is
stored as overlapping pieces with absolute positions; its states are the full forward's, not a chunked
prefill's."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from extract.cli import main as extract_cli
from extract.dataset.index import Sample, write_jsonl
from extract.target.model import TargetModel
from shards import ShardReader, decode_hidden, read_manifest
from shards.inspect import verify_cache
from tests.helpers.extract import VOCAB, cli_args, rel_l2

BUDGET, CONTEXT, REACH = 128, 24, 7
LONG = 700  # > BUDGET: six pieces


def _dataset(path, long_len=LONG):
    rng = np.random.default_rng(3)
    samples = [Sample(f"short-{i}", rng.integers(0, VOCAB, 50), np.ones(50, np.uint8)) for i in range(3)]
    mask = (np.arange(long_len) % 97 > 10).astype(np.uint8)
    samples.append(Sample("long", rng.integers(0, VOCAB, long_len), mask))
    write_jsonl(path, samples)
    return {s.sample_id: s for s in samples}


def _extract(target, data, out, *extra):
    args = cli_args(target, data, out, "--piece-context", str(CONTEXT), "--piece-label-reach", str(REACH), *extra)
    return CliRunner().invoke(extract_cli, [*args, "--token-budget", str(BUDGET)])


def _pieces(out):
    """(position_ids, anchor_mask, hidden float32, loss_mask, input_ids) of each piece of "long", in order."""
    reader = ShardReader(out)
    manifest = read_manifest(out)
    batches = [b for s, b in zip(manifest["sample_id"].to_pylist(), manifest["batch_id"].to_pylist()) if s == "long"]
    pieces = []
    for b in batches:
        t, _ = reader.read(b, verify_checksum=True)
        hidden = decode_hidden(t["hidden"], t.get("hidden_scale")).float()
        pieces.append((t["position_ids"].long(), t["anchor_mask"].bool(), hidden, t["loss_mask"], t["input_ids"]))
    return pieces


@pytest.fixture(scope="module")
def long_cache(target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("long")
    samples = _dataset(tmp / "d.jsonl")
    result = _extract(target, tmp / "d.jsonl", tmp / "cache", "--max-seq-len", "1024")
    assert result.exit_code == 0, result.output
    return tmp / "cache", samples


def test_long_sample_states_equal_one_full_forward(target, long_cache):
    out, samples = long_cache
    assert verify_cache(out).ok
    long = samples["long"]
    model = TargetModel.from_pretrained(target, "cpu", dtype=torch.float32)
    taps = ShardReader(out).config.tap_layer_ids
    ids = torch.from_numpy(long.input_ids.astype(np.int64))
    full = model.forward_packed(ids, torch.arange(LONG), torch.tensor([0, LONG], dtype=torch.int32), taps)
    pieces = _pieces(out)
    assert len(pieces) > 2
    for pos, _, hidden, loss_mask, input_ids in pieces:
        start = int(pos[0])
        assert torch.equal(pos, torch.arange(start, start + BUDGET)), "positions must be the sample's own"
        assert torch.equal(input_ids, torch.from_numpy(long.input_ids[start : start + BUDGET]))
        assert torch.equal(loss_mask, torch.from_numpy(long.loss_mask[start : start + BUDGET]))
        # Stored in bf16: 2^-8 relative rounding of the float32 full forward.
        assert rel_l2(hidden, full[start : start + BUDGET]) < 0.006, start
        if start > 0:  # the same tokens as a prefill of their own (state and attention from zero) differ
            alone = model.forward_packed(
                ids[start : start + BUDGET], torch.arange(start, start + BUDGET), torch.tensor([0, BUDGET]), taps
            )
            assert rel_l2(alone, full[start : start + BUDGET]) > 0.05, start


def test_pieces_overlap_by_context_and_own_parts_tile_the_sample(long_cache):
    out, _ = long_cache
    owner = torch.zeros(LONG, dtype=torch.int64)
    for i, (pos, anchor_mask, *_rest) in enumerate(_pieces(out)):
        own = pos[anchor_mask]
        lo, hi = int(own[0]), int(own[-1]) + 1
        assert torch.equal(own, torch.arange(lo, hi)), "a piece's own part is one run"
        assert lo == 0 or lo - int(pos[0]) >= CONTEXT, f"piece {i} keeps {lo - int(pos[0])} tokens of context"
        assert hi == LONG or int(pos[-1]) + 1 - hi >= REACH, f"piece {i} keeps too few labels after its own part"
        owner[lo:hi] += 1
    assert torch.equal(owner, torch.ones(LONG, dtype=torch.int64)), "every position is in exactly one own part"
    pieces = json.loads((out / "cache.json").read_text())["pieces"]
    assert pieces["context"] == CONTEXT and pieces["label_reach"] == REACH and pieces["longest_sample"] == LONG
    assert pieces["num_pieced_samples"] == 1 and pieces["max_seq_len"] == 1024
    manifest = read_manifest(out)
    assert sorted(set(manifest["sample_id"].to_pylist())) == ["long", "short-0", "short-1", "short-2"]


def test_longer_than_max_seq_len_follows_long_seqs(target, tmp_path):
    _dataset(tmp_path / "d.jsonl")
    refused = _extract(target, tmp_path / "d.jsonl", tmp_path / "a", "--max-seq-len", "512", "--long-seqs", "error")
    assert refused.exit_code != 0 and "max_seq_len 512" in refused.output and "--max-seq-len" in refused.output
    cut = _extract(target, tmp_path / "d.jsonl", tmp_path / "b", "--max-seq-len", "512")
    assert cut.exit_code == 0, cut.output
    config = json.loads((tmp_path / "b" / "cache.json").read_text())
    assert config["pieces"]["longest_sample"] == 512 and config["packing"]["num_truncated"] == 1


def test_piece_settings_leaving_no_own_part_are_refused(target, tmp_path):
    _dataset(tmp_path / "d.jsonl")
    result = CliRunner().invoke(
        extract_cli,
        [*cli_args(target, tmp_path / "d.jsonl", tmp_path / "c", token_budget=BUDGET), "--max-seq-len", "1024"],
    )  # the default context (2048) is longer than a 128-token piece
    assert result.exit_code == 2 and "--piece-context 2048" in result.output and "--token-budget 128" in result.output


def test_a_long_samples_pieces_go_to_one_rank_and_the_ranks_cover_the_plan(tmp_path):
    """One forward serves all of a sample's pieces, so they are planned onto the rank of the first."""
    from extract.dataset.index import scan_dataset
    from extract.dataset.packing import PackingConfig, plan_batches, shard_batches_for_rank

    rng = np.random.default_rng(0)
    samples = [Sample(f"s{i}", rng.integers(0, VOCAB, n), np.ones(n, np.uint8)) for i, n in enumerate([90, 700, 500])]
    write_jsonl(tmp_path / "d.jsonl", samples)
    cfg = PackingConfig(
        token_budget=BUDGET, max_seqs=4, max_seq_len=1024, piece_context=CONTEXT, piece_label_reach=REACH
    )
    plan = plan_batches(scan_dataset(tmp_path / "d.jsonl", vocab_size=VOCAB, token_budget=1024), cfg)
    assert plan.num_pieced == 2 and plan.longest_packed == 700
    mine = [shard_batches_for_rank(plan, rank, 3) for rank in range(3)]
    assert sorted(b.batch_id for m in mine for b in m) == [b.batch_id for b in plan.batches]
    for m in mine:
        owners = {b.sample_ids[0] for b in m if b.piece is not None}
        for sid in owners:  # every piece of a sample this rank holds: all of that sample's pieces
            assert {b.batch_id for b in m if b.sample_ids == [sid]} == {
                b.batch_id for b in plan.batches if b.sample_ids == [sid]
            }
