"""run_extract: dataset -> packed batches -> frozen target -> hidden-state cache, on every rank.

Order of work, so that mistakes cost seconds and not GPU hours:
  1. settings, target config and every dataset row are checked (no model loaded yet);
  2. the packing plan is made (deterministic: batch ids are stable across runs);
  3. rank 0 creates the cache, or checks that an existing one was made with the same settings;
  4. each rank skips its batches whose shard exists and verifies, and extracts the rest;
  5. rank 0 writes the manifest once every rank is done.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from extract.chats.prepare import tokens_for_extraction
from extract.config import ExtractConfig
from extract.dataset.index import SampleLoader, data_would_read, dataset_fingerprint, is_glob, scan_dataset
from extract.dataset.packing import (
    PACKING_ALGORITHM,
    PackedBatch,
    PackingPlan,
    load_batch,
    plan_batches,
    shard_batches_for_rank,
)
from extract.distributed import init_distributed, run_on_main
from extract.target.checkpoint import load_target_head
from extract.target.config import TargetConfig, special_token_ids
from extract.target.fp8.quantization import checkpoint_quantization
from extract.target.kernels import select_kernels
from extract.target.model import TargetModel
from extract.writer import AsyncShardWriter
from shards import (
    CacheConfig,
    CacheFormatError,
    SampleEntry,
    ShardError,
    ShardReader,
    TargetInfo,
    create_cache,
    read_cache_config,
    write_manifest,
    write_target_head,
)
from shards.common.durable import TMP_PREFIX, check_writable
from shards.common.lock import LOCK_FILE, DirectoryLock
from shards.common.progress import ProgressLog, format_bytes, format_duration, is_interactive, plural
from shards.common.provenance import provenance
from shards.common.runtime import DistInfo, all_gather_objects, barrier, resolve_device, shutdown
from shards.common.sigterm import SigtermFlag
from shards.format import (
    CACHE_CONFIG_FILE,
    MANIFEST_FILE,
    TARGET_HEAD_FILE,
    DatasetRecord,
    PackingRecord,
    bytes_per_shard,
    checksum,
    shard_path,
)
from shards.ownership import (
    describe,
    foreign_entries,
    is_our_file,
    is_our_shard,
    nested,
    our_entries,
    remove_cache_files,
    remove_stale_cache_temporaries,
)
from shards.reader import list_shards
from shards.reader import load_target_head as read_cache_head

log = logging.getLogger(__name__)


class ShardSink(Protocol):
    """Where extract_batches hands each batch: AsyncShardWriter, or a benchmark's stand-in."""

    bytes_written: int  # bytes made durable so far
    shards_written: int  # shards made durable so far
    wait_s: float  # seconds the forward loop waited for the sink (the disk being slower)

    def submit(
        self,
        batch_id: int,
        arrays: dict,
        hidden_nKH: torch.Tensor,
        topk: tuple[torch.Tensor, torch.Tensor] | None,
        samples: list[SampleEntry],
    ) -> None: ...

    def close(self) -> None: ...

    def close_quietly(self) -> None: ...


class CacheMismatchError(ValueError):
    """An existing cache was made with other settings; resuming into it would mix two caches."""


@dataclass
class ExtractSummary:
    cache_dir: str
    num_batches: int  # in the whole plan
    written: int  # shards written by this rank in this run
    resumed: int  # shards of this rank found complete and kept
    tokens: int  # real tokens extracted by this rank in this run
    seconds: float
    padding_efficiency: float
    bytes_written: int
    wall_s: float = 0.0  # the whole run on this rank: checks, model load, extraction, manifest
    complete: bool = False  # rank 0 only: every planned shard exists and the manifest is written
    progress_log: str | None = None  # this rank's JSONL progress records, when it extracted anything
    rank: int = 0  # the rank this summary belongs to; rank 0's covers `ranks` ranks
    ranks: int = 1

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def report(self) -> str:
        """The final summary: what was done, how fast, and where every output is."""
        if self.written == 0 and self.resumed > 0:
            done = (
                f"nothing to extract{self._whose()}: all {plural(self.resumed, 'shard')} were already complete "
                f"(kept from an earlier run; {format_duration(self.wall_s)} to check them)"
            )
        else:
            kept = f", {self.resumed} kept from an earlier run" if self.resumed else ""
            done = (
                f"done in {format_duration(self.wall_s)}{self._whose()}: {plural(self.written, 'shard')} written "
                f"({format_bytes(self.bytes_written)}){kept}; {self.tokens:,} tokens in {self.seconds:.1f}s "
                f"({self.tokens_per_s:,.0f} tok/s), padding efficiency {100 * self.padding_efficiency:.1f}%"
            )
        where = f"cache {self.cache_dir}" + (f" is complete ({MANIFEST_FILE} written)" if self.complete else "")
        if self.progress_log:
            where += f"; progress records in {self.progress_log}"
        return f"{done}\n{where}"

    def _whose(self) -> str:
        return f" (all {self.ranks} ranks)" if self.ranks > 1 else ""


