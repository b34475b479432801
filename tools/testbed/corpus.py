"""The proxy target's corpus: prompt/continuation chats from the pinned Django 5.1.4 sdist.

    python -m tools.testbed.corpus build --sdist Django-5.1.4.tar.gz --out CORPUS.jsonl.gz
    python -m tools.testbed.corpus check [CORPUS.jsonl.gz]
    python -m tools.testbed.corpus prompts --out heldout.jsonl [--split heldout] [--limit N] [--join K]

Source: the PyPI sdist of Django 5.1.4 (`pip download --no-deps --no-binary :all: django==5.1.4`),
refused unless its sha256 is DJANGO_SDIST_SHA256. Read from the tarball in memory (nothing is
extracted, links are not followed), files in sorted path order:
    code  django/**/*.py, without locale/ (format tables) and migrations/ (generated)
    docs  docs/**/*.txt (reST), without docs/releases/ (lists of changes, not prose)
Each file gives prompt/continuation pairs (tools/testbed/pairs.py); a file's pairs are all train or
all held-out (HELDOUT_FRACTION of files, by the sha256 of its path, so a held-out prompt never comes
from a file the target saw); each kind stops taking files at MAX_CHARS_PER_KIND.

The corpus is one gzip'd JSON Lines file (gzip mtime 0, no file name: the bytes depend on the rows
only), one OpenAI-format chat per row, as `dflash-data` reads them:
    {"id": "django/db/models/query.py:12", "kind": "code", "source": "django/db/models/query.py",
     "split": "train", "messages": [{"role": "user", ...}, {"role": "assistant", ...}]}
CORPUS_SHA256 pins the uncompressed JSON Lines (what the rows are, whatever zlib compressed them);
`load_corpus` refuses a file whose rows differ from it, and `build` writes nothing when the rows it
built differ (changed selection or pair rules must update the pin, and the card). The committed file travels with the working tree to the machine that trains the target.
`prompts` writes the user turns of one split as prompt-only chats, the input of `dflash-data
regenerate`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click

from shards.common.cli_options import CONTEXT_SETTINGS
from shards.common.durable import atomic_write, atomic_write_text
from shards.common.errors import UserError, user_errors
from tools.testbed.pairs import Pair, code_pairs, docs_pairs

logger = logging.getLogger(__name__)

DJANGO_SDIST = "Django-5.1.4.tar.gz"
DJANGO_SDIST_SHA256 = "de450c09e91879fa5a307f696e57c851955c910a438a35e6b4c895e86bedc82a"
CORPUS_FILE = Path(__file__).parent / "data" / "django-5.1.4-pairs.jsonl.gz"
CORPUS_SHA256 = "68a55fc489eee46fe6f764a9d74559eaf98aa3034565460cbf15f324e7a45430"  # sha256 of the uncompressed JSON Lines of CORPUS_FILE
HELDOUT_FRACTION = 0.1  # of files, chosen by the sha256 of their path
MAX_CHARS_PER_KIND = 4_500_000  # prompt + continuation characters; keeps the gzip'd file near 2.5 MB
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Chat:
    """One row of the corpus."""

    id: str  # "<source path>:<pair index in the file>"
    kind: str  # "code" or "docs"
    source: str  # path inside the sdist, without its top folder
    split: str  # "train" or "heldout"
    prompt: str
    continuation: str

    def to_row(self) -> dict:
        messages = [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.continuation}]
        return {"id": self.id, "kind": self.kind, "source": self.source, "split": self.split, "messages": messages}

    @classmethod
    def from_row(cls, row: dict) -> Chat:
        user, assistant = row["messages"]
        return cls(row["id"], row["kind"], row["source"], row["split"], user["content"], assistant["content"])


def file_kind(path: str) -> str | None:
    """ "code", "docs" or None (not in the corpus) for a path inside the sdist."""
    if path.startswith("django/") and path.endswith(".py") and "/locale/" not in path and "/migrations/" not in path:
        return "code"
    if path.startswith("docs/") and path.endswith(".txt") and not path.startswith("docs/releases/"):
        return "docs"
    return None


def split_of(path: str) -> str:
    """The split of every pair of a file: "heldout" for HELDOUT_FRACTION of paths, by their sha256."""
    draw = int.from_bytes(hashlib.sha256(path.encode("utf-8")).digest()[:8], "big") / 2**64
    return "heldout" if draw < HELDOUT_FRACTION else "train"


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def sdist_files(sdist: str | Path, expected_sha256: str) -> Iterator[tuple[str, str]]:
    """(path without the top folder, text) of the sdist's corpus files, in sorted path order. Refuses
    a tarball whose sha256 is not `expected_sha256`; files that are not UTF-8 are left out (logged)."""
    found = sha256_file(sdist)
    if found != expected_sha256:
        raise UserError(
            f"--sdist {sdist}: sha256 {found}, expected {expected_sha256} (the PyPI sdist of Django 5.1.4); "
            "fetch it with `pip download --no-deps --no-binary :all: django==5.1.4`"
        )
    with tarfile.open(sdist, mode="r:gz") as tar:
        members = {}
        for member in tar.getmembers():
            path = member.name.split("/", 1)[1] if "/" in member.name else ""
            if member.isfile() and file_kind(path) is not None:
                members[path] = member
        for path in sorted(members):
            data = tar.extractfile(members[path]).read()
            try:
                yield path, data.decode("utf-8")
            except UnicodeDecodeError:
                logger.warning("%s: not UTF-8, left out of the corpus", path)


def build_chats(files: Iterator[tuple[str, str]]) -> list[Chat]:
    """The corpus rows of (path, text) files, in their order, MAX_CHARS_PER_KIND per kind."""
    chats: list[Chat] = []
    chars = {"code": 0, "docs": 0}
    for path, text in files:
        kind = file_kind(path)
        if chars[kind] >= MAX_CHARS_PER_KIND:
            continue
        pairs: list[Pair] = code_pairs(path, text) if kind == "code" else docs_pairs(path, text)
        split = split_of(path)
        for i, pair in enumerate(pairs):
            chats.append(Chat(f"{path}:{i}", kind, path, split, pair.prompt, pair.continuation))
            chars[kind] += len(pair.prompt) + len(pair.continuation)
    return chats


def jsonl_bytes(chats: list[Chat]) -> bytes:
    """The canonical JSON Lines of the rows (sorted keys, ASCII): what CORPUS_SHA256 pins."""
    lines = (json.dumps(c.to_row(), sort_keys=True, ensure_ascii=True, separators=(",", ":")) for c in chats)
    return "".join(line + "\n" for line in lines).encode("ascii")


def write_corpus(chats: list[Chat], out: str | Path) -> str:
    """Write the rows gzip'd (mtime 0, no name, level 9) to `out`; returns the JSON Lines' sha256.
    Refuses an existing `out`: the corpus file is never overwritten."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise UserError(f"--out {out}: exists; the corpus is written to a new file only (choose another path)")
    payload = jsonl_bytes(chats)

    def write(f) -> None:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, compresslevel=9, mtime=0) as gz:
            gz.write(payload)

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, write)
    return hashlib.sha256(payload).hexdigest()


