"""Sample ids are bounded where the data are first read (issue 26, class 3): the writer never writes
what its reader refuses (shards/sample_ids.py holds the one set of bounds).

  1. dflash-extract refuses, at the scan and naming file and row, every id past MAX_SAMPLE_ID_BYTES,
     holding a control character or a lone surrogate (JSONL and Parquet, given or derived from a file
     name), before any model loads: nothing is written. A 65 MB id once produced shards and then a
     header its own reader refused, and a surrogate failed deep in the writer naming nothing.
  2. The longest id allowed, of the characters that take the most header bytes, round-trips: extracted,
     verified, listed in the manifest, found by dflash-shards show.
  3. The header bound: MAX_SHARD_SAMPLES samples of the worst ids fit what the reader accepts, and
     --max-seqs past it is refused before any work.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from extract.cli import main as extract_cli
from shards import CacheConfig, SampleEntry, ShardReader, TargetInfo, create_cache, read_manifest, write_shard
from shards.container import MAX_HEADER_BYTES
from shards.format import tensor_specs
from shards.sample_ids import MAX_SAMPLE_ID_BYTES, MAX_SHARD_SAMPLES
from tests.helpers.extract import cli_args
from tools.cli.dflash_shards import main as shards_cli

ROW = {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}


def extract(target, data, out, *extra):
    return CliRunner().invoke(extract_cli, cli_args(target, data, out, *extra))


def refused(result) -> bool:
    return result.exit_code == 1 and (result.exception is None or isinstance(result.exception, SystemExit))


def test_bad_ids_are_refused_at_the_scan_naming_file_and_row(target, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    lines = [
        json.dumps({"id": "fine", **ROW}),
        json.dumps({"id": "x" * (MAX_SAMPLE_ID_BYTES + 1), **ROW}),
        json.dumps({"id": "\u00e9" * (MAX_SAMPLE_ID_BYTES // 2 + 1), **ROW}),  # bytes of UTF-8, not characters
        json.dumps({"id": "doc\x1b]0;owned\x07", **ROW}),
        json.dumps({"id": "two\nlines", **ROW}),
        '{"id": "half \\ud800 a pair", "input_ids": [1, 2], "loss_mask": [1, 1]}',
    ]
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"id": ["ok", "tab\there"], "input_ids": [[1, 2], [3, 4]]}), folder / "b.parquet")
    os.mkdir(folder / "sub")
    (folder / "sub" / "c\u202e.jsonl").write_text(json.dumps(ROW) + "\n")  # no id: derived from the name
    out = tmp_path / "cache"
    result = extract(target, folder, out)
    assert refused(result), result.output
    text = result.output
    a, b, c = folder / "a.jsonl", folder / "b.parquet", folder / "sub" / "c\\u202e.jsonl"
    for expected in (
        f"{a}, row 1 (line 2): id 'xxxx",
        f"is {MAX_SAMPLE_ID_BYTES + 1} bytes long (UTF-8), more than the {MAX_SAMPLE_ID_BYTES} allowed; fix the row's id",
        f"{a}, row 2 (line 3): id '\u00e9\u00e9",
        f"is {MAX_SAMPLE_ID_BYTES + 2} bytes long",
        f"{a}, row 3 (line 4): id 'doc\\x1b]0;owned\\x07' holds the control character '\\x1b' at character 3",
        f"{a}, row 4 (line 5): id 'two\\nlines' holds the control character '\\n' at character 3",
        f"{a}, row 5 (line 6): id 'half \\ud800 a pair' holds a lone surrogate (U+D800 at character 5)",
        f"{b}, row 1: id 'tab\\there' holds the control character '\\t'",
        f"{c}, row 0 (line 1): id 'c\\u202e:0' holds the control character '\\u202e' at character 1; give the row "
        "an id, or rename the file",
    ):
        assert expected in text, text
    assert "\x1b" not in text and "\u202e" not in text, "ids are quoted escaped"
    assert "x" * 41 not in text, "a long id is quoted cut short"
    assert not out.exists(), "refused at the scan: no cache.json, no shard"


def worst_ids() -> list[str]:
    """Ids of exactly MAX_SAMPLE_ID_BYTES bytes of UTF-8, each of a character escaped most in a header
    (a quote and a backslash: 4 bytes each after two JSON encodings; 2-, 3- and 4-byte UTF-8)."""
    n = MAX_SAMPLE_ID_BYTES
    ids = ['"' * n, "\\" * n, "\u00e9" * (n // 2), "\u4e2d" * (n // 3) + "ab", "\U0001f600" * (n // 4)]
    assert all(len(i.encode()) == n for i in ids)
    return ids


def test_the_longest_id_allowed_round_trips(target, tmp_path):
    ids = worst_ids()
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": i, **ROW}) + "\n" for i in ids))
    out = tmp_path / "cache"
    result = extract(target, data, out)
    assert result.exit_code == 0, result.output
    reader = ShardReader(out)
    stored = [s.sample_id for b in reader.batch_ids() for s in reader.verify(b).samples]
    assert sorted(stored) == sorted(ids)
    assert sorted(read_manifest(out).column("sample_id").to_pylist()) == sorted(ids)
    verify = CliRunner().invoke(shards_cli, ["verify", str(out)])
    assert verify.exit_code == 0, verify.output
    show = CliRunner().invoke(shards_cli, ["show", str(out), ids[0], "--json"])
    assert show.exit_code == 0 and json.loads(show.output)["sample_id"] == ids[0], show.output


@pytest.mark.slow
def test_a_shard_of_max_samples_of_the_worst_ids_fits_the_header_bound(tmp_path):
    # A 64 MB header: ~5 s on one core.
    n = MAX_SHARD_SAMPLES
    cfg = CacheConfig(
        target=TargetInfo(name="t", config_hash="h", hidden_size=1, num_layers=2, vocab_size=4, dtype="bfloat16"),
        tap_layer_ids=[0],
        token_budget=n,
        max_seqs=n,
    )
    head = {"embed_tokens": torch.zeros(4, 1), "lm_head": torch.zeros(4, 1), "final_norm": torch.zeros(1)}
    create_cache(tmp_path, cfg, head)
    tensors = {name: torch.zeros(spec.shape, dtype=spec.dtype) for name, spec in tensor_specs(cfg).items()}
    tensors["cu_seqlens"] = torch.arange(n + 1, dtype=torch.int32)
    tensors["position_ids"] = torch.zeros(n, dtype=torch.int32)
    worst = '"' * (MAX_SAMPLE_ID_BYTES - 6)
    samples = [SampleEntry(f"{i:06d}{worst}", i, 1, 0) for i in range(n)]
    path = write_shard(tmp_path, cfg, 0, tensors, samples)
    header_bytes = int.from_bytes(path.read_bytes()[:8], "little")
    assert MAX_HEADER_BYTES * 0.9 < header_bytes <= MAX_HEADER_BYTES, header_bytes
    info = ShardReader(tmp_path).verify(0)
    assert [s.sample_id for s in info.samples] == [s.sample_id for s in samples]


def test_max_seqs_past_what_a_header_holds_is_refused_before_any_work(target, data, tmp_path, no_work):
    big = str(MAX_SHARD_SAMPLES + 1)
    args = cli_args(target, data, tmp_path / "cache")
    args[args.index("--max-seqs") + 1] = big
    args[args.index("--token-budget") + 1] = big
    result = CliRunner().invoke(extract_cli, args)
    assert result.exit_code == 2, result.output
    assert f"--max-seqs {big}: must be <= {MAX_SHARD_SAMPLES}" in result.output, result.output
