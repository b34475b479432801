"""The table's data, made the way a user makes theirs: prompts -> the target's own replies -> token rows.

Prompts (JSON Lines: {"prompt": "text"} or {"messages": [...]}, an optional "id") are split into training
and held-out prompts (a fixed random choice). The target answers them through `dflash-data regenerate`
against tools/fixtures/tiny_server.py serving it: every training prompt once per training temperature
(greedy, and sampled at T > 0 with a fixed seed), every held-out prompt greedily (then the decoding walk
on the held-out cache equals real greedy decoding step for step). `dflash-data prepare` renders both with
the target's chat template and loss mask: WORK/data/<digest>/train.parquet and heldout.parquet, recorded
in data.json with their sha256. The directory is named by the digest of everything that decides the
data (the target's files, the prompts file, the settings), so a re-run with the same inputs reuses it
and any change makes new data; a run cut half way resumes regenerate where it stopped.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from extract.chats.cli import main as data_cli
from shards.common.durable import atomic_write_text
from shards.common.errors import UserError
from tools.fixtures.tiny_server import TinyChatModel, make_server, running
from tools.testbed.table.clis import run_cli
from tools.testbed.table.config import TableConfig
from tools.testbed.table.store import WorkDir, digest, file_sha256

SPLIT_SEED = 0  # which prompts are held out: fixed, so one prompts file always holds out the same ones
MODEL_NAME = "tiny"  # the name the tiny server serves the target under
RECORD = "data.json"


class PromptsError(UserError, ValueError):
    """--prompts holds a line the table cannot read as a prompt, or too few prompts."""


@dataclass(frozen=True)
class Dataset:
    """The prepared token rows every row of the table trains and evaluates on."""

    train: Path
    heldout: Path
    record: dict  # data.json: the inputs, the sha256 of both files, the prompt counts

    @property
    def identity(self) -> dict:
        """What a cache made from these data depends on: the content of both files."""
        return {"train_sha256": self.record["train_sha256"], "heldout_sha256": self.record["heldout_sha256"]}


def target_sha256(target: Path) -> str:
    """Of every file directly in the target directory, by name and content: weights, config, tokenizer and
    chat template all decide the replies and the hidden states."""
    return digest({p.name: file_sha256(p) for p in sorted(target.iterdir()) if p.is_file()})


def data_inputs(cfg: TableConfig) -> dict:
    """Everything that decides the data."""
    return {
        "target_sha256": target_sha256(Path(cfg.target)),
        "prompts_sha256": file_sha256(Path(cfg.prompts)),
        "split_seed": SPLIT_SEED,
        **{
            name: getattr(cfg, name)
            for name in (
                "num_prompts",
                "heldout_prompts",
                "max_tokens",
                "train_temperatures",
                "sample_seed",
                "thinking",
                "server_device",
            )
        },
    }


def read_prompts(path: Path, limit: int) -> list[dict]:
    """The first `limit` prompts (0 = all) as chats {"id", "messages"}, the input of dflash-data regenerate."""
    chats, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if limit and len(chats) == limit:
                break
            if not line.strip():
                continue
            chats.append(_chat(path, number, line))
            if chats[-1]["id"] in seen:
                raise PromptsError(f"--prompts {path} line {number}: id {chats[-1]['id']!r} is used twice")
            seen.add(chats[-1]["id"])
    return chats


def _chat(path: Path, number: int, line: str) -> dict:
    where = f"--prompts {path} line {number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptsError(f"{where}: not JSON ({e})") from None
    if not isinstance(row, dict):
        raise PromptsError(f"{where}: not a JSON object")
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        messages = [{"role": "user", "content": row["prompt"]}]
    elif isinstance(row.get("messages"), list) and row["messages"]:
        messages = row["messages"]
    else:
        raise PromptsError(f'{where}: give a non-empty "prompt" (text) or "messages" (a chat)')
    return {"id": str(row.get("id", f"prompt-{number}")), "messages": messages}


def split_prompts(chats: list[dict], num_heldout: int) -> tuple[list[dict], list[dict]]:
    """(training, held-out) chats, each in file order; the held-out ones a fixed random choice."""
    if num_heldout >= len(chats):
        raise PromptsError(
            f"--heldout-prompts {num_heldout}: leaves no training prompt of the {len(chats)} read from --prompts"
        )
    heldout = set(random.Random(SPLIT_SEED).sample(range(len(chats)), num_heldout))
    return [c for i, c in enumerate(chats) if i not in heldout], [c for i, c in enumerate(chats) if i in heldout]


def make_dataset(cfg: TableConfig, work: WorkDir, say: Callable[[str], None]) -> Dataset:
    """The table's data, from WORK when these inputs made them before, else made now."""
    inputs = data_inputs(cfg)
    folder = work.subdir("data", digest(inputs)[:16])
    recorded = _read_record(folder / RECORD)
    if recorded is not None and recorded.get("inputs") == inputs:
        say(
            f"data: reusing {folder} ({recorded['num_train_prompts']} training, {recorded['num_heldout_prompts']} held-out prompts)"
        )
        return Dataset(folder / "train.parquet", folder / "heldout.parquet", recorded)
    train, heldout = split_prompts(read_prompts(Path(cfg.prompts), cfg.num_prompts), cfg.heldout_prompts)
    _write_jsonl(folder / "prompts-train.jsonl", train)
    _write_jsonl(folder / "prompts-heldout.jsonl", heldout)
    merged, held = _answer(cfg, work, folder, (len(train), len(heldout)), say)
    say("data: dflash-data prepare (the target's chat template and loss mask)")
    for source, out in ((merged, "train.parquet"), (held, "heldout.parquet")):
        args = ["prepare", "--target", cfg.target, "--data", str(source), "--out", str(folder / out)]
        run_cli("dflash-data", data_cli, [*args, "--thinking", cfg.thinking, "--overwrite"], work.log("data-prepare"))
    record = {
        "inputs": inputs,
        "train_sha256": file_sha256(folder / "train.parquet"),
        "heldout_sha256": file_sha256(folder / "heldout.parquet"),
        "num_train_prompts": len(train),
        "num_heldout_prompts": len(heldout),
    }
    atomic_write_text(folder / RECORD, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return Dataset(folder / "train.parquet", folder / "heldout.parquet", record)


def _answer(
    cfg: TableConfig, work: WorkDir, folder: Path, counts: tuple[int, int], say: Callable[[str], None]
) -> tuple[Path, Path]:
    """The target's replies (training replies at every temperature in one file, ids tagged; held-out
    replies greedy), through dflash-data regenerate against the tiny server serving the target."""
    replies = {}
    model = TinyChatModel(cfg.target, max_batch=cfg.concurrency, device=cfg.server_device)
    with running(make_server(model, 0, model_name=MODEL_NAME)) as url:
        for temperature in cfg.train_temperatures:
            say(f"data: the target answers {counts[0]} training prompts at temperature {temperature:g}")
            replies[temperature] = folder / f"replies-train-t{temperature:g}.jsonl"
            _regenerate(cfg, url, folder / "prompts-train.jsonl", replies[temperature], temperature, work)
        say(f"data: the target answers {counts[1]} held-out prompts greedily")
        _regenerate(cfg, url, folder / "prompts-heldout.jsonl", folder / "replies-heldout.jsonl", 0.0, work)
    merged = folder / "replies-train.jsonl"
    _write_jsonl(merged, [row for t, path in replies.items() for row in _tagged(path, t)])
    return merged, folder / "replies-heldout.jsonl"


def _regenerate(cfg: TableConfig, url: str, prompts: Path, out: Path, temperature: float, work: WorkDir) -> None:
    args = ["regenerate", "--server", url, "--model", MODEL_NAME, "--data", str(prompts), "--out", str(out)]
    args += ["--thinking", cfg.thinking, "--max-tokens", str(cfg.max_tokens), "--concurrency", str(cfg.concurrency)]
    args += ["--temperature", f"{temperature:g}"]
    if temperature > 0:
        args += ["--seed", str(cfg.sample_seed)]
    run_cli("dflash-data", data_cli, args, work.log(f"data-{out.stem}"))


def _tagged(replies: Path, temperature: float) -> Iterator[dict]:
    """The replies at one temperature, ids tagged with it (one prompt answered at two temperatures is two samples)."""
    with open(replies, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            yield {**row, "id": f"{row['id']}@t{temperature:g}"}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _read_record(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