def job_summary(summaries: list[ExtractSummary]) -> ExtractSummary:
    """Every rank's summary as one, the job's: counts summed; time the slowest rank's, as the job ran
    the ranks side by side; padding efficiency over all shards written."""
    first = summaries[0]
    written = sum(s.written for s in summaries)
    seconds = max(s.seconds for s in summaries)
    logs = [s.progress_log for s in summaries if s.progress_log]
    return dataclasses.replace(
        first,
        written=written,
        resumed=sum(s.resumed for s in summaries),
        tokens=sum(s.tokens for s in summaries),
        seconds=seconds,
        padding_efficiency=sum(s.padding_efficiency * s.written for s in summaries) / written if written else 0.0,
        bytes_written=sum(s.bytes_written for s in summaries),
        wall_s=max(s.wall_s for s in summaries),
        progress_log=str(Path(logs[0]).parent / "extract-rank*.jsonl") if len(logs) > 1 else next(iter(logs), None),
        ranks=len(summaries),
    )


def run_extract(cfg: ExtractConfig) -> ExtractSummary:
    dist_info = init_distributed()
    try:
        return _run(cfg, dist_info)
    finally:
        shutdown()


def _run(cfg: ExtractConfig, dist_info: DistInfo) -> ExtractSummary:
    start = time.monotonic()
    _refuse_nesting(cfg)
    _refuse_foreign_out(Path(cfg.out_dir))
    check_writable(cfg.out_dir, f"--out {cfg.out_dir}")
    target = TargetConfig.from_dir(cfg.target)
    checkpoint_quantization(cfg.target)  # an unimplemented quantization is refused before any work
    taps = cfg.tap_layer_ids or target.default_tap_layer_ids(cfg.num_taps)
    _refuse_impossible_settings(cfg, target, taps)
    # Every tensor the run will read, checked in the safetensors headers before the dataset scan.
    with_head = cfg.target_topk > 0
    TargetModel.check_checkpoint(cfg.target, last_layer=None if with_head else max(taps), with_head=with_head)
    device = resolve_device(cfg.device, dist_info.local_rank)
    # Conversations are rendered with the target's chat template first (each rank does the same work).
    with tokens_for_extraction(cfg.data, cfg.target, cfg.thinking) as (data, prepared):
        return _extract_dataset(cfg, dist_info, start, target, taps, device, data, prepared)


