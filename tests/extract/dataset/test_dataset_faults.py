"""Bad datasets through the dflash-extract CLI (the tiny target of tests/conftest.py): the message the user
sees names file, row and reason, and nothing is written.

Cases:
  1. Bad rows: ids outside the vocabulary (JSONL, Parquet), negative ids, mask/ids length mismatch (JSONL,
     Parquet), malformed JSON line (one nested 200,000 deep too), missing input_ids, a file that is not Parquet, a Parquet column of the
     wrong type, a null token, an over-long sample under --long-seqs error.
  2. Empty and over-long samples under --long-seqs truncate / skip: extracted, skipped and counted in
     cache.json and the log, never silently.
  3. A Parquet page damaged inside a row group (its page header, or its body under page checksums), in a
     one-file dataset and in one of three files: one message naming file, row group and rows and the
     fix, exit 1, no traceback, no cache written.
"""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from extract.cli import main as extract_cli
from extract.dataset.index import Sample, write_jsonl, write_parquet
from shards import ShardReader
from tests.helpers.extract import VOCAB, cli_args, make_samples

# ---- 1-2. bad rows, empty and over-long samples -----------------------------------------------------------


def _good_rows(n=5):
    return [{"id": f"g{i}", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]} for i in range(n)]


def _jsonl(tmp_path, bad_row, row=2):
    rows = [json.dumps(r) for r in _good_rows()]
    rows[row] = bad_row if isinstance(bad_row, str) else json.dumps(bad_row)
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def _parquet(tmp_path, columns):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table(columns), path, row_group_size=2)
    return path


def _garbage(path):
    path.write_bytes(b"PAR1 truncated")
    return path


def _ids(n=5):
    return [[1, 2, 3, 4] for _ in range(n)]


BAD_INPUTS = [
    (
        "jsonl id outside vocab",
        lambda t: _jsonl(t, {"input_ids": [1, VOCAB]}),
        rf"bad.jsonl, row 2 \(line 3\): input_ids\[1\] = {VOCAB} is outside \[0, {VOCAB}\)",
    ),
    (
        "jsonl negative id",
        lambda t: _jsonl(t, {"input_ids": [-3, 1]}),
        r"bad.jsonl, row 2 \(line 3\): input_ids\[0\] = -3 is outside",
    ),
    (
        "jsonl mask length",
        lambda t: _jsonl(t, {"input_ids": [1, 2, 3], "loss_mask": [1, 1]}),
        r"bad.jsonl, row 2 \(line 3\): loss_mask has 2 values, input_ids has 3",
    ),
    ("jsonl malformed", lambda t: _jsonl(t, '{"input_ids": [1, 2'), r"bad.jsonl, row 2 \(line 3\): malformed JSON"),
    (
        "jsonl nested 200,000 deep",  # a RecursionError traceback before
        lambda t: _jsonl(t, "[" * 200_000 + "]" * 200_000),
        r"bad.jsonl, row 2 \(line 3\): malformed JSON line \(JSON nested more than the 64 levels allowed\)",
    ),
    ("jsonl no input_ids", lambda t: _jsonl(t, {"tokens": [1]}), r"bad.jsonl, row 2 \(line 3\): missing input_ids"),
    (
        "parquet id outside vocab",
        lambda t: _parquet(t, {"input_ids": _ids(3) + [[1, VOCAB + 7]] + _ids(1)}),
        rf"bad.parquet, row 3: input_ids\[1\] = {VOCAB + 7} is outside",
    ),
    (
        "parquet mask length",
        lambda t: _parquet(t, {"input_ids": _ids(), "loss_mask": [[1] * 4] * 4 + [[1]]}),
        r"bad.parquet, row 4: loss_mask has 1 values, input_ids has 4",
    ),
    (
        "parquet null token",
        lambda t: _parquet(t, {"input_ids": _ids(1) + [[1, None]] + _ids(3)}),
        r"bad.parquet, row 1: input_ids contains a null value",
    ),
    (
        "parquet float ids",
        lambda t: _parquet(t, {"input_ids": [[1.0, 2.0]] * 5}),
        r"bad.parquet: column input_ids has type list<.*double>, expected a list of integers",
    ),
    ("not parquet", lambda t: _garbage(t / "bad.parquet"), r"bad.parquet: not a readable Parquet file"),
    (
        "long sample, --long-seqs error",
        lambda t: _jsonl(t, {"id": "big", "input_ids": [5] * 300}),
        r"bad.jsonl, row 2 \(line 3\): sample 'big' has 300 tokens, more than token_budget 256",
    ),
]


