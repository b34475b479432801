"""run_extract: dataset -> packed batches -> frozen target -> hidden-state cache, on every rank.

Order of work, so that mistakes cost seconds and not GPU hours:
  1. settings, target config and every dataset row are checked (no model loaded yet; the refusals:
     extract/refusals.py);
  2. the packing plan is made (deterministic: batch ids are stable across runs);
  3. rank 0 creates the cache, or checks that an existing one was made with the same settings
     (the --out directory: extract/cache_dir.py); for a projected cache (--pca-rank) it estimates the
     projection from a sample of the dataset first (extract/projection.py);
  4. each rank skips its batches whose shard exists and verifies, and extracts the rest (the batch
     loop: extract_batches);
  5. rank 0 writes the manifest once every rank is done.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from extract.cache_dir import (
    build_cache_config,
    pending_batches,
    prepare_cache,
    refuse_foreign_out,
    refuse_nesting,
    remove_if_no_shard,
)
from extract.chats.prepare import file_mode_text, tokens_for_extraction
from extract.config import ExtractConfig
from extract.dataset.index import SampleLoader, scan_dataset
from extract.dataset.packing import (
    PackedBatch,
    PackingPlan,
    assemble_piece,
    load_batch,
    load_long_sample,
    plan_batches,
    shard_batches_for_rank,
)
from extract.distributed import init_distributed, run_on_main
from extract.projection import estimate_projection
from extract.projection_source import copy_source_projection
from extract.refusals import (
    refuse_impossible_settings,
    refuse_unsupervised,
    refuse_unsupervised_after_packing,
    refuse_what_cannot_fit,
)
from extract.target.config import TargetConfig
from extract.target.fp8.quantization import checkpoint_quantization
from extract.target.kernels import select_kernels
from extract.target.model import TargetModel
from extract.writer import AsyncShardWriter
from shards import CacheConfig, SampleEntry, ShardReader, read_cache_config, write_cache_config, write_manifest
from shards.common.compile_cache import use_compile_cache
from shards.common.durable import check_writable
from shards.common.errors import Stopped, UserError
from shards.common.lock import DirectoryLock
from shards.common.owned import Dir
from shards.common.progress import ProgressLog, format_bytes, format_duration, is_interactive, plural
from shards.common.runtime import DistInfo, all_gather_objects, barrier, process_group_scope, resolve_device
from shards.common.sigterm import SigtermFlag
from shards.common.startup import StartupClock
from shards.format import CACHE_CONFIG_FILE, MANIFEST_FILE, bytes_per_shard
from shards.ownership import LOGS_DIR
from shards.projection import write_projection

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
    startup: dict = dataclasses.field(default_factory=dict)  # seconds per start-up phase (shards/common/startup.py)

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
    with process_group_scope():  # the group ends here on every rank, its threads with it
        return _run(cfg, dist_info)


def _run(cfg: ExtractConfig, dist_info: DistInfo) -> ExtractSummary:
    start = time.monotonic()
    refuse_nesting(cfg)
    refuse_foreign_out(Path(cfg.out_dir))
    check_writable(cfg.out_dir, f"--out {cfg.out_dir}")
    target = TargetConfig.from_dir(cfg.target)
    checkpoint_quantization(cfg.target)  # an unimplemented quantization is refused before any work
    taps = cfg.tap_layer_ids or target.default_tap_layer_ids(cfg.num_taps)
    refuse_impossible_settings(cfg, target, taps)
    # Every tensor the run will read, checked in the safetensors headers before the dataset scan.
    with_head = cfg.target_topk > 0
    TargetModel.check_checkpoint(cfg.target, last_layer=None if with_head else max(taps), with_head=with_head)
    device = resolve_device(cfg.device, dist_info.local_rank)
    # Conversations are rendered with the target's chat template first (each rank does the same work).
    with tokens_for_extraction(cfg.data, cfg.target, cfg.thinking, cfg.template_kwargs) as (data, prepared):
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
    limit = "--max-seq-len" if cfg.packing.pieced else "--token-budget"  # --long-seqs applies past it
    index = scan_dataset(
        data,
        vocab_size=target.vocab_size,
        token_budget=cfg.packing.longest,
        long_seqs=cfg.long_seqs,
        limit_flag=limit,
        file_mode=file_mode_text,
    )
    if len(index) == 0:
        raise ValueError(f"{cfg.data}: no non-empty samples ({index.report.summary()})")
    refuse_unsupervised(cfg, index)
    plan = plan_batches(index, cfg.packing)
    if not plan.batches:
        raise ValueError(
            f"{cfg.data}: no sample fits a {cfg.token_budget}-token batch ({index.report.summary()}); "
            "raise --token-budget, or pass --long-seqs truncate"
        )
    refuse_unsupervised_after_packing(cfg, index)
    cache_cfg = build_cache_config(cfg, target, taps, plan, index, prepared)
    refuse_what_cannot_fit(cfg, cache_cfg, plan)
    if dist_info.is_main:  # the packing plan itself was logged once by plan_batches
        shard_bytes = bytes_per_shard(cache_cfg)
        log.info(
            "cache: %s, %s per token (%s), %s of %s on %s",
            cfg.out_dir,
            format_bytes(shard_bytes / cfg.token_budget),
            cfg.storage_dtype
            if cache_cfg.projection is None
            else f"{cfg.storage_dtype} codes of {cache_cfg.projection.rank} principal directions of the taps",
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
        run_on_main(dist_info, lambda: prepare_cache(cfg, cache_cfg, lock))
        barrier()
        # Every rank writes shards under the identity rank 0 recorded (target head checksum included).
        cache_cfg = read_cache_config(cfg.out_dir)
        model = None
        # Start-up (weights, first batches) starts where the target loads: here when rank 0 loads it for
        # the projection's estimate (a phase of its own), else in _extract, after the resume check.
        clock = None
        if cache_cfg.projection is not None and cache_cfg.projection.checksum is None:
            clock = StartupClock(device)

            def estimate() -> None:
                nonlocal model
                model = _estimate_projection(cfg, cache_cfg, index, plan, device, clock)

            run_on_main(dist_info, estimate)
            barrier()
            clock.mark("projection")  # the other ranks: waiting for rank 0's
            cache_cfg = read_cache_config(cfg.out_dir)  # with the projection's checksum: the shards' cache_id
        mine = shard_batches_for_rank(plan, dist_info.rank, dist_info.world_size)
        todo, resumed = pending_batches(cfg, mine)
        if resumed:
            log.info(
                "rank %d: %d of its %s already complete, %d to go",
                dist_info.rank,
                resumed,
                plural(len(mine), "shard"),
                len(todo),
            )
        with SigtermFlag() as stop:
            summary = _extract(
                cfg, cache_cfg, index, todo, device, dist_info, clock or StartupClock(device), stop, model
            )
        summary.resumed, summary.rank = resumed, dist_info.rank
        barrier()
        # Through run_on_main: a failure there fails every rank with its message, before the gather below.
        run_on_main(dist_info, lambda: _finish(cfg.out_dir, cache_cfg, plan))
        summary.complete = dist_info.is_main
        summary.wall_s = time.monotonic() - start
        return _gathered(summary, dist_info)
    except BaseException:
        if fresh and lock.held:
            remove_if_no_shard(Path(cfg.out_dir), remove_dir=created)
        raise
    finally:
        lock.release()


def _gathered(summary: ExtractSummary, dist_info: DistInfo) -> ExtractSummary:
    """Rank 0's summary becomes the job's (every rank's counts); the other ranks keep their own."""
    if dist_info.world_size == 1:
        return summary
    summaries = all_gather_objects(summary)
    return job_summary(summaries) if dist_info.is_main else summary


class ExtractionStopped(Stopped, RuntimeError):
    """SIGTERM arrived: the shards in flight were written, the rest resume with the same command."""


def _extract(
    cfg,
    cache_cfg,
    index,
    todo,
    device,
    dist_info,
    clock: StartupClock,
    stop: SigtermFlag | None = None,
    model: TargetModel | None = None,
) -> ExtractSummary:
    """Extract `todo` with `model` (rank 0's, loaded for the projection estimate) or the target loaded
    here; `clock` holds the start-up phases so far."""
    if not todo:
        return ExtractSummary(cfg.out_dir, cache_cfg.planned_batches, 0, 0, 0, 0.0, 0.0, 0)
    if model is None:
        model = _load_target(cfg, cache_cfg, device)
        clock.mark("weights")
    writer = AsyncShardWriter(cfg.out_dir, cache_cfg, device, num_buffers=cfg.writer_buffers)
    return extract_batches(model, cfg, cache_cfg, index, todo, device, writer, dist_info.rank, stop=stop, clock=clock)


def _load_target(cfg: ExtractConfig, cache_cfg: CacheConfig, device: torch.device) -> TargetModel:
    if device.type == "cuda":  # where the forward compiles; before select_kernels imports fla
        use_compile_cache(cfg.compile)
    kernels = select_kernels(device, allow_slow_kernels=cfg.allow_slow_kernels)
    with_head = cfg.target_topk > 0
    return TargetModel.from_pretrained(
        cfg.target,
        device,
        dtype=getattr(torch, cfg.dtype),
        kernels=kernels,
        last_layer=None if with_head else cache_cfg.tap_layer_ids[-1],
        with_head=with_head,
        compute=cfg.compute,
    )


def _estimate_projection(cfg, cache_cfg, index, plan, device, clock: StartupClock) -> TargetModel:
    """Rank 0: estimate a projected cache's projection, write projection.safetensors and record its
    checksum and variance kept in cache.json (before any shard: the codes are made with it). Returns the
    target, loaded for it (the clock's weights phase), for the extraction to use."""
    copied = copy_source_projection(cfg, cache_cfg) if cfg.pca_from is not None else None  # before the load
    model = _load_target(cfg, cache_cfg, device)
    clock.mark("weights")
    loader = SampleLoader(index)

    def forward_taps(batch: PackedBatch) -> torch.Tensor:
        arrays = load_batch(loader, batch, cfg.packing)
        return model.forward_packed(
            *_device_inputs(arrays, batch.num_tokens, len(batch.sample_ids), device), cache_cfg.tap_layer_ids
        )

    if copied is not None:  # another cache's projection, as its sample estimated it
        projection_RF, scale_F, kept = copied
    else:
        # Packed batches only: a long sample's pieces come from one forward over the whole sample, which
        # the estimate would have to run for a few of its tokens.
        packed = [batch for batch in plan.batches if batch.piece is None]
        if not packed:
            raise UserError(
                f"--pca-rank {cfg.pca_rank}: every sample is longer than --token-budget {cfg.token_budget}, and the "
                "projection is estimated from packed batches; lower --max-seq-len or raise --token-budget"
            )
        projection_RF, scale_F, kept = estimate_projection(cache_cfg, packed, forward_taps, device)
    cache_cfg.projection.checksum = write_projection(cfg.out_dir, projection_RF, scale_F)
    cache_cfg.projection.variance_kept = round(kept, 6)
    write_cache_config(cfg.out_dir, cache_cfg)
    return model


def _device_inputs(arrays: dict, n: int, num_seqs: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """input ids and position ids of the first n tokens of `arrays` on the device, and the cu_seqlens of
    its num_seqs sequences."""
    ids = torch.from_numpy(arrays["input_ids"][:n]).to(device, non_blocking=True)
    pos = torch.from_numpy(arrays["position_ids"][:n]).to(device, non_blocking=True)
    # Boundaries stay on the host: the kernels need them there (fla's chunk table, max length),
    # and a device copy read back would stall the loop until the previous batch finishes.
    cu = torch.from_numpy(arrays["cu_seqlens"][: num_seqs + 1])
    return ids, pos, cu


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
    clock: StartupClock | None = None,
) -> ExtractSummary:
    """Run `model` over `todo` and hand each batch's states to `writer` (an AsyncShardWriter; the
    benchmark passes one that discards, to time the forward alone); closes `writer`. `clock` (its
    phases so far, e.g. the weights') gets the first two batches, each waited for (compile and tuning
    fall in the first; the second is a steady one to set it against), logged and recorded.

    The loop only launches work: loading batch i+1 from the dataset overlaps the GPU's forward of
    batch i, and the writer thread's disk writes overlap both.
    """
    taps = cache_cfg.tap_layer_ids
    loader = SampleLoader(index)
    jsonl = Path(cfg.out_dir) / LOGS_DIR / f"extract-rank{rank}.jsonl"
    # One bar, rank 0's, on a terminal; other ranks there print only their final line (eight bars
    # redrawn over each other are unreadable). Into a file every rank writes plain lines.
    interactive = is_interactive()
    interval_s = float("inf") if interactive and rank != 0 else cfg.progress_interval_s
    with Dir.opened(cfg.out_dir, LOGS_DIR, create=True) as logs:
        records = logs.open_append(jsonl.name)
    progress = ProgressLog(log, records, len(todo), interval_s, bar=interactive and rank == 0, desc=f"rank {rank}")
    real_tokens = 0
    # Each sample's index into cache.json's modes (a long sample's pieces carry their sample's): data in
    # one mode have none, and every sample is in mode 0.
    mode_of = {} if index.mode_ids is None else dict(zip(index.sample_ids, index.mode_ids.tolist()))
    startup: dict = {}  # the clock's record, once the first batches are done
    try:
        started = 0
        whole = None  # the long sample whose pieces are being written: (its first batch, sample, states)
        for done, batch in enumerate(todo, start=1):
            if stop is not None and stop.signalled:
                break  # SIGTERM: nothing new starts; what the writer holds is written below
            started = done
            if batch.piece is None:
                arrays = load_batch(loader, batch, cfg.packing)
                n = batch.num_tokens
                hidden, topk = _forward(model, cfg, taps, device, arrays, n, len(batch.sample_ids))
            else:
                if whole is None or whole[0] != batch.piece.first_batch:
                    whole = None  # the previous sample's states go before the next forward
                    whole = (batch.piece.first_batch, *_forward_whole(model, cfg, taps, device, loader, batch))
                arrays = assemble_piece(whole[1], batch.piece, cfg.packing)
                n, start = cfg.token_budget, batch.piece.start
                hidden = whole[2][start : start + n]
                topk = None if whole[3] is None else tuple(t[start : start + n] for t in whole[3])
            samples = [
                SampleEntry(sid, int(o), int(length), int(m), mode_of.get(sid, 0))
                for sid, o, length, m in zip(
                    batch.sample_ids, arrays["sample_offsets"], arrays["sample_lengths"], arrays["sample_loss_tokens"]
                )
            ]
            writer.submit(batch.batch_id, arrays, hidden, topk, samples)
            real_tokens += n
            if clock is not None and done <= 2:
                clock.mark("first_batch" if done == 1 else "second_batch")
                if done == min(2, len(todo)):
                    startup = clock.log(f"rank {rank}'s extraction")
                    records.write(json.dumps({"rank": rank, "event": "startup", **startup}) + "\n")
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
        startup=startup,
    )