def _extract_dataset(
    cfg: ExtractConfig,
    dist_info: DistInfo,
    start: float,
    target: TargetConfig,
    taps: list[int],
    device: torch.device,
    data: str,
    prepared: dict | None,
) -> ExtractSummary:
    """Scan the token dataset `data` (cfg.data, or its on-the-fly preparation), plan, extract, finish."""
    index = scan_dataset(data, vocab_size=target.vocab_size, token_budget=cfg.token_budget, long_seqs=cfg.long_seqs)
    if len(index) == 0:
        raise ValueError(f"{cfg.data}: no non-empty samples ({index.report.summary()})")
    _refuse_unsupervised(cfg, index)
    plan = plan_batches(index, cfg.packing)
    if not plan.batches:
        raise ValueError(
            f"{cfg.data}: no sample fits a {cfg.token_budget}-token batch ({index.report.summary()}); "
            "raise --token-budget, or pass --long-seqs truncate"
        )
    _refuse_unsupervised_after_packing(cfg, index)
    cache_cfg = build_cache_config(cfg, target, taps, plan, index, prepared)
    _refuse_what_cannot_fit(cfg, cache_cfg, plan)
    if dist_info.is_main:  # the packing plan itself was logged once by plan_batches
        shard_bytes = bytes_per_shard(cache_cfg)
        log.info(
            "cache: %s, %s per token (%s), %s of %s on %s",
            cfg.out_dir,
            format_bytes(shard_bytes / cfg.token_budget),
            cfg.storage_dtype,
            plural(len(plan.batches), "shard"),
            format_bytes(shard_bytes),
            plural(dist_info.world_size, "rank"),
        )
    # Rank 0 holds the cache's lock for the whole job (its ranks share it); a second job is refused.
    lock = DirectoryLock(cfg.out_dir, "dflash-extract")
    # One rank alone: with several, another may be writing its first shard while rank 0 fails.
    fresh = dist_info.world_size == 1 and not (Path(cfg.out_dir) / CACHE_CONFIG_FILE).exists()
    created = not Path(cfg.out_dir).exists()  # this run makes --out: an emptied one goes again
    try:
        run_on_main(dist_info, lambda: _prepare_cache(cfg, cache_cfg, lock))
        barrier()
        # Every rank writes shards under the identity rank 0 recorded (target head checksum included).
        cache_cfg = read_cache_config(cfg.out_dir)
        mine = shard_batches_for_rank(plan, dist_info.rank, dist_info.world_size)
        todo, resumed = _pending(cfg, mine)
        if resumed:
            log.info(
                "rank %d: %d of its %s already complete, %d to go",
                dist_info.rank,
                resumed,
                plural(len(mine), "shard"),
                len(todo),
            )
        with SigtermFlag() as stop:
            summary = _extract(cfg, cache_cfg, index, todo, device, dist_info, stop)
        summary.resumed, summary.rank = resumed, dist_info.rank
        barrier()
        # Through run_on_main: a failure there fails every rank with its message, before the gather below.
        run_on_main(dist_info, lambda: _finish(cfg.out_dir, cache_cfg, plan))
        summary.complete = dist_info.is_main
        summary.wall_s = time.monotonic() - start
        return _gathered(summary, dist_info)
    except BaseException:
        if fresh and lock.held:
            _remove_if_no_shard(Path(cfg.out_dir), remove_dir=created)
        raise
    finally:
        lock.release()


def _gathered(summary: ExtractSummary, dist_info: DistInfo) -> ExtractSummary:
    """Rank 0's summary becomes the job's (every rank's counts); the other ranks keep their own."""
    if dist_info.world_size == 1:
        return summary
    summaries = all_gather_objects(summary)
    return job_summary(summaries) if dist_info.is_main else summary


def _remove_if_no_shard(out: Path, remove_dir: bool) -> None:
    """A run that created the cache and failed before its first shard (a damaged checkpoint found while
    loading it, out of memory) takes its empty cache away again: otherwise the corrected command would
    be refused as a resume with other settings."""
    try:
        if not (out / CACHE_CONFIG_FILE).exists() or list_shards(out):
            return
        remove_cache_files(out)
        if remove_dir:  # the lock too (held by this run, released right after): --out is as before the run
            (out / LOCK_FILE).unlink(missing_ok=True)
            if not any(out.iterdir()):
                out.rmdir()
    except (ValueError, OSError) as e:  # a file of the user's appeared, or the disk went away: leave it all
        log.warning("could not remove the empty cache this run created at %s: %s", out, e)
        return
    log.info("removed the empty cache this run had created at %s (no shard was written)", out)


