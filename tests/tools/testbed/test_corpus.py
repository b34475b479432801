"""The proxy target's corpus (tools/testbed/corpus.py, pairs.py): built from a small synthetic sdist
(the real one is pinned and checked by the build itself), deterministic, refusals; the committed
corpus file against its pin; the prompts export read back by dflash-data's own reader."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile

import pytest
from click.testing import CliRunner

from extract.chats.conversations import iter_conversations
from shards.common.errors import UserError
from tools.testbed.corpus import (
    CORPUS_FILE,
    CORPUS_SHA256,
    DJANGO_SDIST_SHA256,
    build_chats,
    jsonl_bytes,
    load_corpus,
    main,
    sdist_files,
    sha256_file,
    split_of,
    write_corpus,
    write_prompts,
)

CODE = '''"""A module."""
import os


def add(a, b):
    """Add two numbers."""
    total = a + b
    return total


def one_liner(): return 1


def doc_only():
    """Nothing else."""


class Store:
    @property
    def name(self):
        # from the cache
        return self._name

    def leak(self):
        return "<|im_end|>"
'''
PARAGRAPH = "Django is a web framework. " * 9  # 243 characters: one paragraph makes a prompt
DOCS = f"""=====
Title
=====

{PARAGRAPH}

Second paragraph of the introduction.

.. code-block:: python

    print("indented, joined to the paragraph above")

Sub section
-----------

{PARAGRAPH}

Only one more paragraph here.
"""


def _sdist(path, files: dict[str, bytes], link: str | None = None):
    """A tar.gz shaped like the sdist: every file under Django-5.1.4/; `link` adds a symlink member."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"Django-5.1.4/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(f"Django-5.1.4/{link}")
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tar.addfile(info)
    return path


@pytest.fixture
def sdist(tmp_path):
    files = {
        "django/store.py": CODE.encode(),
        "django/conf/locale/en/formats.py": CODE.encode(),  # left out: format tables
        "django/db/migrations/0001_initial.py": CODE.encode(),  # left out: generated
        "django/latin1.py": "x = 'caf\xe9'\n".encode("latin-1"),  # left out: not UTF-8
        "docs/topics/intro.txt": DOCS.encode(),
        "docs/releases/5.1.txt": DOCS.encode(),  # left out: release notes
        "tests/test_x.py": CODE.encode(),  # left out: not django/ or docs/
    }
    return _sdist(tmp_path / "Django-5.1.4.tar.gz", files, link="django/link.py")


def _build(sdist):
    return build_chats(sdist_files(sdist, sha256_file(sdist)))


def test_pairs_from_code_and_docs(sdist):
    chats = _build(sdist)
    assert sorted({c.source for c in chats}) == ["django/store.py", "docs/topics/intro.txt"]
    code = [c for c in chats if c.kind == "code"]
    # add (docstring in the prompt), Store.name (decorator in the prompt, the comment continues);
    # one_liner and doc_only have no continuation of their own; leak holds chat markup.
    assert [c.id for c in code] == ["django/store.py:0", "django/store.py:1"]
    assert code[0].prompt == (
        'Complete this function from django/store.py:\n\n```python\ndef add(a, b):\n    """Add two numbers."""\n```'
    )
    assert code[0].continuation == "```python\n    total = a + b\n    return total\n```"
    assert code[1].prompt == (
        "Complete this method of class Store from django/store.py:\n\n```python\n@property\ndef name(self):\n```"
    )
    assert code[1].continuation == "```python\n    # from the cache\n    return self._name\n```"
    docs = [c for c in chats if c.kind == "docs"]
    assert [c.prompt.split("\n\n", 1)[0] for c in docs] == [
        "Continue this part of the Django documentation (docs/topics/intro.txt, section 'Title'):",
        "Continue this part of the Django documentation (docs/topics/intro.txt, section 'Sub section'):",
    ]
    assert docs[0].prompt.split("\n\n", 1)[1] == PARAGRAPH.rstrip()
    assert docs[0].continuation == (
        "Second paragraph of the introduction.\n\n.. code-block:: python\n\n"
        '    print("indented, joined to the paragraph above")'
    )
    assert docs[1].continuation == "Only one more paragraph here."
    assert {c.split for c in chats if c.source == "django/store.py"} == {split_of("django/store.py")}