def load_corpus(path: str | Path = CORPUS_FILE, expected_sha256: str = CORPUS_SHA256) -> list[Chat]:
    """The rows of a corpus file, refused unless its JSON Lines hash to `expected_sha256`."""
    path = Path(path)
    try:
        payload = gzip.decompress(path.read_bytes())
    except (OSError, EOFError) as e:
        raise UserError(f"{path}: not a readable gzip'd corpus ({e}); restore it from the repository") from e
    found = hashlib.sha256(payload).hexdigest()
    if found != expected_sha256:
        raise UserError(
            f"{path}: its rows hash to {found}, expected {expected_sha256} (tools/testbed/corpus.py "
            "CORPUS_SHA256); restore the file from the repository or rebuild it from the pinned sdist"
        )
    return [Chat.from_row(json.loads(line)) for line in io.StringIO(payload.decode("ascii"))]


def write_prompts(chats: list[Chat], out: str | Path, split: str, limit: int | None, join: int = 1) -> int:
    """Prompt-only chats (the user turn) of `split`, in corpus order, at most `limit`, as JSON Lines
    for `dflash-data regenerate`; returns how many. join > 1: each prompt is `join` consecutive ones
    joined by blank lines (long-context samples; the last, shorter group is dropped). Refuses an existing `out`."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise UserError(f"--out {out}: exists; choose a new file")
    picked = [c for c in chats if c.split == split]
    groups = [picked[i : i + join] for i in range(0, len(picked) - join + 1, join)]
    rows = [
        {
            "id": group[0].id if join == 1 else f"{group[0].id}+{join}",
            "kind": group[0].kind,
            "source": group[0].source,
            "messages": [{"role": "user", "content": "\n\n".join(c.prompt for c in group)}],
        }
        for group in groups
    ][:limit]
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    return len(rows)


def summary(chats: list[Chat]) -> dict:
    """Rows and characters per split and kind (for the card and the build's log)."""
    out: dict = {}
    for c in chats:
        entry = out.setdefault(f"{c.split}/{c.kind}", {"chats": 0, "prompt_chars": 0, "continuation_chars": 0})
        entry["chats"] += 1
        entry["prompt_chars"] += len(c.prompt)
        entry["continuation_chars"] += len(c.continuation)
    return dict(sorted(out.items()))


@click.group(context_settings=CONTEXT_SETTINGS)
def main() -> None:
    """The proxy target's corpus: build it from the pinned Django sdist, check it, export prompts."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.option(
    "--sdist",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help=f"The PyPI sdist {DJANGO_SDIST} (sha256 {DJANGO_SDIST_SHA256}).",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The corpus file to write (.jsonl.gz); must not exist.",
)
@user_errors(ValueError, OSError)
def build(sdist: Path, out: Path) -> None:
    """Build the corpus file from the sdist; fails unless its rows are the pinned ones."""
    chats = build_chats(sdist_files(sdist, DJANGO_SDIST_SHA256))
    digest = hashlib.sha256(jsonl_bytes(chats)).hexdigest()
    if digest != CORPUS_SHA256:
        raise UserError(
            f"the rows built from {sdist} hash to {digest}, CORPUS_SHA256 pins {CORPUS_SHA256}: "
            "the selection or pair rules changed; nothing written"
        )
    write_corpus(chats, out)
    click.echo(json.dumps({"rows_sha256": digest, "file_sha256": sha256_file(out), **summary(chats)}, indent=1))


@main.command()
@click.argument("corpus", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=CORPUS_FILE)
@user_errors(ValueError, OSError)
def check(corpus: Path) -> None:
    """Check a corpus file against CORPUS_SHA256 and print what it holds."""
    chats = load_corpus(corpus)
    click.echo(
        json.dumps({"rows_sha256": CORPUS_SHA256, "file_sha256": sha256_file(corpus), **summary(chats)}, indent=1)
    )


def corpus_option(help_text: str):
    """`--corpus FILE`, the committed corpus by default (for the commands that read one)."""
    return click.option(
        "--corpus",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=CORPUS_FILE,
        show_default=True,
        help=help_text,
    )


@main.command()
@corpus_option("The corpus file.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The JSON Lines file of prompt-only chats to write; must not exist.",
)
@click.option("--split", type=click.Choice(SPLITS), default="heldout", show_default=True, help="Which split's prompts.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many prompts (default: all).")
@click.option(
    "--join",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Join each N consecutive prompts into one (blank lines between): long prompts for the long-context row.",
)
@user_errors(ValueError, OSError)
def prompts(corpus: Path, out: Path, split: str, limit: int | None, join: int) -> None:
    """Write one split's prompts as chats for `dflash-data regenerate`."""
    count = write_prompts(load_corpus(corpus), out, split, limit, join)
    click.echo(f"wrote {count} {split} prompts to {out}")


if __name__ == "__main__":
    main()
