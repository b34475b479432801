"""dflash-shards: inspect, verify and summarise a hidden-state cache."""

from __future__ import annotations

import contextlib
import json
import math
import sys

import click

from shards import ShardError, ShardReader, rebuild_manifest
from shards.common.cli_options import CONTEXT_SETTINGS
from shards.common.diskfull import DiskFullError, refusing_when_full
from shards.common.errors import user_errors
from shards.common.lock import DirectoryLock, lock_holder
from shards.common.logs import setup_logging
from shards.common.progress import format_bytes, plural
from shards.common.terminal import echo
from shards.inspect import QUARANTINE_DIR, find_sample, summarize_cache, verify_cache

_PIECES_LISTED = 6  # pieces `show` names in its text output


def _emit(obj: object, as_json: bool, text: str) -> None:
    echo(json.dumps(obj, indent=2) if as_json else text)


@click.group(context_settings=CONTEXT_SETTINGS)
def main() -> None:
    """Inspect, verify and summarise a dflash hidden-state cache (the output of dflash-extract).

    \b
    Examples:
      dflash-shards info runs/cache            totals, padding efficiency, bytes on disk
      dflash-shards verify runs/cache          read every shard; exit 1 listing bad files
      dflash-shards ls runs/cache --samples    every sample id, with its shard and length
      dflash-shards show runs/cache doc-17     one sample's tokens and hidden-state stats
    """
    setup_logging()