def _refuse_what_cannot_fit(cfg: ExtractConfig, cache_cfg: CacheConfig, plan) -> None:
    """Before any work: the writer's host buffers must fit this machine's memory, and the shards still
    to write must fit the free space under --out."""
    shard_bytes = bytes_per_shard(cache_cfg)
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's ranks on this machine
    buffers = ranks_here * cfg.writer_buffers
    if buffers * shard_bytes > host_bytes:
        raise ValueError(
            f"--token-budget {cfg.token_budget}: one shard is {format_bytes(shard_bytes)} and the writers keep "
            f"{plural(buffers, 'shard')} in host memory ({cfg.writer_buffers} per rank, {ranks_here} ranks here: "
            f"{format_bytes(buffers * shard_bytes)}), more than this machine's {format_bytes(host_bytes)}; "
            "lower --token-budget (or --writer-buffers)"
        )
    out = Path(cfg.out_dir)
    todo = len(plan.batches) - (len(list_shards(out)) if out.is_dir() and not cfg.overwrite else 0)
    where = out
    while not where.exists() and where.parent != where:
        where = where.parent
    free = shutil.disk_usage(where).free
    if cfg.overwrite and out.is_dir():  # the old cache's files go first: their space is free for the new one
        free += sum(p.stat().st_size for p in our_entries(out)[0])
    if todo * shard_bytes > free:
        raise ValueError(
            f"--out {out}: {plural(todo, 'shard')} of {format_bytes(shard_bytes)} still to write "
            f"({format_bytes(todo * shard_bytes)}), but {where} has {format_bytes(free)} free; free space, choose "
            "another --out, or lower the size (--storage fp8, fewer --num-taps)"
        )


def _refuse_nesting(cfg: ExtractConfig) -> None:
    """--out must be neither --target nor --data, nor inside them, nor contain them: --overwrite and
    the cleanup of a killed creation delete files in --out, and a cache file read back as data (a
    glob matching manifest.parquet) would change the dataset under a resume."""
    out = Path(cfg.out_dir)
    problem = None
    if Path(cfg.target).exists() and nested(out, cfg.target):
        problem = f"--out {out} and --target {cfg.target} are the same directory or one lies inside the other"
    elif not is_glob(cfg.data):
        if Path(cfg.data).exists() and nested(out, cfg.data):
            problem = f"--out {out} and --data {cfg.data} are the same directory or one lies inside the other"
    else:
        inside = [f for f in glob.glob(cfg.data, recursive=True) if nested(out, f)]
        written = [out / name for name in (MANIFEST_FILE, CACHE_CONFIG_FILE, shard_path(".", 0), "logs/x.jsonl")]
        read_back = [p for p in written if data_would_read(cfg.data, p)]
        if inside:
            problem = f"--data {cfg.data!r} matches {inside[0]}, inside --out {out}"
        elif read_back:
            problem = f"--data {cfg.data!r} would match the files --out {out} gets (e.g. {read_back[0]})"
    if problem:
        raise CacheMismatchError(f"{problem}; choose an --out outside both the target checkpoint and the dataset")


def _shorten(values: list, shown: int = 8) -> str:
    return str(values) if len(values) <= shown else f"[{', '.join(map(str, values[:shown]))}, ... {len(values)} in all]"


def _refuse_impossible_settings(cfg: ExtractConfig, target: TargetConfig, taps: list[int]) -> None:
    """Settings that can never give a usable cache, refused before the dataset scan and cache.json."""
    vocab, layers = target.vocab_size, target.num_hidden_layers
    for flag, value in (("--mask-token-id", cfg.mask_token_id), ("--pad-token-id", cfg.pad_token_id)):
        if value is not None and not 0 <= value < vocab:
            raise ValueError(
                f"{flag} {value} is outside the target's vocabulary [0, {vocab}) "
                f"({Path(cfg.target) / 'config.json'}); pass an id below {vocab}"
            )
    if cfg.target_topk > vocab:
        raise ValueError(
            f"--target-topk {cfg.target_topk} is more than the target's vocabulary of {vocab} tokens; "
            f"pass at most {vocab}"
        )
    if len(set(taps)) != len(taps):
        raise ValueError(
            f"--num-taps {cfg.num_taps} asks for more taps than the target's {layers} layers give "
            f"distinct ones (the default spread would store layers {_shorten(taps)}); pass --num-taps "
            f"{len(set(taps))} or list distinct layers with --taps"
        )
    bad = [t for t in taps if not 0 <= t < layers]
    if bad:
        raise ValueError(f"--taps {bad}: the target has layers 0..{layers - 1} ({Path(cfg.target) / 'config.json'})")


