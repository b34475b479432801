"""The one reader of JSON (shards/common/json_input.py) and typed records (schema.py), through their API.

Bounds: nesting past MAX_JSON_DEPTH refused (the exact depth against a walk of the parsed value),
brackets inside strings not counted, a file past its size bound refused without being read whole, a
FIFO refused rather than waited on, a JSON Lines record past its bound refused, a killed writer's
partial last line left out only where asked. Records: unknown, missing and mistyped fields named with
their path in the file.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field

import pytest

from shards.common.json_input import (
    MAX_JSON_DEPTH,
    InputFileError,
    iter_json_lines,
    parse_json,
    read_json,
    value_depth,
)
from shards.common.schema import read_field, record


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


def reference_depth(text: str) -> int:
    """Nesting of a JSON text by a character walk that tracks strings and escapes (independent of the reader)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def test_nesting_past_the_bound_is_refused_naming_the_source():
    assert parse_json(nested(MAX_JSON_DEPTH), "a.json") is not None
    for depth in (MAX_JSON_DEPTH + 1, 5_000, 200_000):  # 200,000 deep raised RecursionError in json
        with pytest.raises(InputFileError, match=rf"^a\.json: JSON nested more than the {MAX_JSON_DEPTH} levels"):
            parse_json(nested(depth), "a.json")


def test_depth_matches_a_character_walk_and_ignores_brackets_in_strings():
    rng = random.Random(0)
    for _ in range(200):
        value: object = rng.choice([1, "x", None])
        for _ in range(rng.randrange(0, 80)):
            value = rng.choice([[value], {"k[{": value}, [value, '"]}\\"', 2]])
        text = json.dumps(value)
        want = reference_depth(text)
        assert value_depth(json.loads(text)) == want
        if want <= MAX_JSON_DEPTH:
            assert parse_json(text, "r.json") == value
        else:
            with pytest.raises(InputFileError, match="nested more than"):
                parse_json(text, "r.json")
    brackets_in_a_string = json.dumps({"id": "[" * 10_000})
    assert parse_json(brackets_in_a_string, "s.json") == {"id": "[" * 10_000}


def test_size_bound_and_what_json_refuses_name_the_file(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"x": "a" * 1000}))
    with pytest.raises(InputFileError, match=rf"^{path}: larger than the 100 bytes allowed"):
        read_json(path, max_bytes=100)
    assert read_json(path, max_bytes=2000) == {"x": "a" * 1000}
    for text, reason in [("[1,", "not valid JSON"), ("1" * 5000, "not valid JSON"), (b"\xff", "not valid JSON")]:
        with pytest.raises(InputFileError, match=f"^bad.json: {reason}"):
            parse_json(text, "bad.json")


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "run.json"
    os.mkfifo(fifo)
    with pytest.raises(InputFileError, match=r"a FIFO \(named pipe\), not a regular file"):
        read_json(fifo)
    with pytest.raises(InputFileError, match="a directory, not a regular file"):
        read_json(tmp_path)


def test_json_lines_bound_each_record_and_tolerate_only_a_last_partial_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo')
    assert list(iter_json_lines(path, partial_last_line=True)) == [(1, {"step": 1}), (3, {"step": 2})]
    with pytest.raises(InputFileError, match=rf"^{path}, line 4: not valid JSON"):
        list(iter_json_lines(path))
    path.write_text('{"step": 1, "lo\n{"step": 2}\n')  # a bad line with more after it is damage, not a kill
    with pytest.raises(InputFileError, match=rf"^{path}, line 1: not valid JSON"):
        list(iter_json_lines(path, partial_last_line=True))
    path.write_text('{"x": "' + "a" * 200 + '"}\n')
    with pytest.raises(InputFileError, match=rf"^{path}, line 1: longer than the 100 bytes allowed"):
        list(iter_json_lines(path, max_line_bytes=100))
    path.write_text(nested(100) + "\n")
    with pytest.raises(InputFileError, match=rf"^{path}, line 1: JSON nested more than"):
        list(iter_json_lines(path))


@dataclass(kw_only=True)
class Inner:
    size: int
    name: str | None = None


@dataclass(kw_only=True)
class Outer:
    inner: Inner
    ids: list[int]
    ratio: float = 1.0
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.inner.size < 0:
            raise ValueError(f"inner.size must be >= 0, found {self.inner.size}")


@pytest.mark.parametrize(
    "value, message",
    [
        ([], "the document must be an object, found an array"),
        ({"inner": {"size": 1}, "ids": [], "x": 1}, "unknown field x"),
        ({"inner": {"size": 1, "colour": 2}, "ids": []}, "unknown field inner.colour"),
        ({"ids": []}, "missing field inner"),
        ({"inner": {"size": "4"}, "ids": []}, "field inner.size must be an integer, found a string"),
        ({"inner": {"size": True}, "ids": []}, "field inner.size must be an integer, found a boolean"),
        ({"inner": {"size": 1}, "ids": [1, "2"]}, r"field ids\[1\] must be an integer, found a string"),
        ({"inner": {"size": 1, "name": 3}, "ids": []}, "field inner.name must be a string, found an integer"),
        ({"inner": {"size": 1}, "ids": [], "extra": {"a": None}}, "field extra.a must be a string, found null"),
        ({"inner": {"size": -1}, "ids": []}, "inner.size must be >= 0, found -1"),
    ],
)
def test_a_record_refuses_naming_file_and_field(value, message):
    with pytest.raises(InputFileError, match=f"^state.json: {message}"):
        record(Outer, value, "state.json")


def test_a_record_takes_what_its_annotations_allow():
    got = record(Outer, {"inner": {"size": 2}, "ids": [3], "ratio": 2, "extra": {"k": "v"}}, "s.json")
    assert got == Outer(inner=Inner(size=2), ids=[3], ratio=2.0, extra={"k": "v"})
    assert isinstance(got.ratio, float)
    config = {"text_config": {"hidden_size": [8]}, "vocab_size": 16}
    assert read_field(config, "vocab_size", int, "config.json") == 16
    assert read_field(config, "head_dim", int, "config.json", default=4) == 4
    with pytest.raises(InputFileError, match="^config.json: field text_config.hidden_size must be an integer"):
        read_field(config["text_config"], "hidden_size", int, "config.json", where="text_config.")
    with pytest.raises(InputFileError, match="^config.json: missing field head_dim"):
        read_field(config, "head_dim", int, "config.json")
