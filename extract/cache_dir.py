"""The --out directory of dflash-extract: what its cache.json records for this run, and the checks,
creation and resume of the cache in it, so that a run never mixes two caches and never deletes a file
it did not write.

Before any work: --out must lie outside --target and --data, and be new, empty or a cache of ours
(`refuse_nesting`, `refuse_foreign_out`). Rank 0 then creates the cache, or checks that the existing
one was made with the same settings and repairs its target head (`prepare_cache`); each rank keeps its
shards that verify and redoes the rest (`pending_batches`). A run that created the cache and failed
before its first shard takes it away again (`remove_if_no_shard`). Which files are ours:
shards/ownership.py; every refusal of that kind is OwnershipError (shards/common/owned).
"""

from __future__ import annotations

import glob
import json
import logging
from pathlib import Path

from extract.config import ExtractConfig
from extract.dataset.files import data_would_read, is_glob
from extract.dataset.index import dataset_fingerprint
from extract.dataset.packing import PACKING_ALGORITHM, PackedBatch, PackingPlan
from extract.projection_source import check_source_weights, source_record
from extract.target.config import TargetConfig, max_position_embeddings, special_token_ids
from extract.target.fp8.quantization import checkpoint_quantization
from extract.target.weights import load_target_head
from shards import (
    CacheConfig,
    CacheFormatError,
    ShardError,
    ShardReader,
    TargetInfo,
    create_cache,
    read_cache_config,
    write_target_head,
)
from shards.common.cli_options import to_options
from shards.common.errors import UserError
from shards.common.identity import differences
from shards.common.lock import DirectoryLock
from shards.common.owned import LOCK_FILE, Dir, OwnershipError, describe, nested, not_own_file
from shards.common.provenance import provenance
from shards.format import (
    CACHE_CONFIG_FILE,
    MANIFEST_FILE,
    SHARDS_DIR,
    TARGET_HEAD_FILE,
    DatasetRecord,
    PackingRecord,
    PiecesRecord,
    ProjectionRecord,
    checksum,
    shard_path,
)
from shards.ownership import (
    is_our_file,
    is_our_shard,
    planted_at_our_names,
    remove_cache_files,
    remove_stale_cache_temporaries,
    survey_cache,
)
from shards.projection import load_projection
from shards.reader import ForeignShardError, list_shards
from shards.reader import load_target_head as read_cache_head

log = logging.getLogger(__name__)


class CacheMismatchError(UserError, ValueError):
    """An existing cache was made with other settings; resuming into it would mix two caches."""


# The run's settings cache.json records under the same names (each is part of the cache's identity).
RECORDED_SETTINGS = ("token_budget", "max_seqs", "storage_dtype", "target_topk", "mask_token_id", "pad_token_id")


def build_cache_config(
    cfg: ExtractConfig, target: TargetConfig, taps: list[int], plan: PackingPlan, index, prepared: dict | None = None
) -> CacheConfig:
    """What cache.json will say for this run (the target head checksum is filled in by prepare_cache)."""
    info = TargetInfo(
        name=str(Path(cfg.target).resolve()),
        config_hash=target.fingerprint(),
        hidden_size=target.hidden_size,
        num_layers=target.num_hidden_layers,
        vocab_size=target.vocab_size,
        dtype=cfg.dtype,
        intermediate_size=target.intermediate_size,
        quantization=_quantization_record(cfg.target, cfg.compute),
        **special_token_ids(cfg.target),
        max_position_embeddings=max_position_embeddings(cfg.target),
        compute=cfg.compute,
    )
    return CacheConfig(
        target=info,
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
            longest_response=index.report.longest_response,
        ),
        pieces=_pieces_record(cfg, plan),
        provenance={**provenance(), "extract_config": to_options(cfg)},
        projection=_projection_record(cfg, info, taps),
        **_cache_modes(index.modes),
    )


def _cache_modes(modes: list[str | None]) -> dict:
    """cache.json's mode fields: "chat_mode" for data in one mode (None = unknown), else "chat_modes", the
    list the shard headers' per-sample mode indices point into."""
    records = [json.loads(m) if m is not None else None for m in modes]
    return {"chat_mode": records[0]} if len(records) == 1 else {"chat_modes": records}


