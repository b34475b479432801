"""extract.dataset.index and .files: round trips, ids, empty samples, file discovery, fingerprints, loading
after a scan."""

import json
import os

import numpy as np
import pytest

from extract.dataset.files import data_would_read, find_data_files, is_glob
from extract.dataset.index import (
    DataError,
    Sample,
    SampleLoader,
    dataset_fingerprint,
    load_samples,
    scan_dataset,
    write_jsonl,
    write_parquet,
)

VOCAB = 1000


def make_samples(n: int, seed: int = 0, max_len: int = 40, prefix: str = "s") -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(1, max_len))
        out.append(Sample(f"{prefix}{i}", rng.integers(0, VOCAB, length), rng.integers(0, 2, length)))
    return out


def assert_same(got: list[Sample], want: list[Sample]) -> None:
    assert [s.sample_id for s in got] == [s.sample_id for s in want]
    for g, w in zip(got, want):
        assert g.input_ids.dtype == np.int32 and g.loss_mask.dtype == np.uint8
        np.testing.assert_array_equal(g.input_ids, w.input_ids, err_msg=g.sample_id)
        np.testing.assert_array_equal(g.loss_mask, w.loss_mask, err_msg=g.sample_id)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_round_trip_in_any_order(tmp_path, fmt):
    samples = make_samples(60)
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, samples)
    else:
        write_parquet(path, samples, row_group_size=7)  # several row groups, read out of order below
    index = scan_dataset(path, vocab_size=VOCAB)
    assert index.sample_ids == [s.sample_id for s in samples]
    np.testing.assert_array_equal(index.lengths, [len(s) for s in samples])
    np.testing.assert_array_equal(index.loss_tokens, [int(s.loss_mask.sum()) for s in samples])
    order = np.random.default_rng(1).permutation(len(samples)).tolist()
    assert_same(load_samples(index, order), [samples[i] for i in order])
    loader = SampleLoader(index, cache_tokens=100)  # under one row group: every new one evicts the last
    assert_same(loader.load(order[:10]) + loader.load(order[10:]), [samples[i] for i in order])


def test_jsonl_and_parquet_give_the_same_fingerprint(tmp_path):
    samples = make_samples(30)
    write_jsonl(tmp_path / "a.jsonl", samples)
    write_parquet(tmp_path / "b.parquet", samples)
    fa = dataset_fingerprint(scan_dataset(tmp_path / "a.jsonl", vocab_size=VOCAB))
    fb = dataset_fingerprint(scan_dataset(tmp_path / "b.parquet", vocab_size=VOCAB))
    assert fa == fb


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_derived_ids_and_missing_mask(tmp_path, fmt):
    rows = [[5, 6, 7], [8], [9, 10]]
    path = tmp_path / f"chat_part.{fmt}"
    samples = [Sample("ignored", r, np.ones(len(r))) for r in rows]
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    else:
        write_parquet(path, samples, with_ids=False)
    index = scan_dataset(path, vocab_size=VOCAB)
    assert index.sample_ids == ["chat_part:0", "chat_part:1", "chat_part:2"]
    again = scan_dataset(path, vocab_size=VOCAB)
    assert again.sample_ids == index.sample_ids
    got = load_samples(index, [2, 0])
    assert [s.sample_id for s in got] == ["chat_part:2", "chat_part:0"]
    np.testing.assert_array_equal(got[0].input_ids, [9, 10])
    np.testing.assert_array_equal(got[1].loss_mask, [1, 1, 1])  # absent mask = all supervised


def test_integer_ids_and_bool_mask(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"id": 7, "input_ids": [1, 2], "loss_mask": [False, True]}) + "\n")
    index = scan_dataset(path, vocab_size=VOCAB)
    assert index.sample_ids == ["7"]
    np.testing.assert_array_equal(load_samples(index, [0])[0].loss_mask, [0, 1])


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_empty_samples_are_skipped_and_counted(tmp_path, fmt):
    samples = make_samples(6)
    samples[1] = Sample("e1", [], [])
    samples[4] = Sample("e4", [], [])
    samples.append(Sample("e6", [], []))  # last in the file too
    path = tmp_path / f"d.{fmt}"
    (write_jsonl if fmt == "jsonl" else write_parquet)(path, samples)
    index = scan_dataset(path, vocab_size=VOCAB)
    assert index.report.num_empty == 3
    assert index.report.empty_examples == ("e1", "e4", "e6")
    assert index.report.num_rows == 7 and index.report.num_samples == 4
    assert index.sample_ids == ["s0", "s2", "s3", "s5"]
    assert_same(load_samples(index, range(4)), [samples[i] for i in (0, 2, 3, 5)])


