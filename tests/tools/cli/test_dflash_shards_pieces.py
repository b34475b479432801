"""dflash-shards on long samples stored as pieces: info counts a long sample once (and says in how many
pieces), show reads it whole at its absolute positions, each from the own part of the piece holding it,
checked against the dataset's tokens and the shards' raw tensors."""

import json

import pytest
import torch
from click.testing import CliRunner

from shards import ShardReader, decode_context, read_manifest
from tests.helpers.extract import extract_pieced_cache
from tools.cli.dflash_shards import main

LENGTHS = {"short-0": 100, "short-1": 60, "long-a": 300, "long-b": 420}


@pytest.fixture(scope="module")
def pieced(target, tmp_path_factory):
    return extract_pieced_cache(target, tmp_path_factory.mktemp("shards"), LENGTHS)


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _owner_rows(cache, sample_id):
    """{position: (batch id, row)} of the sample's positions, each in the piece whose anchor_mask marks it."""
    reader, manifest = ShardReader(cache), read_manifest(cache)
    owners = {}
    for sid, b in zip(manifest["sample_id"].to_pylist(), manifest["batch_id"].to_pylist()):
        if sid != sample_id:
            continue
        t, _ = reader.read(b)
        for row in torch.nonzero(t["anchor_mask"]).flatten().tolist():
            assert int(t["position_ids"][row]) not in owners, "own parts overlap"
            owners[int(t["position_ids"][row])] = (b, row)
    return owners


def test_info_counts_a_long_sample_once_and_its_pieces(pieced):
    cache, _ = pieced
    reader = ShardReader(cache)
    holders = {
        sid: [b for b in reader.batch_ids() if sid in {s.sample_id for s in reader.info(b).samples}] for sid in LENGTHS
    }
    s = json.loads(_invoke("info", cache, "--json").output)
    num_pieces = len(holders["long-a"]) + len(holders["long-b"])
    assert len(holders["long-a"]) > 2 and len(holders["long-b"]) > 3
    assert (s["num_samples"], s["num_long_samples"], s["num_pieces"]) == (4, 2, num_pieces)
    assert f"samples          4 (2 long, stored as {num_pieces} pieces)" in _invoke("info", cache).output


def test_show_reads_a_long_sample_whole_from_its_own_parts(pieced):
    cache, samples = pieced
    long = samples["long-b"]
    s = json.loads(_invoke("show", cache, "long-b", "--json").output)
    assert s["length"] == len(long) and s["input_ids"] == long.input_ids.tolist()
    assert s["loss_mask"] == long.loss_mask.tolist() and s["loss_tokens"] == int(long.loss_mask.sum())
    owners = _owner_rows(cache, "long-b")
    assert sorted(owners) == list(range(len(long)))
    assert [p["batch_id"] for p in s["pieces"]] == sorted({b for b, _ in owners.values()})
    reader = ShardReader(cache)
    shards = {b: reader.read(b)[0] for b, _ in owners.values()}
    whole = torch.stack([decode_context(shards[b], reader.config)[row] for b, row in owners.values()]).double()
    for j, tap in enumerate(s["hidden"]):
        h = whole[:, j]
        assert tap["mean"] == pytest.approx(h.mean().item(), rel=1e-9, abs=1e-12)
        assert tap["std"] == pytest.approx(h.std().item(), rel=1e-9)
        assert tap["rms"] == pytest.approx(h.pow(2).mean().sqrt().item(), rel=1e-9)
        assert tap["absmax"] == h.abs().max().item() and tap["finite"]
    text = _invoke("show", cache, "long-b", "--max-tokens", 0).output
    assert f"{len(s['pieces'])} pieces in batches {s['pieces'][0]['batch_id']} (0.." in text
    shown = next(line for line in text.splitlines() if line.startswith("input_ids"))
    assert shown.split()[1:] == [str(i) for i in long.input_ids]


def test_show_position_reads_the_piece_that_owns_it(pieced):
    cache, samples = pieced
    long = samples["long-b"]
    owners = _owner_rows(cache, "long-b")
    firsts = sorted({min(p for p, (b, _) in owners.items() if b == batch) for batch, _ in owners.values()})
    reader = ShardReader(cache)
    for p in [5, *firsts[1:], *(f - 1 for f in firsts[1:]), len(long) - 1]:  # each side of every piece's start
        res = _invoke("show", cache, "long-b", "--position", p, "--json")
        assert res.exit_code == 0, res.output
        topk = json.loads(res.output)["target_topk"]
        batch, row = owners[p]
        t, _ = reader.read(batch)
        assert topk["batch_id"] == batch, p
        assert topk["ids"] == t["target_topk_ids"][row].tolist()
        assert topk["logprobs"] == t["target_topk_logprobs"][row].float().tolist()
        assert topk["token_id"] == int(long.input_ids[p])
        assert topk["next_token_id"] == (int(long.input_ids[p + 1]) if p + 1 < len(long) else None)


def test_show_position_past_a_long_sample_is_refused(pieced):
    cache, samples = pieced
    n = len(samples["long-b"])
    res = _invoke("show", cache, "long-b", "--position", n)
    assert res.exit_code == 1
    assert f"--position {n} is outside sample 'long-b' (positions 0..{n - 1})" in res.output


def test_show_a_whole_sample_of_a_pieced_cache_as_before(pieced):
    cache, samples = pieced
    s = json.loads(_invoke("show", cache, "short-1", "--position", 59, "--json").output)
    assert s["pieces"] is None and s["length"] == 60 and s["input_ids"] == samples["short-1"].input_ids.tolist()
    t, _ = ShardReader(cache).read(s["batch_id"])
    assert s["target_topk"]["ids"] == t["target_topk_ids"][s["offset"] + 59].tolist()
    assert s["target_topk"]["next_token_id"] is None