def _projection_record(cfg: ExtractConfig, target: TargetInfo, taps: list[int]) -> ProjectionRecord | None:
    """--pca-rank's settings (the estimate fills in the checksum and the variance kept), or --pca-from's
    cache's (the copy of its projection fills them in)."""
    if cfg.pca_from is not None:
        return source_record(cfg, target, taps)
    if cfg.pca_rank == 0:
        return None
    return ProjectionRecord(
        rank=cfg.pca_rank,
        normalize=cfg.pca_normalize,
        group_size=cfg.pca_group_size,
        sample_tokens=cfg.pca_sample_tokens,
        seed=cfg.pca_seed,
    )


def _pieces_record(cfg: ExtractConfig, plan: PackingPlan) -> PiecesRecord | None:
    """How long samples were stored, when --max-seq-len lets any be longer than a shard."""
    if not cfg.packing.pieced:
        return None
    return PiecesRecord(
        max_seq_len=cfg.packing.longest,
        context=cfg.piece_context,
        label_reach=cfg.piece_label_reach,
        num_pieced_samples=plan.num_pieced,
        longest_sample=plan.longest_packed,
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


def refuse_nesting(cfg: ExtractConfig) -> None:
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
        raise OwnershipError(f"{problem}; choose an --out outside both the target checkpoint and the dataset")


def _has_cache_config(out: Path) -> bool:
    """cache.json is there as a regular file (a link or FIFO of that name is foreign, never a cache's)."""
    if not out.is_dir():
        return False
    with Dir.open(out) as d:
        return d.is_file(CACHE_CONFIG_FILE)


def refuse_foreign_out(out: Path) -> None:
    """--out is a file, or a directory that is neither empty nor a cache of ours."""
    if out.exists() and not out.is_dir():
        raise OwnershipError(f"--out {out} is a file, not a directory; choose another --out")
    if out.is_dir() and not _has_cache_config(out):
        foreign = survey_cache(out).foreign
        if foreign:
            raise OwnershipError(
                f"{out} is not a dflash-extract cache and is not empty ({describe(foreign)}); "
                "choose another (new or empty) --out"
            )


def prepare_cache(cfg: ExtractConfig, cache_cfg: CacheConfig, lock: DirectoryLock) -> None:
    """Rank 0: take the cache's lock, then create the cache, check it for resume, or (--overwrite)
    delete our files in it and create it again. Nothing that is not ours is ever deleted."""
    out = Path(cfg.out_dir)
    raw = load_target_head(cfg.target)
    head = {"embed_tokens": raw["embed_tokens"], "lm_head": raw["lm_head"], "final_norm": raw["norm"]}
    # Part of the cache's identity: the same architecture with other weights must not resume into it.
    cache_cfg.target_head_checksum = checksum({k: v.contiguous() for k, v in head.items()})
    if cfg.pca_from is not None:  # other weights of the same architecture: refused before --out is made
        check_source_weights(cfg, cache_cfg.target_head_checksum)
    refuse_foreign_out(out)  # again under the lock's creation: a foreign directory stays untouched
    Dir.open(out, create=True).close()
    lock.acquire()
    if _has_cache_config(out) and not cfg.overwrite:  # a resume: no file is deleted
        _check_resumable(out, cache_cfg)
        recorded = read_cache_config(out)
        if recorded.projection is not None and recorded.projection.checksum is not None:
            load_projection(out, recorded)  # the codes were made with it: a replaced file is refused now
        with Dir.opened(out, SHARDS_DIR, create=True):
            pass  # a real folder, before any work: one swapped for a link is refused, never written through
        for entry in planted_at_our_names(out):
            raise not_own_file(entry.path, entry.st)
        _repair_target_head(out, cache_cfg, head)
        removed = remove_stale_cache_temporaries(out)
        if removed:
            log.info("removed %d partial file(s) left by a killed run", removed)
        return
    found = survey_cache(out)
    if _has_cache_config(out):
        if found.foreign:
            raise OwnershipError(
                f"--overwrite: {out} also holds files dflash-extract did not write "
                f"({describe(found.foreign)}); nothing was deleted: move them away first"
            )
        log.warning(
            "--overwrite: deleting the existing cache at %s (%d files of ours)",
            out,
            len(found.ours) + len(found.scaffolding),
        )
        remove_cache_files(out)
    elif not _is_unfinished_creation(found.ours):
        if not cfg.overwrite:
            raise OwnershipError(
                f"{out} holds shards of a dflash-extract cache but no cache.json; pass "
                "--overwrite to delete them and start over, or choose another --out"
            )
        remove_cache_files(out)
    else:
        # A run killed while creating the cache (before cache.json) left nothing worth keeping.
        remove_cache_files(out)
    create_cache(out, cache_cfg, head)


def _is_unfinished_creation(ours: list) -> bool:
    """Only what create_cache writes before cache.json: the target head (besides temporaries, the lock)."""
    return all(e.folder is None and e.name == TARGET_HEAD_FILE for e in ours)


def _repair_target_head(out: Path, cache_cfg: CacheConfig, head: dict) -> None:
    """Resume: a missing or damaged target head of ours is written again from the target (the cache's
    settings, target weights included, matched already); a file of that name we did not write stays."""
    try:
        read_cache_head(out)
        return
    except CacheFormatError as e:
        with Dir.open(out) as d:
            present = d.lstat(TARGET_HEAD_FILE) is not None
        if present and not is_our_file(out, TARGET_HEAD_FILE):
            raise OwnershipError(
                f"{e}; dflash-extract did not write this file, so it is not replaced: move it away and re-run"
            ) from e
        log.warning("%s: writing it again from --target", e)
    write_target_head(out, cache_cfg, head)


def _check_resumable(out: Path, want: CacheConfig) -> None:
    """Resume: the identity cache.json recorded must equal this run's; each difference is named by its key."""
    try:
        have = read_cache_config(out)
    except CacheFormatError as e:
        raise CacheMismatchError(f"{e}; pass --overwrite to start over") from e
    diffs = differences(have.identity(), want.identity())
    if any(d.key == "dataset.fingerprint" for d in diffs) and have.dataset and want.dataset:
        # Other tokens: say which of the preparation's settings (--thinking, the chat template) changed.
        prepared = differences(have.dataset.prepared or {}, want.dataset.prepared or {}, "dataset.prepared.")
        diffs += [d for d in prepared if not d.key.startswith("dataset.prepared.num_")]  # counts follow
    if diffs:
        lines = "\n".join(f"  {d.describe('cache has', 'this run has')}" for d in diffs)
        raise CacheMismatchError(
            f"{out} was extracted with other settings; resuming would mix two caches:\n{lines}\n"
            "re-run with the original settings, choose another --out, or pass --overwrite to start over"
        )


def pending_batches(cfg: ExtractConfig, mine: list[PackedBatch]) -> tuple[list[PackedBatch], int]:
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
            except ForeignShardError as e:  # not ours to overwrite: the user decides
                raise OwnershipError(str(e)) from e
            except ShardError as e:
                with Dir.opened(cfg.out_dir, SHARDS_DIR) as shards:
                    ours = is_our_shard(shards, e.path.name)
                if not ours:
                    raise OwnershipError(
                        f"{e}; it is not recognisably a shard dflash-extract wrote, so it is not replaced: "
                        "move it away and re-run the same command"
                    ) from e
                log.warning("extracting batch %d again: %s", batch.batch_id, e)
        todo.append(batch)
    return todo, kept


def remove_if_no_shard(out: Path, remove_dir: bool) -> None:
    """A run that created the cache and failed before its first shard (a damaged checkpoint found while
    loading it, out of memory) takes its empty cache away again: otherwise the corrected command would
    be refused as a resume with other settings."""
    try:
        if not _has_cache_config(out) or list_shards(out):
            return
        remove_cache_files(out)
        if remove_dir:  # the lock too (held by this run, released right after): --out is as before the run
            with Dir.open(out) as d:
                d.unlink(LOCK_FILE, missing_ok=True)
                emptied = not d.names()
            if emptied:
                out.rmdir()
    except (ValueError, OSError) as e:  # a file of the user's appeared, or the disk went away: leave it all
        log.warning("could not remove the empty cache this run created at %s: %s", out, e)
        return
    log.info("removed the empty cache this run had created at %s (no shard was written)", out)