def _refuse_unsupervised(cfg: ExtractConfig, index) -> None:
    """A drafter learns from supervised tokens whose successor is supervised too (its anchors)."""
    report = index.report
    if report.num_loss_tokens == 0 or report.num_anchor_positions == 0:
        raise ValueError(
            f"{cfg.data}: no supervised tokens in {len(index)} samples that a drafter can learn from "
            f"({report.num_loss_tokens} tokens have loss_mask 1, none followed by another supervised token of "
            "the same sample); check the loss_mask column (1 = train on this token)"
        )


def _refuse_unsupervised_after_packing(cfg: ExtractConfig, index) -> None:
    """--long-seqs may cut away every anchor position (a long prompt before each reply)."""
    report = index.report
    if report.num_packed_anchor_positions == 0:
        where = (
            f"past the first {cfg.token_budget} tokens of samples longer than that"
            if cfg.long_seqs == "truncate"
            else f"in samples longer than that, which --long-seqs {cfg.long_seqs} drops"
        )
        raise ValueError(
            f"{cfg.data}: at --token-budget {cfg.token_budget} packing keeps no supervised tokens a drafter can "
            f"learn from (all {report.num_anchor_positions} anchor positions lie {where}); raise --token-budget"
        )


# The run's settings cache.json records under the same names (each is part of the cache's identity).
RECORDED_SETTINGS = ("token_budget", "max_seqs", "storage_dtype", "target_topk", "mask_token_id", "pad_token_id")


def build_cache_config(
    cfg: ExtractConfig, target: TargetConfig, taps: list[int], plan: PackingPlan, index, prepared: dict | None = None
) -> CacheConfig:
    """What cache.json will say for this run (the target head checksum is filled in by _prepare_cache)."""
    return CacheConfig(
        target=TargetInfo(
            name=str(Path(cfg.target).resolve()),
            config_hash=target.fingerprint(),
            hidden_size=target.hidden_size,
            num_layers=target.num_hidden_layers,
            vocab_size=target.vocab_size,
            dtype=cfg.dtype,
            intermediate_size=target.intermediate_size,
            quantization=_quantization_record(cfg.target, cfg.compute),
            **special_token_ids(cfg.target),
            compute=cfg.compute,
        ),
        tap_layer_ids=list(taps),
        **{name: getattr(cfg, name) for name in RECORDED_SETTINGS},
        packing=PackingRecord(
            algorithm=PACKING_ALGORITHM,
            long_seqs=cfg.long_seqs,
            num_batches=len(plan.batches),
            padding_efficiency=round(plan.padding_efficiency, 6),
            num_truncated=plan.num_truncated,
            num_skipped=plan.num_skipped,
            num_empty=plan.num_empty,
        ),
        dataset=DatasetRecord(
            path=str(cfg.data),
            fingerprint=dataset_fingerprint(index),
            num_samples=len(index),
            num_tokens=int(index.lengths.sum()),
            prepared=prepared,
        ),
        provenance={**provenance(), "extract_config": {k: v for k, v in vars(cfg).items()}},
    )


def _quantization_record(ckpt_dir: str, compute: str) -> str | None:
    """How the run treats the checkpoint's quantization: part of the cache's identity, since --compute
    fp8 keeps an FP8 checkpoint's weights and block scales (block-scaled matmuls, extract/target/fp8/linear.py)."""
    quant = checkpoint_quantization(ckpt_dir)
    if quant is None:
        return None
    if compute == "fp8":
        return (
            f"{quant.describe()} (kept as stored: block-scaled fp8 matmuls, activations per {quant.block_k} channels)"
        )
    return f"{quant.describe()} (dequantised at load)"