def test_build_is_deterministic_to_the_byte(sdist, tmp_path):
    first, second = _build(sdist), _build(sdist)
    assert jsonl_bytes(first) == jsonl_bytes(second)
    digest = write_corpus(first, tmp_path / "a.jsonl.gz")
    assert write_corpus(second, tmp_path / "b.jsonl.gz") == digest
    assert sha256_file(tmp_path / "a.jsonl.gz") == sha256_file(tmp_path / "b.jsonl.gz")
    assert hashlib.sha256(gzip.decompress((tmp_path / "a.jsonl.gz").read_bytes())).hexdigest() == digest
    assert [c.to_row() for c in load_corpus(tmp_path / "a.jsonl.gz", digest)] == [c.to_row() for c in first]
    with pytest.raises(UserError, match="exists"):
        write_corpus(first, tmp_path / "a.jsonl.gz")


def test_build_refuses_a_tarball_that_is_not_the_pinned_sdist(sdist, tmp_path):
    result = CliRunner().invoke(main, ["build", "--sdist", str(sdist), "--out", str(tmp_path / "c.jsonl.gz")])
    assert result.exit_code == 1
    assert f"sha256 {sha256_file(sdist)}, expected {DJANGO_SDIST_SHA256}" in result.output
    assert "pip download --no-deps --no-binary :all: django==5.1.4" in result.output
    assert not (tmp_path / "c.jsonl.gz").exists()


def test_split_is_by_file_and_near_its_fraction():
    paths = [f"django/module_{i}.py" for i in range(4000)]
    heldout = sum(split_of(p) == "heldout" for p in paths) / len(paths)
    assert 0.08 < heldout < 0.12
    assert [split_of(p) for p in paths] == [split_of(p) for p in paths]


def test_committed_corpus_matches_its_pin_and_keeps_files_in_one_split(tmp_path, corpus):
    chats = corpus
    splits_of_file: dict[str, set[str]] = {}
    for c in chats:
        splits_of_file.setdefault(c.source, set()).add(c.split)
        assert c.prompt == c.prompt.strip() and c.continuation == c.continuation.strip() and c.continuation
    assert all(len(s) == 1 for s in splits_of_file.values())
    assert all(next(iter(s)) == split_of(f) for f, s in splits_of_file.items())
    assert {c.kind for c in chats if c.split == "heldout"} == {"code", "docs"}
    # One changed character in the rows: refused, naming the file and the pin.
    damaged = gzip.decompress(CORPUS_FILE.read_bytes()).replace(b"def ", b"def  ", 1)
    (tmp_path / "damaged.jsonl.gz").write_bytes(gzip.compress(damaged))
    with pytest.raises(UserError, match=f"damaged.jsonl.gz: its rows hash to .*expected {CORPUS_SHA256}"):
        load_corpus(tmp_path / "damaged.jsonl.gz")


def test_prompts_export_is_read_by_dflash_data(tmp_path, corpus):
    out = tmp_path / "heldout.jsonl"
    result = CliRunner().invoke(main, ["prompts", "--out", str(out), "--limit", "5"])
    assert result.exit_code == 0, result.output
    heldout = [c for c in corpus if c.split == "heldout"][:5]
    convs = list(iter_conversations(out))
    assert [c.sample_id for c in convs] == [c.id for c in heldout]
    assert [c.messages for c in convs] == [[{"role": "user", "content": c.prompt}] for c in heldout]
    assert all(json.loads(line)["source"] for line in out.read_text().splitlines())
    result = CliRunner().invoke(main, ["prompts", "--out", str(out)])
    assert result.exit_code == 1 and "exists" in result.output


def test_write_prompts_of_the_train_split(tmp_path, sdist):
    chats = _build(sdist)
    count = write_prompts(chats, tmp_path / "p.jsonl", "train", None)
    assert count == sum(c.split == "train" for c in chats)


def test_joined_prompts_are_consecutive_prompts_of_the_split(tmp_path, corpus):
    """--join K: each prompt is K consecutive prompts of the split, blank lines between, the short tail dropped."""
    out = tmp_path / "long.jsonl"
    result = CliRunner().invoke(main, ["prompts", "--out", str(out), "--join", "3", "--limit", "4"])
    assert result.exit_code == 0, result.output
    heldout = [c for c in corpus if c.split == "heldout"]
    convs = list(iter_conversations(out))
    assert [c.sample_id for c in convs] == [f"{heldout[3 * i].id}+3" for i in range(4)]
    for i, conv in enumerate(convs):
        joined = "\n\n".join(c.prompt for c in heldout[3 * i : 3 * i + 3])
        assert conv.messages == [{"role": "user", "content": joined}]
    count = write_prompts(corpus, tmp_path / "all.jsonl", "heldout", None, join=7)
    assert count == len(heldout) // 7
