"""extract.dataset.index: every bad input is refused at scan time with file, row and reason in the message."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from extract.dataset.index import DataError, Sample, scan_dataset, write_jsonl, write_parquet

VOCAB = 100
GOOD = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}


def jsonl_with_bad_row(tmp_path, bad_line: str, row: int = 2):
    lines = [json.dumps({"id": f"g{i}", **GOOD}) for i in range(4)]
    lines[row] = bad_line
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


JSONL_CASES = [
    ("token id too large", json.dumps({"input_ids": [1, 100, 3]}), r"input_ids\[1\] = 100 is outside \[0, 100\)"),
    ("negative token id", json.dumps({"input_ids": [-1, 2]}), r"input_ids\[0\] = -1 is outside"),
    ("mask length", json.dumps({"input_ids": [1, 2], "loss_mask": [1]}), "loss_mask has 1 values, input_ids has 2"),
    ("mask value", json.dumps({"input_ids": [1, 2], "loss_mask": [1, 2]}), r"loss_mask\[1\] = 2 is not 0 or 1"),
    (
        "float mask",
        json.dumps({"input_ids": [1, 2], "loss_mask": [1, 0.5]}),
        "loss_mask must be a flat list of integers",
    ),
    ("malformed", '{"input_ids": [1, 2', "malformed JSON line"),
    ("blank line", "", "malformed JSON line"),
    ("not an object", "[1, 2]", "expected a JSON object, found list"),
    ("missing input_ids", json.dumps({"tokens": [1]}), "missing input_ids"),
    ("ids not a list", json.dumps({"input_ids": "1 2"}), "input_ids must be a list of integers, found str"),
    ("float ids", json.dumps({"input_ids": [1.0, 2.0]}), "input_ids must be a flat list of integers"),
    ("string ids", json.dumps({"input_ids": ["a"]}), "input_ids must be a flat list of integers"),
    ("nested ids", json.dumps({"input_ids": [[1, 2]]}), "input_ids must be a flat list of integers"),
    ("bool among ids", json.dumps({"input_ids": [1, True]}), "found a boolean"),
    ("huge id", json.dumps({"input_ids": [2**80]}), "input_ids holds an integer too large for 64 bits"),
    ("bad id type", json.dumps({"id": [1], "input_ids": [1]}), "id must be a string or an integer, found list"),
]


@pytest.mark.parametrize("name,line,reason", JSONL_CASES, ids=[c[0] for c in JSONL_CASES])
def test_bad_jsonl_row(tmp_path, name, line, reason):
    path = jsonl_with_bad_row(tmp_path, line)
    with pytest.raises(DataError) as e:
        scan_dataset(path, vocab_size=VOCAB)
    msg = str(e.value)
    assert str(path) in msg and "row 2 (line 3)" in msg, msg
    assert re.search(reason, msg), msg


def test_bad_row_found_in_a_later_chunk(tmp_path):
    # Far past the first chunk of rows, so row numbers must be global within the file.
    lines = [json.dumps(GOOD)] * 5000 + [json.dumps({"input_ids": [1, 200]})]
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"big.jsonl, row 5000 \(line 5001\): input_ids\[1\] = 200"):
        scan_dataset(path, vocab_size=VOCAB)


def parquet_with(tmp_path, columns: dict, row_group_size: int = 2):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def good_lists(n: int = 5) -> list:
    return [list(GOOD["input_ids"]) for _ in range(n)]


PARQUET_CASES = [
    (
        "token id too large",
        lambda: {"input_ids": good_lists()[:3] + [[1, 2, 100]] + good_lists(1)},
        r"row 3: input_ids\[2\] = 100 is outside",
    ),
    ("null list", lambda: {"input_ids": good_lists()[:3] + [None] + good_lists(1)}, "row 3: input_ids is null"),
    (
        "null element",
        lambda: {"input_ids": good_lists()[:3] + [[1, None]] + good_lists(1)},
        "row 3: input_ids contains a null value",
    ),
    (
        "mask length",
        lambda: {"input_ids": good_lists(), "loss_mask": [[1, 1, 1]] * 3 + [[1]] + [[1, 1, 1]]},
        "row 3: loss_mask has 1 values, input_ids has 3",
    ),
    (
        "mask value",
        lambda: {"input_ids": good_lists(), "loss_mask": [[1, 1, 1]] * 3 + [[1, 3, 1]] + [[1, 1, 1]]},
        r"row 3: loss_mask\[1\] = 3 is not 0 or 1",
    ),
]


@pytest.mark.parametrize("name,columns,reason", PARQUET_CASES, ids=[c[0] for c in PARQUET_CASES])
def test_bad_parquet_row(tmp_path, name, columns, reason):
    path = parquet_with(tmp_path, columns())
    with pytest.raises(DataError) as e:
        scan_dataset(path, vocab_size=VOCAB)
    msg = str(e.value)
    assert str(path) in msg and re.search(reason, msg), msg


TYPE_CASES = [
    ("missing input_ids", {"tokens": good_lists()}, "missing input_ids column"),
    (
        "float ids",
        {"input_ids": [[1.0, 2.0]] * 5},
        r"column input_ids has type list<\w+: double>, expected a list of integers",
    ),
    ("ids not a list", {"input_ids": [1, 2, 3, 4, 5]}, "column input_ids has type int64"),
    (
        "float mask",
        {"input_ids": good_lists(), "loss_mask": [[1.0, 0.0, 1.0]] * 5},
        r"column loss_mask has type list<\w+: double>",
    ),
    ("float id", {"id": [1.5] * 5, "input_ids": good_lists()}, "column id has type double, expected string or integer"),
]


@pytest.mark.parametrize("name,columns,reason", TYPE_CASES, ids=[c[0] for c in TYPE_CASES])
def test_bad_parquet_column_type(tmp_path, name, columns, reason):
    path = parquet_with(tmp_path, columns)
    with pytest.raises(DataError) as e:
        scan_dataset(path, vocab_size=VOCAB)
    assert str(path) in str(e.value) and re.search(reason, str(e.value)), str(e.value)


def test_not_a_parquet_file(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_text("hello")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        scan_dataset(path, vocab_size=VOCAB)


def test_duplicate_ids_name_both_places(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [Sample("x", [1], [1]), Sample("dup", [1], [1])])
    write_parquet(tmp_path / "b.parquet", [Sample("y", [1], [1]), Sample("z", [1], [1]), Sample("dup", [2], [1])])
    with pytest.raises(DataError) as e:
        scan_dataset(tmp_path, vocab_size=VOCAB)
    msg = str(e.value)
    assert "duplicate sample id 'dup'" in msg
    assert "a.jsonl, row 1 (line 2)" in msg and "b.parquet, row 2" in msg, msg


def test_derived_id_colliding_with_a_given_id(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"id": "d:1", "input_ids": [1]}) + "\n" + json.dumps({"input_ids": [2]}) + "\n")
    with pytest.raises(DataError, match=r"duplicate sample id 'd:1'.*row 0 .*row 1"):
        scan_dataset(path, vocab_size=VOCAB)


def test_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size"):
        scan_dataset("x.jsonl", vocab_size=0)
    with pytest.raises(ValueError, match="long_seqs"):
        scan_dataset("x.jsonl", vocab_size=10, long_seqs="drop")