def _prepare_cache(cfg: ExtractConfig, cache_cfg: CacheConfig, lock: DirectoryLock) -> None:
    """Rank 0: take the cache's lock, then create the cache, check it for resume, or (--overwrite)
    delete our files in it and create it again. Nothing that is not ours is ever deleted."""
    out = Path(cfg.out_dir)
    _refuse_foreign_out(out)  # again under the lock's creation: a foreign directory stays untouched
    out.mkdir(parents=True, exist_ok=True)
    lock.acquire()
    raw = load_target_head(cfg.target)
    head = {"embed_tokens": raw["embed_tokens"], "lm_head": raw["lm_head"], "final_norm": raw["norm"]}
    # Part of the cache's identity: the same architecture with other weights must not resume into it.
    cache_cfg.target_head_checksum = checksum({k: v.contiguous() for k, v in head.items()})
    if (out / CACHE_CONFIG_FILE).exists() and not cfg.overwrite:  # a resume: no file is deleted
        _check_resumable(out, cache_cfg)
        _repair_target_head(out, cache_cfg, head)
        removed = remove_stale_cache_temporaries(out)
        if removed:
            log.info("removed %d partial file(s) left by a killed run", removed)
        return
    ours, foreign = our_entries(out)
    if (out / CACHE_CONFIG_FILE).exists():
        if foreign:
            raise CacheMismatchError(
                f"--overwrite: {out} also holds files dflash-extract did not write "
                f"({describe(foreign)}); nothing was deleted: move them away first"
            )
        log.warning("--overwrite: deleting the existing cache at %s (%d files of ours)", out, len(ours))
        remove_cache_files(out)
    elif not _is_unfinished_creation(ours):
        if not cfg.overwrite:
            raise CacheMismatchError(
                f"{out} holds shards of a dflash-extract cache but no cache.json; pass "
                "--overwrite to delete them and start over, or choose another --out"
            )
        remove_cache_files(out)
    else:
        # A run killed while creating the cache (before cache.json) left nothing worth keeping.
        remove_cache_files(out)
    create_cache(out, cache_cfg, head)


def _is_unfinished_creation(ours: list[Path]) -> bool:
    """Only what create_cache writes before cache.json: the target head, temporaries, the lock."""
    return all(p.name in (TARGET_HEAD_FILE, LOCK_FILE) or p.name.startswith(TMP_PREFIX) for p in ours)


def _refuse_foreign_out(out: Path) -> None:
    """--out is a file, or a directory that is neither empty nor a cache of ours."""
    if out.exists() and not out.is_dir():
        raise CacheMismatchError(f"--out {out} is a file, not a directory; choose another --out")
    if out.is_dir() and not (out / CACHE_CONFIG_FILE).exists():
        foreign = foreign_entries(out)
        if foreign:
            raise CacheMismatchError(
                f"{out} is not a dflash-extract cache and is not empty ({describe(foreign)}); "
                "choose another (new or empty) --out"
            )


def _repair_target_head(out: Path, cache_cfg: CacheConfig, head: dict) -> None:
    """Resume: a missing or damaged target head of ours is written again from the target (the cache's
    settings, target weights included, matched already); a file of that name we did not write stays."""
    path = out / TARGET_HEAD_FILE
    try:
        read_cache_head(out)
        return
    except CacheFormatError as e:
        if path.exists() and not is_our_file(out, path):
            raise CacheMismatchError(
                f"{e}; dflash-extract did not write this file, so it is not replaced: move it away and re-run"
            ) from e
        log.warning("%s: writing it again from --target", e)
    write_target_head(out, cache_cfg, head)


def _check_resumable(out: Path, want: CacheConfig) -> None:
    try:
        have = read_cache_config(out)
    except CacheFormatError as e:
        raise CacheMismatchError(f"{e}; pass --overwrite to start over") from e
    diffs = _diff(have.identity(), want.identity())
    if any(k == "dataset.fingerprint" for k, _, _ in diffs) and have.dataset and want.dataset:
        # Other tokens: say which of the preparation's settings (--thinking, the chat template) changed.
        prepared = _diff(have.dataset.prepared or {}, want.dataset.prepared or {}, "dataset.prepared.")
        diffs += [d for d in prepared if not d[0].startswith("dataset.prepared.num_")]  # counts follow
    if diffs:
        lines = "\n".join(f"  {k}: cache has {a!r}, this run has {b!r}" for k, a, b in diffs)
        raise CacheMismatchError(
            f"{out} was extracted with other settings; resuming would mix two caches:\n{lines}\n"
            "re-run with the original settings, choose another --out, or pass --overwrite to start over"
        )


