"""A dataset with several bad rows is refused once, naming every bad row (up to a limit) and the count."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from extract.dataset.index import DataError, scan_dataset
from extract.dataset.rows import MAX_REPORTED_PROBLEMS

VOCAB = 100
GOOD = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}


def _lines(bad: dict[int, str], n: int = 10, prefix: str = "g") -> str:
    rows = [json.dumps({"id": f"{prefix}{i}", **GOOD}) for i in range(n)]
    for row, line in bad.items():
        rows[row] = line
    return "\n".join(rows) + "\n"


def test_every_bad_row_of_every_file_is_named(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        _lines(
            {
                1: json.dumps({"id": "x1", "input_ids": [1, 100, 3, 200]}),  # two bad ids: one problem, the first
                4: '{"input_ids": [1,',
                7: json.dumps({"id": "x7", "input_ids": [1, 2], "loss_mask": [1, 5]}),
            }
        )
    )
    (tmp_path / "b.jsonl").write_text(_lines({2: json.dumps({"id": "g3", **GOOD})}, prefix="h"))  # g3 also in a.jsonl
    with pytest.raises(DataError) as e:
        scan_dataset(tmp_path, vocab_size=VOCAB)
    text = str(e.value)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert "4 bad rows:" in text, text
    assert f"{a}, row 1 (line 2): input_ids[1] = 100" in text
    assert f"{a}, row 4 (line 5): malformed JSON line" in text
    assert f"{a}, row 7 (line 8): loss_mask[1] = 5 is not 0 or 1" in text
    assert f"duplicate sample id 'g3': {a}, row 3 (line 4) and {b}, row 2 (line 3)" in text
    assert "more" not in text


def test_many_bad_rows_are_listed_up_to_the_limit_and_counted(tmp_path):
    n = MAX_REPORTED_PROBLEMS + 7
    path = tmp_path / "d.jsonl"
    path.write_text(_lines({r: json.dumps({"input_ids": [VOCAB + r]}) for r in range(n)}, n=n + 3))
    with pytest.raises(DataError) as e:
        scan_dataset(path, vocab_size=VOCAB)
    text = str(e.value)
    assert f"{n} bad rows (the first {MAX_REPORTED_PROBLEMS}):" in text and "... and 7 more" in text
    listed = [line for line in text.splitlines() if line.startswith(f"  {path}, row ")]
    assert [int(line.split(", row ")[1].split()[0]) for line in listed] == list(range(MAX_REPORTED_PROBLEMS))


def test_parquet_bad_rows_across_row_groups(tmp_path):
    ids = [[1, 2], [1, 150], [3], None, [4, -1], [5, 6]]
    masks = [[1, 1], [1, 1], [1], [1], [1, 1], [1, 2]]
    table = pa.table(
        {"input_ids": pa.array(ids, type=pa.list_(pa.int32())), "loss_mask": pa.array(masks, type=pa.list_(pa.uint8()))}
    )
    path = tmp_path / "p.parquet"
    pq.write_table(table, path, row_group_size=2)  # groups: rows 0-1, 2-3, 4-5
    with pytest.raises(DataError) as e:
        scan_dataset(path, vocab_size=VOCAB)
    text = str(e.value)
    assert "4 bad rows:" in text, text
    for expect in (
        f"{path}, row 1: input_ids[1] = 150",
        f"{path}, row 3: input_ids is null",
        f"{path}, row 4: input_ids[1] = -1",
        f"{path}, row 5: loss_mask[1] = 2",
    ):
        assert expect in text, (expect, text)


def test_one_bad_row_keeps_its_plain_message(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(_lines({5: json.dumps({"input_ids": [1, 100]})}))
    with pytest.raises(DataError) as e:
        scan_dataset(path, vocab_size=VOCAB)
    assert str(e.value) == f"{path}, row 5 (line 6): input_ids[1] = 100 is outside [0, 100) (the target's vocabulary)"
