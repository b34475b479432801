"""Training at long positions: a block anchored at position 70,000 of a long sample, read from the pieced
cache dflash-extract wrote, sees the same context and gives the same loss as from the whole sample
(the brute-force reference: one 70K-token context, positions 0..L-1); drafters the pieces cannot serve
are refused by dflash-train, naming the cache's pieces and the flag to change.

A 70K-token forward of the tiny target is too slow on CPU, so extraction runs the real CLI, planner and
writer over a stand-in target whose hidden state is a fixed function of (token, absolute position): a
piece holds the right states exactly when it holds the right tokens at the right positions.
"""

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import extract.runner
from extract.cli import main as extract_cli
from extract.dataset.index import Sample, write_jsonl
from shards import ShardReader, decode_hidden, load_target_head, read_manifest
from shards.inspect import verify_cache
from tests.helpers.drafter import tiny_config, tiny_model_and_head
from tests.helpers.extract import VOCAB, cli_args
from tests.helpers.train import run_steps, tiny_cache, tiny_cli_args
from train.blocks import sample_blocks
from train.cli import main as train_cli
from train.drafter.attention import BlockAttentionLayout, block_mask_dense
from train.drafter.model import TargetHead
from train.loss.chunked import block_loss
from train.loss.config import LossConfig

LENGTH, ANCHOR = 73_000, 70_000
BUDGET, WINDOW, REACH, BLOCK = 2048, 64, 15, 16
TAPS = [1, 4]
HIDDEN = 64  # the tiny target's width


def positional_states(ids_T: torch.Tensor, pos_T: torch.Tensor, num_taps: int) -> torch.Tensor:
    """[T, K, H] float32: a token code plus a sinusoid of the absolute position, per tap."""
    code_VKH = torch.randn(VOCAB, num_taps, HIDDEN, generator=torch.Generator().manual_seed(5))
    freq_H = 1.0 / 10000 ** (torch.arange(HIDDEN) / HIDDEN)
    return code_VKH[ids_T.long()] + torch.sin(pos_T.double().unsqueeze(-1) * freq_H).float().unsqueeze(1)


class PositionalTarget:
    """Stands in for TargetModel in extract.runner: forward_packed is positional_states."""

    def forward_packed(self, ids_T, pos_T, cu_seqlens_S1, tap_layer_ids):
        return positional_states(ids_T, pos_T, len(tap_layer_ids))