def _diff(a: dict, b: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append((f"{prefix}{k}", va, vb))
    return out


def _pending(cfg: ExtractConfig, mine: list[PackedBatch]) -> tuple[list[PackedBatch], int]:
    """This rank's batches still to extract; a present shard that fails its checks is redone."""
    reader = ShardReader(cfg.out_dir)
    present = set(reader.batch_ids())
    todo, kept = [], 0
    for batch in mine:
        if batch.batch_id in present:
            try:
                info = reader.info(batch.batch_id) if cfg.fast_resume else reader.verify(batch.batch_id)
                if [s.sample_id for s in info.samples] == batch.sample_ids:
                    kept += 1
                    continue
                log.warning("%s holds other samples than the plan: extracting it again", info.path)
            except ShardError as e:
                if "belongs to another cache" in e.reason:  # not ours to overwrite: the user decides
                    raise CacheMismatchError(str(e)) from e
                if not is_our_shard(e.path):
                    raise CacheMismatchError(
                        f"{e}; it is not recognisably a shard dflash-extract wrote, so it is not replaced: "
                        "move it away and re-run the same command"
                    ) from e
                log.warning("extracting batch %d again: %s", batch.batch_id, e)
        todo.append(batch)
    return todo, kept


class ExtractionStopped(RuntimeError):
    """SIGTERM arrived: the shards in flight were written, the rest resume with the same command."""


def _extract(cfg, cache_cfg, index, todo, device, dist_info, stop: SigtermFlag | None = None) -> ExtractSummary:
    if not todo:
        return ExtractSummary(cfg.out_dir, cache_cfg.planned_batches, 0, 0, 0, 0.0, 0.0, 0)
    kernels = select_kernels(device, allow_slow_kernels=cfg.allow_slow_kernels)
    with_head = cfg.target_topk > 0
    model = TargetModel.from_pretrained(
        cfg.target,
        device,
        dtype=getattr(torch, cfg.dtype),
        kernels=kernels,
        last_layer=None if with_head else cache_cfg.tap_layer_ids[-1],
        with_head=with_head,
        compute=cfg.compute,
    )
    writer = AsyncShardWriter(cfg.out_dir, cache_cfg, device, num_buffers=cfg.writer_buffers)
    return extract_batches(model, cfg, cache_cfg, index, todo, device, writer, dist_info.rank, stop=stop)


def extract_batches(
    model: TargetModel,
    cfg: ExtractConfig,
    cache_cfg: CacheConfig,
    index,
    todo: list[PackedBatch],
    device: torch.device,
    writer: ShardSink,
    rank: int = 0,
    stop: SigtermFlag | None = None,
) -> ExtractSummary:
    """Run `model` over `todo` and hand each batch's states to `writer` (an AsyncShardWriter; the
    benchmark passes one that discards, to time the forward alone); closes `writer`.

    The loop only launches work: loading batch i+1 from the dataset overlaps the GPU's forward of
    batch i, and the writer thread's disk writes overlap both.
    """
    taps = cache_cfg.tap_layer_ids
    loader = SampleLoader(index)
    jsonl = Path(cfg.out_dir) / "logs" / f"extract-rank{rank}.jsonl"
    # One bar, rank 0's, on a terminal; other ranks there print only their final line (eight bars
    # redrawn over each other are unreadable). Into a file every rank writes plain lines.
    interactive = is_interactive()
    interval_s = float("inf") if interactive and rank != 0 else cfg.progress_interval_s
    progress = ProgressLog(log, jsonl, len(todo), interval_s, bar=interactive and rank == 0, desc=f"rank {rank}")
    real_tokens = 0
    try:
        started = 0
        for done, batch in enumerate(todo, start=1):
            if stop is not None and stop.signalled:
                break  # SIGTERM: nothing new starts; what the writer holds is written below
            started = done
            arrays = load_batch(loader, batch, cfg.packing)
            n = batch.num_tokens
            ids = torch.from_numpy(arrays["input_ids"][:n]).to(device, non_blocking=True)
            pos = torch.from_numpy(arrays["position_ids"][:n]).to(device, non_blocking=True)
            # Boundaries stay on the host: the kernels need them there (fla's chunk table, max length),
            # and a device copy read back would stall the loop until the previous batch finishes.
            cu = torch.from_numpy(arrays["cu_seqlens"][: len(batch.sample_ids) + 1])
            if cfg.target_topk:
                hidden, topk_ids, topk_lp = model.topk_next_tokens(
                    ids, pos, cu, taps, cfg.target_topk, chunk_tokens=cfg.topk_chunk_tokens
                )
                topk = (topk_ids.to(torch.int32), topk_lp.to(torch.bfloat16))
            else:
                hidden, topk = model.forward_packed(ids, pos, cu, taps), None
            samples = [
                SampleEntry(sid, int(o), int(length), int(m))
                for sid, o, length, m in zip(
                    batch.sample_ids, arrays["sample_offsets"], arrays["sample_lengths"], arrays["sample_loss_tokens"]
                )
            ]
            writer.submit(batch.batch_id, arrays, hidden, topk, samples)
            real_tokens += n
            if done < len(todo):
                _report(progress, done, len(todo), real_tokens, writer, cfg.token_budget, rank, force=False)
        writer.close()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # The last line comes after the writer drained: every shard it counts is durable on disk.
        if started:
            _report(progress, started, len(todo), real_tokens, writer, cfg.token_budget, rank, force=True)
        if stop is not None and stop.signalled:
            raise ExtractionStopped(
                f"SIGTERM: rank {rank} stopped after {writer.shards_written} of its {len(todo)} pending shards, each written "
                f"completely; run the same command again to extract the rest into {cfg.out_dir}"
            )
    except BaseException:
        writer.close_quietly()
        raise
    finally:
        progress.close()
    return ExtractSummary(
        cache_dir=cfg.out_dir,
        num_batches=cache_cfg.planned_batches,
        written=writer.shards_written,
        resumed=0,
        tokens=real_tokens,
        seconds=progress.elapsed(),
        padding_efficiency=real_tokens / (len(todo) * cfg.token_budget),
        bytes_written=writer.bytes_written,
        progress_log=str(jsonl),
    )


def _report(
    progress: ProgressLog, done: int, total: int, tokens: int, writer: ShardSink, budget: int, rank: int, force: bool
) -> None:
    """One progress record. Shards count as written once the writer thread made them durable."""
    elapsed = max(progress.elapsed(), 1e-9)
    written, durable, waited = writer.bytes_written, writer.shards_written, writer.wait_s
    rec = {
        "rank": rank,
        "batches_done": done,
        "batches_total": total,
        "shards_written": durable,
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "padding_efficiency": tokens / (done * budget),
        "gb_written": written / 1e9,
        "write_gb_per_s": written / 1e9 / elapsed,
        "wait_for_disk_s": waited,
        "eta_s": progress.eta(done),
    }
    line = (
        f"[rank {rank}] batch {done}/{total} | {rec['tokens_per_s']:,.0f} tok/s | pad eff "
        f"{100 * rec['padding_efficiency']:.1f}% | {format_bytes(written)} written | waited {waited:.1f}s for disk "
        f"| ETA {format_duration(rec['eta_s'])}"
    )
    bar = (
        f"{rec['tokens_per_s']:,.0f} tok/s, pad {100 * rec['padding_efficiency']:.1f}%, "
        f"{format_bytes(written)} written, disk wait {waited:.1f}s"
    )  # the bar shows counts and ETA itself
    progress.report(rec, line, force=force, done_units=done, postfix=bar)


def _finish(out: str, cache_cfg: CacheConfig, plan: PackingPlan) -> None:
    reader = ShardReader(out)
    infos = [reader.info(b) for b in reader.batch_ids()]
    write_manifest(out, infos)
    missing = sorted(set(range(len(plan.batches))) - {i.batch_id for i in infos})
    if missing:
        raise RuntimeError(
            f"{out}: shards {missing[:10]} are missing after every rank finished; re-run the same command to resume"
        )
    log.info("cache complete: %d shards, %d samples, manifest written", len(infos), sum(len(i.samples) for i in infos))