def _forward(model: TargetModel, cfg: ExtractConfig, taps, device, arrays: dict, n: int, num_seqs: int):
    """(hidden [n, K, H], target top-k or None) of the first n tokens of `arrays`, num_seqs sequences."""
    ids, pos, cu = _device_inputs(arrays, n, num_seqs, device)
    if not cfg.target_topk:
        return model.forward_packed(ids, pos, cu, taps), None
    hidden, topk_ids, topk_lp = model.topk_next_tokens(
        ids, pos, cu, taps, cfg.target_topk, chunk_tokens=cfg.topk_chunk_tokens
    )
    return hidden, (topk_ids.to(torch.int32), topk_lp.to(torch.bfloat16))


def _forward_whole(model: TargetModel, cfg: ExtractConfig, taps, device, loader: SampleLoader, batch: PackedBatch):
    """(sample, hidden [L, K, H], top-k or None) of the long sample a piece batch was cut from: one
    forward over all L tokens, as serving computes them (the GatedDeltaNet state and attention over
    the whole sample, never a chunked prefill)."""
    sample = load_long_sample(loader, batch, cfg.packing)
    length = len(sample)
    arrays = {
        "input_ids": sample.input_ids,
        "position_ids": np.arange(length, dtype=np.int32),
        "cu_seqlens": np.array([0, length], dtype=np.int32),
    }
    return (sample, *_forward(model, cfg, taps, device, arrays, length, 1))


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
    log.info(
        "cache complete: %s, %s, manifest written",
        plural(len(infos), "shard"),
        plural(sum(len(i.samples) for i in infos), "sample"),
    )