@main.command()
@click.argument("cache", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@user_errors()  # a damaged or foreign cache (CacheFormatError)
def info(cache: str, as_json: bool) -> None:
    """Config, counts, tokens, padding efficiency and bytes on disk (headers only: fast)."""
    s = _guard(summarize_cache, cache)
    expected = f" of {s['num_shards_expected']} planned" if s["num_shards_expected"] is not None else ""
    text = "\n".join(
        [
            f"cache            {s['cache']} (format v{s['format_version']})",
            f"target           {s['target']} (hidden {s['hidden_size']}), taps {s['tap_layer_ids']}",
            f"target ran as    {s['target_dtype']}, {s['target_compute']} compute"
            + (f"; checkpoint {s['target_quantization']}" if s["target_quantization"] else ""),
            f"storage          {_storage(s)}, target top-k {s['target_topk']}, "
            f"{format_bytes(s['bytes_per_token'])}/token",
            f"packing          token budget {s['token_budget']}, max {s['max_seqs']} seqs/shard",
            f"shards           {s['num_shards']}{expected}"
            + (f", {s['num_bad_shard_headers']} with bad headers" if s["num_bad_shard_headers"] else ""),
            f"samples          {s['num_samples']}"
            + (f" ({s['num_long_samples']} long, stored as {s['num_pieces']} pieces)" if s["num_long_samples"] else ""),
            f"tokens           {s['num_tokens']} ({s['num_loss_tokens']} supervised)"
            + (", pieces' overlaps counted in each piece" if s["num_long_samples"] else ""),
            *_modes(s),
            f"padding eff.     {100 * s['padding_efficiency']:.2f}%",
            f"on disk          {format_bytes(s['bytes_on_disk'])}"
            + (
                f" (not counting {plural(s['num_quarantined'], 'quarantined file')}, "
                f"{format_bytes(s['bytes_quarantined'])}, in {cache}/{QUARANTINE_DIR}/)"
                if s["num_quarantined"]
                else ""
            ),
        ]
    )
    _emit(s, as_json, text)


def _modes(s: dict) -> list[str]:
    """The serving modes the data were rendered in, with samples and tokens of each (several: a line each)."""
    modes = s["modes"]
    if len(modes) == 1:
        return [f"mode             {modes[0]['described']}"]
    return [
        f"mode {i:<11} {m['described']}: {plural(m['num_samples'], 'sample')}, {m['num_tokens']} tokens "
        f"({m['num_loss_tokens']} supervised)"
        for i, m in enumerate(modes)
    ]


def _storage(s: dict) -> str:
    """The storage mode: the taps in bf16/fp8, or a projection's codes (its rank, scaling, variance kept)."""
    p = s["projection"]
    if p is None:
        return s["storage_dtype"]
    width = len(s["tap_layer_ids"]) * s["hidden_size"]
    kept = f", {100 * p['variance_kept']:.2f}% of the variance kept" if p["variance_kept"] is not None else ""
    groups = f" (one scale per {p['group_size']} codes)" if s["storage_dtype"] == "fp8" else ""
    return (
        f"pca: {p['rank']} of {width} dims ({p['rank'] / width:.4f}), {s['storage_dtype']} codes{groups}, "
        f"normalize {p['normalize']}{kept}"
    )


@main.command(name="ls")
@click.argument("cache", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--samples",
    is_flag=True,
    help="One line per sample instead (batch id, sample id, tokens, supervised): the ids `show` takes.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@user_errors()
def ls_(cache: str, samples: bool, as_json: bool) -> None:
    """One line per shard: batch id, samples, real tokens, fill, size (--samples: one line per sample)."""
    reader = _guard(ShardReader, cache)
    if samples:
        _ls_samples(reader, as_json)
        return
    rows = []
    for b in reader.batch_ids():
        try:
            i = reader.info(b)
            rows.append(
                {
                    "batch_id": b,
                    "file": i.path.name,
                    "samples": len(i.samples),
                    "tokens": i.num_tokens,
                    "fill": i.num_tokens / reader.config.token_budget,
                    "bytes": i.file_bytes,
                    "error": None,
                }
            )
        except ShardError as e:
            rows.append({"batch_id": b, "file": e.path.name, "error": e.reason})
    lines = [f"{'batch':>8}  {'samples':>7}  {'tokens':>8}  {'fill':>7}  {'size':>10}  file"]
    for r in rows:
        if r["error"]:
            lines.append(f"{r['batch_id']:>8}  BAD: {r['error']}  {r['file']}")
        else:
            lines.append(
                f"{r['batch_id']:>8}  {r['samples']:>7}  {r['tokens']:>8}  {100 * r['fill']:>6.2f}%  {format_bytes(r['bytes']):>10}  {r['file']}"
            )
    _emit(rows, as_json, "\n".join(lines))


def _ls_samples(reader: ShardReader, as_json: bool) -> None:
    """Every sample of the readable shards, in batch order, from the shard headers (the truth the
    manifest is rebuilt from); a shard whose header cannot be read is one BAD line."""
    rows, lines = [], [f"{'batch':>8}  {'tokens':>7}  {'supervised':>10}  sample id"]
    for b in reader.batch_ids():
        try:
            entries = reader.info(b).samples
        except ShardError as e:
            rows.append({"batch_id": b, "file": e.path.name, "error": e.reason})
            lines.append(f"{b:>8}  BAD: {e.reason}  {e.path.name}")
            continue
        for s in entries:
            rows.append({"batch_id": b, "sample_id": s.sample_id, "length": s.length, "loss_tokens": s.loss_tokens})
            lines.append(f"{b:>8}  {s.length:>7}  {s.loss_tokens:>10}  {s.sample_id}")
    _emit(rows, as_json, "\n".join(lines))


@main.command()
@click.argument("cache", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--quarantine", is_flag=True, help="Move bad shards to CACHE/quarantine/ so a resumed dflash-extract rewrites them."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@user_errors()  # and a cache locked by a running job (DirectoryLockedError) under --quarantine
def verify(cache: str, quarantine: bool, as_json: bool) -> None:
    """Read every shard in full: header, shapes, dtypes, checksum, packing; then the manifest.

    Exit code 0 when everything verifies, 1 when anything is bad (each bad file is listed).
    """
    writer = lock_holder(cache)
    if quarantine:  # moves files: never under a running job
        with _locked(cache):
            report = _guard(verify_cache, cache, quarantine=quarantine)
    else:
        report = _guard(verify_cache, cache, quarantine=quarantine)
    remedy = report.remedy()
    if writer is not None and not report.ok:  # its shards in flight are "missing" only for now
        remedy = f"the cache is being written ({writer}): verify again when that job has finished"
    obj = {
        "ok": report.ok,
        "checked": report.checked,
        "bad": report.bad,
        "quarantined": report.quarantined,
        "remedy": remedy,
    }
    lines = [
        f"checked {plural(report.checked, 'shard')}: "
        + ("all good" if report.ok else plural(len(report.bad), "problem"))
    ]
    lines += [
        f"BAD {b['file']}: {b['reason']}" + (f" (moved to {b['moved_to']})" if "moved_to" in b else "")
        for b in report.bad
    ]
    if remedy:
        lines.append(f"to repair: {remedy}")
    _emit(obj, as_json, "\n".join(lines))
    sys.exit(0 if report.ok else 1)


@main.command()
@click.argument("cache", type=click.Path(exists=True, file_okay=False))
@click.argument("sample_id")
@click.option(
    "--max-tokens",
    default=64,
    show_default=True,
    type=click.IntRange(min=0),
    help="Tokens of input_ids and loss_mask printed; 0 = the whole sample (--json always has all).",
)
@click.option(
    "--position",
    type=click.IntRange(min=0),
    default=None,
    help="Also print the target's stored top-k next tokens at this position of the sample (0-based; a long "
    "sample's absolute position, read from the piece whose own part holds it). Default: none.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@user_errors(ValueError)  # and a --position past the sample
def show(cache: str, sample_id: str, max_tokens: int, position: int | None, as_json: bool) -> None:
    """A sample's tokens, loss mask, per-tap hidden-state statistics and, with --position, the target's top-k."""
    try:
        s = find_sample(cache, sample_id, position=position)
    except KeyError as e:  # no such sample: its message, not KeyError's quoted repr
        raise click.ClickException(str(e.args[0])) from e
    n = s["length"] if max_tokens == 0 else min(max_tokens, s["length"])
    more = f" ... ({s['length'] - n} more; --max-tokens 0 shows all)" if n < s["length"] else ""
    lines = [
        f"sample {s['sample_id']}: {_where(s)}, length {s['length']}, {s['loss_tokens']} supervised",
        f"input_ids  {' '.join(map(str, s['input_ids'][:n]))}{more}",
        f"loss_mask  {''.join(map(str, s['loss_mask'][:n]))}{more}",
        f"{'layer':>6} {'mean':>10} {'std':>10} {'rms':>10} {'absmax':>10} finite",
    ]
    lines += [
        f"{t['layer']:>6} {t['mean']:>10.4f} {t['std']:>10.4f} {t['rms']:>10.4f} {t['absmax']:>10.4f} {t['finite']}"
        for t in s["hidden"]
    ]
    if "target_topk" in s:
        lines += _topk_lines(s["target_topk"])
    _emit(s, as_json, "\n".join(lines))


def _where(s: dict) -> str:
    """Its shard and offset, or a long sample's pieces: each shard with the positions of its own part."""
    if s["pieces"] is None:
        return f"batch {s['batch_id']}, offset {s['offset']}"
    parts = [f"{p['batch_id']} ({p['own_start']}..{p['own_end'] - 1})" for p in s["pieces"]]
    if len(parts) > _PIECES_LISTED:  # a 128K-token sample in 2K shards: the first and the last few
        parts = [*parts[: _PIECES_LISTED // 2], "...", *parts[-(_PIECES_LISTED // 2) :]]
    return f"{len(s['pieces'])} pieces in batches {', '.join(parts)} (--json lists all)"


def _topk_lines(t: dict) -> list[str]:
    nxt = (
        "none (last position)"
        if t["next_token_id"] is None
        else (
            f"{t['next_token_id']}, "
            + (
                f"rank {t['next_token_rank']} of the top-{len(t['ids'])}"
                if t["next_token_rank"]
                else f"not in the top-{len(t['ids'])}"
            )
        )
    )
    lines = [
        f"target top-{len(t['ids'])} at position {t['position']} (token {t['token_id']}, batch {t['batch_id']}); "
        f"data's next token {nxt}",
        f"{'rank':>6} {'token':>10} {'logprob':>10} {'prob':>8}",
    ]
    lines += [
        f"{r:>6} {i:>10} {lp:>10.4f} {math.exp(lp):>8.4f}" + ("  <- next" if i == t["next_token_id"] else "")
        for r, (i, lp) in enumerate(zip(t["ids"], t["logprobs"]), start=1)
    ]
    return lines


@main.command()
@click.argument("cache", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@user_errors()
def index(cache: str, as_json: bool) -> None:
    """Rebuild manifest.parquet from the shard headers."""
    with _locked(cache):  # the manifest is the running job's to write
        path = _guard(rebuild_manifest, cache)
    _emit({"manifest": str(path)}, as_json, f"wrote {path}")


@contextlib.contextmanager
def _locked(cache: str):
    """Hold the cache's lock (as dflash-extract does) for a command that changes it; refused, naming the
    holder, while a job writes the cache (DirectoryLockedError, a user error)."""
    lock = DirectoryLock(cache, "dflash-shards")
    try:
        lock.acquire()
    except OSError as e:
        raise click.ClickException(f"{e.filename}: {e.strerror or e}; is the cache read-only?") from e
    try:
        yield
    finally:
        lock.release()


def _guard(fn, cache: str, **kwargs):
    """fn(cache)'s OSError as one line with what to check, a full disk (index's manifest, the quarantine
    folder) with the space free; a damaged cache (CacheFormatError) is a user error."""
    try:
        with refusing_when_full(cache, "free space and run the command again"):
            return fn(cache, **kwargs)
    except DiskFullError:
        raise
    except OSError as e:  # e.g. --quarantine or index on a read-only cache
        where = f"{e.filename}: " if e.filename else ""
        raise click.ClickException(
            f"{where}{e.strerror or e}; check the cache's permissions, its file system (read-only?) and free space"
        ) from e


if __name__ == "__main__":
    main()