def test_directory_and_glob_are_sorted(tmp_path):
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "b.jsonl", make_samples(3, prefix="b"))
    write_parquet(tmp_path / "a.parquet", make_samples(2, prefix="a"))
    (tmp_path / "README.md").write_text("not data")
    files = find_data_files(tmp_path)
    assert [os.path.basename(f) for f in files] == ["a.parquet", "b.jsonl"]
    index = scan_dataset(tmp_path, vocab_size=VOCAB)
    assert index.sample_ids == ["a0", "a1", "b0", "b1", "b2"]
    by_glob = scan_dataset(str(tmp_path / "**" / "*.jsonl"), vocab_size=VOCAB)
    assert by_glob.sample_ids == ["b0", "b1", "b2"]


PATTERNS = ["*.jsonl", "data/*.parquet", "**/*.parquet", "chats/*.jsonl", "**/*", "d/**/x*.json", "data/c?che/*"]
FILES = [
    "a.jsonl",
    "data/p.parquet",
    "data/cache/manifest.parquet",
    "data/cache/logs/extract-rank0.jsonl",
    "chats/c.jsonl",
    "chats/regen/out.jsonl",
    "d/x1.json",
    "d/a/b/x2.json",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_data_would_read_matches_what_glob_reads(tmp_path, pattern):
    """The reference is glob.glob itself, on a tree holding every path."""
    import glob

    for name in FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        read = {os.path.normpath(f) for f in glob.glob(pattern, recursive=True)}
        for name in FILES:
            assert data_would_read(pattern, name) == (os.path.normpath(name) in read), name
    finally:
        os.chdir(cwd)
    assert data_would_read(str(tmp_path / "data"), tmp_path / "data" / "cache" / "x")  # a folder: all inside
    assert not data_would_read(str(tmp_path / "data" / "p.parquet"), tmp_path / "data" / "q.parquet")
    (tmp_path / "run[1]").mkdir()  # a folder whose name looks like a pattern is a folder
    assert not is_glob(tmp_path / "run[1]") and data_would_read(tmp_path / "run[1]", tmp_path / "run[1]" / "f")


def test_missing_paths_and_unsupported_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        scan_dataset(tmp_path / "nope.jsonl", vocab_size=VOCAB)
    (tmp_path / "x.csv").write_text("1,2\n")
    with pytest.raises(DataError, match="unsupported file type"):
        scan_dataset(tmp_path / "x.csv", vocab_size=VOCAB)
    with pytest.raises(DataError, match="no .parquet or .jsonl files"):
        scan_dataset(tmp_path, vocab_size=VOCAB)
    with pytest.raises(DataError, match="no files match"):
        scan_dataset(str(tmp_path / "*.parquet"), vocab_size=VOCAB)


def test_fingerprint_tracks_order_and_content(tmp_path):
    samples = make_samples(20)
    write_jsonl(tmp_path / "a.jsonl", samples)
    base = dataset_fingerprint(scan_dataset(tmp_path / "a.jsonl", vocab_size=VOCAB))
    assert dataset_fingerprint(scan_dataset(tmp_path / "a.jsonl", vocab_size=VOCAB)) == base

    swapped = samples[:]
    swapped[3], swapped[4] = swapped[4], swapped[3]
    write_jsonl(tmp_path / "a.jsonl", swapped)
    assert dataset_fingerprint(scan_dataset(tmp_path / "a.jsonl", vocab_size=VOCAB)) != base

    for edit in ("token", "mask"):
        edited = [Sample(s.sample_id, s.input_ids.copy(), s.loss_mask.copy()) for s in samples]
        if edit == "token":
            edited[5].input_ids[0] = (edited[5].input_ids[0] + 1) % VOCAB
        else:
            edited[5].loss_mask[0] ^= 1
        write_jsonl(tmp_path / "a.jsonl", edited)
        assert dataset_fingerprint(scan_dataset(tmp_path / "a.jsonl", vocab_size=VOCAB)) != base, edit

    renamed = [Sample("x" + s.sample_id, s.input_ids, s.loss_mask) for s in samples]
    write_jsonl(tmp_path / "a.jsonl", renamed)
    assert dataset_fingerprint(scan_dataset(tmp_path / "a.jsonl", vocab_size=VOCAB)) != base


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_file_changed_after_scan_is_refused(tmp_path, fmt):
    samples = make_samples(5)
    path = tmp_path / f"d.{fmt}"
    write = write_jsonl if fmt == "jsonl" else write_parquet
    write(path, samples)
    index = scan_dataset(path, vocab_size=VOCAB)
    write(path, samples + make_samples(1, seed=9, prefix="new"))
    with pytest.raises(DataError, match="changed since the dataset was scanned"):
        load_samples(index, [0])


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("edit", ["token", "mask"])
def test_an_edit_keeping_size_id_and_length_is_refused(tmp_path, fmt, edit):
    samples = make_samples(3)
    path = tmp_path / f"d.{fmt}"
    write = write_jsonl if fmt == "jsonl" else write_parquet
    write(path, samples)
    index = scan_dataset(path, vocab_size=VOCAB)
    size = path.stat().st_size
    ids, mask = samples[1].input_ids.copy(), samples[1].loss_mask.copy()
    for k in range(len(ids) * (VOCAB - 1)):  # one token (or mask bit) changed, the file's byte size kept
        samples[1].input_ids[:], samples[1].loss_mask[:] = ids, mask
        if edit == "token":
            samples[1].input_ids[k % len(ids)] = (ids[k % len(ids)] + 1 + k // len(ids)) % VOCAB
        else:
            samples[1].loss_mask[k % len(ids)] ^= 1
        write(path, samples)
        if path.stat().st_size == size:
            break
    assert path.stat().st_size == size
    assert [s.sample_id for s in load_samples(index, [0])] == [samples[0].sample_id]  # untouched rows load
    with pytest.raises(DataError, match=r"row 1\b.*: sample .* holds other tokens or loss mask than the scan found"):
        load_samples(index, [1])


def test_same_size_edit_after_scan_is_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id":"a","input_ids":[1,2]}\n{"id":"b","input_ids":[3]}\n')
    index = scan_dataset(path, vocab_size=VOCAB)
    path.write_text('{"id":"a","input_ids":[1]}\n{"id":"b","input_ids":[3,4]}\n')
    with pytest.raises(DataError, match=r"d.jsonl, row 0 .*1 tokens, the scan found 2"):
        load_samples(index, [0])


def test_long_samples_counted_and_refused_at_scan(tmp_path):
    samples = [Sample("short", [1] * 4, [1] * 4), Sample("long", [1] * 9, [1] * 9)]
    write_jsonl(tmp_path / "d.jsonl", samples)
    index = scan_dataset(tmp_path / "d.jsonl", vocab_size=VOCAB, token_budget=8)
    assert index.report.num_longer_than_budget == 1 and index.report.max_length == 9
    with pytest.raises(DataError, match=r"d.jsonl, row 1 .*'long' has 9 tokens, more than token_budget 8"):
        scan_dataset(tmp_path / "d.jsonl", vocab_size=VOCAB, token_budget=8, long_seqs="error")


def test_files_of_one_name_in_two_folders_get_distinct_derived_ids(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        write_jsonl(tmp_path / folder / "x.jsonl", make_samples(2), with_ids=False)
    index = scan_dataset(tmp_path, vocab_size=VOCAB)
    assert index.sample_ids == ["a/x.jsonl:0", "a/x.jsonl:1", "b/x.jsonl:0", "b/x.jsonl:1"]
    assert [s.sample_id for s in load_samples(index, [3])] == ["b/x.jsonl:1"]