@pytest.fixture(scope="module")
def long_sample():
    rng = np.random.default_rng(11)
    mask = (np.arange(LENGTH) % 1000 // 40 != 12).astype(np.uint8)  # 40 unsupervised tokens every 1000
    return Sample("long", rng.integers(0, VOCAB - 1, LENGTH), mask)


@pytest.fixture(scope="module")
def pieced_cache(target, long_sample, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pieced")
    short = Sample("short", np.arange(100) % (VOCAB - 1), np.ones(100, np.uint8))
    write_jsonl(tmp / "d.jsonl", [short, long_sample])
    args = cli_args(target, tmp / "d.jsonl", tmp / "cache", token_budget=BUDGET)
    args += ["--taps", ",".join(map(str, TAPS)), "--max-seq-len", "131072"]
    args += ["--piece-context", str(WINDOW), "--piece-label-reach", str(REACH)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(extract.runner.TargetModel, "from_pretrained", lambda *a, **k: PositionalTarget())
        result = CliRunner().invoke(extract_cli, args)
    assert result.exit_code == 0, result.output
    return tmp / "cache"


def _whole(sample):
    """The brute-force reference's batch: the whole sample as one sequence at positions 0..L-1."""
    return {
        "input_ids": torch.from_numpy(sample.input_ids),
        "position_ids": torch.arange(len(sample), dtype=torch.int32),
        "loss_mask": torch.from_numpy(sample.loss_mask),
        "cu_seqlens": torch.tensor([0, len(sample)], dtype=torch.int32),
    }


def _piece_holding(cache, position):
    reader = ShardReader(cache)
    manifest = read_manifest(cache)
    for sid, b in zip(manifest["sample_id"].to_pylist(), manifest["batch_id"].to_pylist()):
        t, _ = reader.read(b, verify_checksum=True)
        own = t["position_ids"][t["anchor_mask"].bool()]
        if sid == "long" and int(own[0]) <= position <= int(own[-1]):
            return t
    raise AssertionError(f"no piece owns position {position}")


def _block_at(anchor_index, tensors):
    """The one block anchored at packed index `anchor_index` (the cache's anchor rule must allow it)."""
    only_T = torch.zeros_like(tensors["loss_mask"])
    only_T[anchor_index] = 1
    return sample_blocks(
        input_ids_T=tensors["input_ids"],
        position_ids_T=tensors["position_ids"],
        loss_mask_T=tensors["loss_mask"],
        cu_seqlens_S1=tensors["cu_seqlens"],
        anchor_mask_T=tensors.get("anchor_mask", torch.ones_like(only_T)) & only_T,
        num_blocks=1,
        block_size=BLOCK,
        mask_token_id=VOCAB - 1,
    )


def _loss_and_context(model, head, drafter, tensors, hidden_TKH, anchor_index):
    blocks = _block_at(anchor_index, tensors)
    assert bool(blocks.block_valid_N[0]), "the anchor must be allowed"
    num_ctx = hidden_TKH.shape[0]
    layout = BlockAttentionLayout.for_drafter(drafter, num_ctx=num_ctx, num_blocks=1)
    layout.update(blocks.seq_start_N, blocks.anchor_N)
    out = model(hidden_TKH, tensors["position_ids"], head.embed(blocks.block_ids_NB), blocks.block_pos_NB, layout)
    loss = block_loss(out, head, blocks, LossConfig())
    mask_QL = block_mask_dense(
        blocks.seq_start_N, blocks.anchor_N, num_ctx=num_ctx, block_size=BLOCK, sliding_window=WINDOW
    )
    seen = [tensors["position_ids"][row[:num_ctx]].tolist() for row in mask_QL]  # context positions per slot
    return loss, seen, blocks


def test_block_at_70k_trains_as_on_the_whole_sample(pieced_cache, long_sample):
    drafter = tiny_config(
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        mask_token_id=VOCAB - 1,
        block_size=BLOCK,
        tap_layer_ids=TAPS,
        num_target_layers=8,
        layer_types=["sliding_attention"] * 2,
        sliding_window=WINDOW,
        max_position_embeddings=131072,
    )
    model, _ = tiny_model_and_head(drafter)
    raw = load_target_head(pieced_cache)
    head = TargetHead(raw["embed_tokens"].float(), raw["lm_head"].float())

    piece = _piece_holding(pieced_cache, ANCHOR)
    start = int(piece["position_ids"][0])
    assert start > 0 and int(piece["position_ids"][-1]) < LENGTH - 1, "the anchor's piece is a middle one"
    stored = decode_hidden(piece["hidden"], piece.get("hidden_scale")).float()
    got, got_seen, got_blocks = _loss_and_context(model, head, drafter, piece, stored, ANCHOR - start)

    # The brute-force reference: the whole sample as one sequence, states as stored (bf16-rounded).
    whole = _whole(long_sample)
    states = positional_states(whole["input_ids"], whole["position_ids"], len(TAPS)).to(torch.bfloat16).float()
    want, want_seen, want_blocks = _loss_and_context(model, head, drafter, whole, states, ANCHOR)

    assert got_seen == want_seen and want_seen[0] == list(range(ANCHOR - WINDOW + 1, ANCHOR))
    assert torch.equal(got_blocks.block_pos_NB, want_blocks.block_pos_NB)
    assert torch.equal(got_blocks.labels_NB, want_blocks.labels_NB)
    assert torch.equal(got_blocks.weights_NB, want_blocks.weights_NB) and want_blocks.weights_NB.sum() > 0
    torch.testing.assert_close(got.total, want.total, rtol=1e-5, atol=1e-6)


def test_piece_anchors_cover_every_sample_anchor_once(pieced_cache, long_sample):
    """Over all pieces, the anchors training may draw are exactly the whole sample's, each once."""
    reader = ShardReader(pieced_cache)
    counts = torch.zeros(LENGTH, dtype=torch.int64)
    for b in reader.batch_ids():
        t, info = reader.read(b)
        if info.samples[0].sample_id != "long":
            continue
        blocks_valid = _valid_positions(t)
        counts.index_add_(0, blocks_valid, torch.ones_like(blocks_valid))
    whole = _valid_positions(_whole(long_sample))
    expected = torch.zeros(LENGTH, dtype=torch.int64)
    expected[whole] = 1
    assert torch.equal(counts, expected)


def _valid_positions(t):
    """Absolute positions of the anchors sample_blocks may draw in `t` (all of them: num_blocks = T)."""
    blocks = sample_blocks(
        input_ids_T=t["input_ids"],
        position_ids_T=t["position_ids"],
        loss_mask_T=t["loss_mask"],
        cu_seqlens_S1=t["cu_seqlens"],
        anchor_mask_T=t.get("anchor_mask"),
        num_blocks=t["input_ids"].shape[0],
        block_size=BLOCK,
        mask_token_id=VOCAB - 1,
    )
    return t["position_ids"][blocks.anchor_N.long()[blocks.block_valid_N]].long()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--layer-types", "sliding,full", "--sliding-window", "64"], ["full-attention layer", "--max-seq-len 2048"]),
        (["--layer-types", "sliding", "--sliding-window", "128"], ["--sliding-window 128", "--piece-context 128"]),
        (["--layer-types", "sliding", "--sliding-window", "64", "--block-size", "32"], ["--piece-label-reach 31"]),
    ],
)
def test_drafters_the_pieces_cannot_serve_are_refused(pieced_cache, tmp_path, flags, words):
    args = tiny_cli_args(pieced_cache, tmp_path / "run", "--eval-shards", "1")
    num_layers = len(flags[1].split(","))  # click keeps the last of a repeated option
    result = CliRunner().invoke(train_cli, [*args, "--num-layers", str(num_layers), *flags])
    assert result.exit_code != 0
    assert "stores samples of up to 73000 tokens as pieces" in result.output, result.output
    for word in words:
        assert word in result.output, result.output


def test_a_version_2_cache_reads_and_trains_as_before(tmp_path):
    """Version 2 shards have no anchor_mask: every real token may hold an anchor, so training on one
    takes the steps it takes on the same shards written as version 3."""
    sums = {}
    for version in (2, 3):
        cache = tiny_cache(tmp_path / f"v{version}", num_batches=2, format_version=version)
        assert ("anchor_mask" in ShardReader(cache).specs) == (version == 3)
        assert verify_cache(cache).ok
        sums[version] = run_steps(cache, tmp_path / f"run{version}", num_steps=2)["sums"]
    assert torch.equal(sums[2], sums[3])


def test_eval_refuses_a_full_attention_drafter_on_a_pieced_cache(pieced_cache, tmp_path):
    """A drafter trained elsewhere with a full-attention layer is not walked over pieces that cut its context."""
    short = tiny_cache(tmp_path / "short", num_batches=2, hidden_size=HIDDEN, vocab_size=VOCAB, tap_layer_ids=TAPS)
    run = tmp_path / "run"
    trained = CliRunner().invoke(train_cli, [*tiny_cli_args(short, run), "--max-steps", "1"])
    assert trained.exit_code == 0, trained.output
    result = CliRunner().invoke(
        train_cli, ["eval", "--drafter", str(run), "--cache", str(pieced_cache), "--eval-shards", "1", "--budgets", ""]
    )
    assert result.exit_code != 0 and "full-attention layer" in result.output, result.output