@pytest.mark.parametrize("name,make,reason", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_extract_cli_rejects_bad_rows_naming_file_row_and_reason(target, tmp_path, name, make, reason):
    path = make(tmp_path)
    out = tmp_path / "cache"
    result = CliRunner().invoke(extract_cli, cli_args(target, path, out, "--long-seqs", "error"))
    assert result.exit_code == 1, result.output
    assert str(path) in result.output and re.search(reason, result.output), result.output
    assert not out.exists(), "a refused dataset must not leave a cache behind"


@pytest.mark.parametrize("policy", ["truncate", "skip"])
def test_empty_and_long_samples_are_counted_never_silent(target, tmp_path, caplog, policy):
    samples = make_samples(n=8, seed=3)
    samples[1] = Sample("empty-a", [], [])
    samples[5] = Sample("empty-b", [], [])
    samples[6] = Sample("long", [7] * 300, [1] * 300)
    path = tmp_path / "data.jsonl"
    write_jsonl(path, samples)
    out = tmp_path / "cache"
    caplog.set_level("INFO")
    result = CliRunner().invoke(extract_cli, cli_args(target, path, out, "--long-seqs", policy))
    assert result.exit_code == 0, result.output
    packing = json.loads((out / "cache.json").read_text())["packing"]
    assert packing["num_empty"] == 2
    assert (packing["num_truncated"], packing["num_skipped"]) == ((1, 0) if policy == "truncate" else (0, 1))
    assert "2 empty samples skipped (e.g. empty-a, empty-b)" in caplog.text
    counted = "1 truncated (-44 tokens)" if policy == "truncate" else "1 long skipped (-300 tokens)"
    assert counted in caplog.text, caplog.text
    reader = ShardReader(out)
    lengths = {s.sample_id: s.length for b in reader.batch_ids() for s in reader.info(b).samples}
    want = {s.sample_id for s in samples if len(s)} - ({"long"} if policy == "skip" else set())
    assert set(lengths) == want
    if policy == "truncate":
        assert lengths["long"] == 256


# ---- 3. a damaged Parquet page ----------------------------------------------------------------------------


def damage_page(path, row_group: int, where: str) -> int:
    """Flip 4 bytes of the input_ids data page of `row_group`, found from the file's own metadata (the
    footer stays intact): at the page's first byte ("page header": its Thrift header no longer parses)
    or half way through the page ("page body": only its CRC checksum can tell). Returns the offset."""
    meta = pq.ParquetFile(path).metadata.row_group(row_group)
    col = next(meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema.startswith("input_ids"))
    end = (col.dictionary_page_offset or col.data_page_offset) + col.total_compressed_size  # the chunk's end
    offset = col.data_page_offset if where == "page header" else (col.data_page_offset + end) // 2
    raw = bytearray(path.read_bytes())
    raw[offset : offset + 4] = bytes(b ^ 0xFF for b in raw[offset : offset + 4])
    path.write_bytes(bytes(raw))
    return offset


@pytest.mark.parametrize("files", [1, 3], ids=["one file", "one of three files"])
@pytest.mark.parametrize("where", ["page header", "page body"])
def test_a_damaged_parquet_page_names_file_and_row_group(target, tmp_path, files, where):
    samples = make_samples()  # 24 samples: 8 per file, row groups of 4 (or 24 in one file, row groups of 8)
    per_file, group = len(samples) // files, 8 if files == 1 else 4
    folder = tmp_path / "data"
    folder.mkdir()
    paths = [folder / f"part-{i}.parquet" for i in range(files)]
    for i, path in enumerate(paths):
        part = samples[i * per_file : (i + 1) * per_file]
        if where == "page header":  # a file written without page checksums, as most writers do
            rows = {"id": [s.sample_id for s in part], "input_ids": [s.input_ids.tolist() for s in part]}
            pq.write_table(pa.table(rows), path, row_group_size=group)
        else:
            write_parquet(path, part, row_group_size=group)  # with page checksums
    bad = paths[len(paths) // 2]
    damage_page(bad, 1, where)
    assert pq.ParquetFile(bad).metadata.num_rows == per_file, "the footer must still read: the damage is in a page"
    out = tmp_path / "cache"
    result = CliRunner().invoke(extract_cli, cli_args(target, bad if files == 1 else folder, out))
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), f"raw traceback: {result.exception!r}"
    assert f"{bad}, row group 1 (rows {group}-{2 * group - 1}): damaged Parquet data" in result.output, result.output
    assert "restore it from its source or write it again" in result.output
    assert all(str(p) not in result.output for p in paths if p != bad), "only the damaged file is named"
    assert not out.exists(), "no cache.json and no shard for a dataset that cannot be read"
