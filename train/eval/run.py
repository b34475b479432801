"""What `dflash-train eval` decides before it runs, and the run: which shards (the planned ids, split as
training splits them), which weights (an export, a checkpoint verified as export verifies it, or a run
directory's newest valid one), whether they fit the cache, and a loud warning when a chosen shard is
one a checkpoint was trained on (the figures are then not held-out). The evaluation itself is
train/eval/evaluate.py.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shards import CacheConfig, ShardReader
from shards.common.chat_mode import chat_mode, describe_mode, parse_template_kwargs
from shards.common.compile_cache import use_compile_cache
from shards.common.json_input import InputFileError, read_json_object
from shards.common.lock import DirectoryLock
from shards.common.schema import read_field
from train.drafter.attention import choose_backend
from train.drafter.config import DrafterConfig
from train.drafter.model import DFlashDrafter, TargetHead
from train.eval.config import EvalConfig
from train.eval.evaluate import EvalResult, eval_copy, evaluate_drafter
from train.holdout import split_held_out
from train.precision import DTYPES

if TYPE_CHECKING:  # speculative decoding is imported only when --target asks for it
    from train.eval.speculative import PromptRendererFactory, VerifierFactory

log = logging.getLogger(__name__)


def select_eval_shards(
    all_ids: list[int],
    cache_cfg: CacheConfig,
    *,
    shards: list[int] | None,
    eval_shards: int | None,
    holdout_frac: float | None,
    cache: str,
) -> list[int]:
    """The held-out batch ids named by exactly one of --shards, --eval-shards, --holdout-frac (the last two
    split as training splits: whole samples)."""
    if sum(x is not None for x in (shards, eval_shards, holdout_frac)) != 1:
        raise ValueError("give exactly one of --shards, --eval-shards, --holdout-frac")
    if shards is not None:
        missing = sorted(set(shards) - set(all_ids))
        if missing:
            raise ValueError(
                f"--shards {missing} not in cache {cache} (it holds batch ids "
                f"{all_ids[0] if all_ids else '-'}..{all_ids[-1] if all_ids else '-'})"
            )
        return list(shards)
    if holdout_frac is not None and not 0 < holdout_frac <= 1:
        raise ValueError(f"--holdout-frac must be in (0, 1], got {holdout_frac}")
    n = eval_shards if eval_shards is not None else math.ceil(holdout_frac * len(all_ids))
    if not 1 <= n <= len(all_ids):
        raise ValueError(f"held-out shard count {n} outside [1, {len(all_ids)}] for cache {cache}")
    asked = f"--eval-shards {eval_shards}" if eval_shards is not None else f"--holdout-frac {holdout_frac}"
    return split_held_out(all_ids, n, cache_cfg, cache, asked=asked, keep_training=False)[1]


def check_fits(cfg: DrafterConfig, cache_config, drafter: str, cache: str) -> None:
    """Refuse a drafter whose taps, width or vocabulary differ from the cache's, naming both, or that
    would see more of a long sample than the cache's pieces hold."""
    from train.resolve import refuse_unseen_context

    problems = []
    if list(cfg.tap_layer_ids) != list(cache_config.tap_layer_ids):
        problems.append(f"taps: drafter {cfg.tap_layer_ids}, cache {cache_config.tap_layer_ids}")
    if (cfg.hidden_size, cfg.vocab_size) != (cache_config.target.hidden_size, cache_config.target.vocab_size):
        problems.append(
            f"hidden/vocab: drafter {cfg.hidden_size}/{cfg.vocab_size}, "
            f"cache {cache_config.target.hidden_size}/{cache_config.target.vocab_size}"
        )
    stored = cache_config.projection.checksum if cache_config.projection is not None else None
    if cfg.context_projection != stored:
        problems.append(
            f"context: drafter reads {_context(cfg)}, cache stores {_stored(cache_config)} (a projected cache is "
            "read by the checkpoints trained on it or on a cache extracted with --pca-from it; an export reads "
            "full taps)"
        )
    if problems:
        raise ValueError(
            f"drafter {drafter} does not fit cache {cache}: {'; '.join(problems)}; evaluate it on "
            "a cache extracted from its own target with the same taps"
        )
    refuse_unseen_context(cache_config, cfg, cache)


def _context(cfg: DrafterConfig) -> str:
    if cfg.context_width is None:
        return "the full taps"
    return f"{cfg.context_width} projected codes (projection {cfg.context_projection})"


def _stored(cache_config) -> str:
    p = cache_config.projection
    return "the full taps" if p is None else f"{p.rank} projected codes (projection {p.checksum})"


@dataclass
class LoadedDrafter:
    model: DFlashDrafter  # fp32 for a checkpoint, the stored dtype for an export
    config: DrafterConfig
    training_dtype: str  # the compute dtype it was trained in (the default evaluation dtype)
    source: str  # what was loaded, for the output
    trained_on: tuple[str, list[int]] | None = None  # (cache id, batch ids) of a checkpoint's training
    longest_response: int | None = None  # the longest reply in its training cache; None = not recorded
    chat_mode: dict[str, Any] | None = None  # the serving mode its training data were rendered in; None = unknown
    chat_modes: list[dict[str, Any]] | None = None  # training data in several modes: each known one


def _trained_on(state: dict[str, Any]) -> tuple[str, list[int]] | None:
    """The cache id and batch ids a checkpoint was trained on (train_state.json; older checkpoints: the
    first num_shards - eval_shards planned ids, as resolve_run split them)."""
    cache = state.get("cache_identity") or {}
    if not cache.get("cache_id"):
        return None
    ids = state.get("train_ids")
    if ids is None:
        eval_shards = (state.get("config_identity") or {}).get("eval_shards")
        if not isinstance(cache.get("num_shards"), int) or not isinstance(eval_shards, int):
            return None
        ids = list(range(cache["num_shards"] - eval_shards))
    return cache["cache_id"], list(ids)


def load_drafter(path: str | Path) -> LoadedDrafter:
    """An exported drafter (config.json + model.safetensors), a checkpoint step-NNNNNNNN/, or a run
    directory (its newest valid checkpoint), as `dflash-train export` takes them."""
    from train.checkpoint.export import CONFIG_FILE, drafter_from_checkpoint, load_exported_drafter
    from train.checkpoint.serving import TRAINING_KEY
    from train.checkpoint.store import MODEL_FILE, STATE_FILE, resolve_checkpoint

    path = Path(path)
    if (path / CONFIG_FILE).is_file() and not (path / STATE_FILE).is_file():
        model, cfg = load_exported_drafter(path, dtype=torch.float32)
        hf = read_json_object(path / CONFIG_FILE)
        dtype = hf.get("dtype", "bfloat16")  # our exports record the training default
        training = hf.get(TRAINING_KEY) if isinstance(hf.get(TRAINING_KEY), dict) else {}
        return LoadedDrafter(
            model,
            cfg,
            dtype if isinstance(dtype, str) and dtype in DTYPES else "bfloat16",
            f"export {path}",
            longest_response=_count(training.get("longest_response")),
            chat_mode=_mode(training.get("chat_mode")),
            chat_modes=_modes(training.get("chat_modes")),
        )
    # A named checkpoint is verified as export verifies it, the weights only: eval never reads the optimizer.
    ckpt = resolve_checkpoint(path, files=(MODEL_FILE,))
    if ckpt is None:
        raise ValueError(
            f"--drafter {path}: neither an exported drafter (config.json + model.safetensors), a "
            "checkpoint step-NNNNNNNN/ (train_state.json, model.safetensors) nor a run directory "
            "holding one"
        )
    model, cfg = drafter_from_checkpoint(ckpt)
    source = str(ckpt.path / STATE_FILE)
    dtype = read_field(ckpt.state["config_identity"], "compute_dtype", str, source, "bfloat16", "config_identity.")
    if dtype not in DTYPES:
        raise InputFileError(f"{source}: config_identity.compute_dtype {dtype!r:.40} is not one of {sorted(DTYPES)}")
    return LoadedDrafter(
        model,
        cfg,
        dtype,
        f"checkpoint {ckpt.path}",
        _trained_on(ckpt.state),
        longest_response=_count(ckpt.state.get("longest_response")),
        chat_mode=_mode(ckpt.state.get("chat_mode")),
        chat_modes=_modes(ckpt.state.get("chat_modes")),
    )


def _mode(value: Any) -> dict[str, Any] | None:
    """A recorded serving mode, or None where absent or not a mode record (older or edited files)."""
    return value if isinstance(value, dict) and "thinking" in value else None


def _modes(value: Any) -> list[dict[str, Any]] | None:
    """The recorded modes of training data in several, the unreadable ones left out; None where absent."""
    modes = [m for m in map(_mode, value) if m is not None] if isinstance(value, list) else []
    return modes or None


def _count(value: Any) -> int | None:
    """A recorded token count, or None where absent or not a positive integer (older or edited files)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass
class EvalOutput:
    """What `dflash-train eval` found: the walk on cached shards and/or real decoding with the target."""

    walk: EvalResult | None
    decoding: Any | None  # train.eval.speculative.DecodeReport
    trained_on: list[int] = field(default_factory=list)  # evaluated shards the drafter was trained on
    mode_warning: str | None = None  # the serving mode evaluated differs from the cache's or the training data's
    chat_mode: dict[str, Any] | None = None  # the serving mode evaluated (--thinking, --template-kwarg)

    def to_dict(self) -> dict[str, Any]:
        out = self.walk.to_dict() if self.walk is not None else {"batch_ids": []}
        if self.trained_on:
            out["trained_on_batch_ids"] = self.trained_on
        if self.decoding is not None:
            out["speculative_decoding"] = self.decoding.to_dict()
        if self.chat_mode is not None:
            out["chat_mode"] = self.chat_mode
        if self.mode_warning:
            out["chat_mode_warning"] = self.mode_warning
        return out

    def table(self) -> str:
        """What `eval` prints; a warning that the shards include trained-on ones is said here, once, above
        the figures it qualifies (and the loss is then not labelled held-out)."""
        parts = [self.walk.table(held_out=not self.trained_on)] if self.walk is not None else []
        if self.trained_on:
            parts.insert(0, _trained_on_warning(self.trained_on))
        if self.mode_warning:
            parts.insert(0, self.mode_warning)
        if self.decoding is not None:
            parts.append(self.decoding.table())
        return "\n\n".join(parts)


def _trained_on_warning(ids: list[int]) -> str:
    return (
        f"WARNING: the drafter was trained on shards {ids} of this cache: the figures below are NOT held-out "
        "(choose its held-out shards: --eval-shards as in training, or --shards)"
    )


def run_eval(
    cfg: EvalConfig,
    verifier_factory: VerifierFactory | None = None,
    prompt_renderer: PromptRendererFactory | None = None,
) -> EvalOutput:
    """Everything `dflash-train eval` does; raises ValueError naming flag and value.

    verifier_factory builds the target for --target (speculative.build_verifier), prompt_renderer renders
    conversation prompts with its chat template; the `dflash-train` console script passes them in, as
    train/ cannot import extract/'s model or renderer itself."""
    if cfg.cache is None:
        return _evaluate(cfg, verifier_factory, prompt_renderer)
    # Read from the shard selection to the last walk: a job rewriting the cache meanwhile is refused.
    with DirectoryLock(cfg.cache, "dflash-train eval", shared=True):
        return _evaluate(cfg, verifier_factory, prompt_renderer)


def _evaluate(
    cfg: EvalConfig, verifier_factory: VerifierFactory | None, prompt_renderer: PromptRendererFactory | None
) -> EvalOutput:
    from shards import load_target_head
    from shards.common.runtime import resolve_device
    from train.resolve import planned_batch_ids

    reader = ShardReader(cfg.cache) if cfg.cache is not None else None
    ids, trained_on = None, []
    if reader is not None:
        ids = select_eval_shards(  # the planned ids, split as training splits them
            planned_batch_ids(reader.config, cfg.cache),
            reader.config,
            shards=cfg.shards,
            eval_shards=cfg.eval_shards,
            holdout_frac=cfg.holdout_frac,
            cache=cfg.cache,
        )
        absent = sorted(set(ids) - set(reader.batch_ids()))
        if absent:
            raise ValueError(
                f"held-out shards {absent} of cache {cfg.cache} are missing (their files are not there); "
                "re-run dflash-extract to write them, or choose present ones with --shards"
            )
    loaded = load_drafter(cfg.drafter)
    cache_mode = recorded_mode(reader.config.chat_mode) if reader is not None else None
    # A cache of several modes (chat_modes): the evaluated mode is compared with each one present.
    cache_modes = [m for m in map(recorded_mode, reader.config.modes) if m] if reader is not None else []
    trained_mode = recorded_mode(loaded.chat_mode)
    trained_modes = [m for m in map(recorded_mode, loaded.chat_modes or [trained_mode]) if m]
    mode = evaluated_mode(cfg, trained_mode or cache_mode)
    mode_warnings = []
    if reader is not None:
        check_fits(loaded.config, reader.config, cfg.drafter, cfg.cache)
        mode_warnings.append(mode_mismatch(mode, cache_modes or None, f"cache {cfg.cache}"))
        if loaded.trained_on is not None and loaded.trained_on[0] == reader.config.cache_id():
            trained_on = sorted(set(ids) & set(loaded.trained_on[1]))
    device = resolve_device(cfg.device, 0)
    if device.type == "cuda":  # where flex attention compiles
        use_compile_cache(cfg.compile)
    dtype_name = loaded.training_dtype if cfg.dtype == "auto" else cfg.dtype
    dtype = DTYPES[dtype_name]
    log.info(
        "eval: %s in %s (%s) on %s",
        loaded.source,
        dtype_name,
        "the training compute dtype" if cfg.dtype == "auto" else "--dtype",
        device,
    )
    model = eval_copy(loaded.model.to(device), dtype)
    walk = decoding = None
    if reader is not None:
        head_t = load_target_head(cfg.cache)
        head = TargetHead(head_t["embed_tokens"].to(device, dtype), head_t["lm_head"].to(device, dtype))
        log.info("eval: decoding walk over %d %s shards %s", len(ids), "chosen" if trained_on else "held-out", ids)
        walk = evaluate_drafter(
            model,
            head,
            cfg.cache,
            ids,
            num_blocks=cfg.num_blocks,
            seed=cfg.seed,
            device=device,
            attention=choose_backend("auto", device),
            budgets=cfg.budgets,
            lanes=cfg.lanes,
            context_edges=cfg.context_buckets,
        )
    if cfg.target is not None:
        from train.eval.speculative import ChainProposer, PromptModes, build_verifier, decode_prompts, read_prompts

        if reader is None or trained_modes != cache_modes:  # one warning per set of modes
            mode_warnings.append(mode_mismatch(mode, trained_modes or None, f"the training data of {loaded.source}"))
        kwargs = [f"{key}={json.dumps(value)}" for key, value in mode["template_kwargs"].items()]
        render = prompt_renderer(cfg.target, mode["thinking"], kwargs) if prompt_renderer else None
        # User input checked before the target loads.
        modes = (
            PromptModes()
        )  # each prompt's: a row may state its own (chat_mode, enable_thinking, chat_template_kwargs)
        prompts = read_prompts(
            cfg.prompts, loaded.config.vocab_size, cfg.max_prompts, render=render, modes=modes, evaluated=mode
        )
        verifier = build_verifier(verifier_factory, cfg.target, loaded.config.tap_layer_ids, device, dtype)
        if verifier.lm_head_VH.shape != (loaded.config.vocab_size, loaded.config.hidden_size):
            raise ValueError(
                f"--target {cfg.target}: its LM head {tuple(verifier.lm_head_VH.shape)} does not fit "
                f"the drafter (vocab {loaded.config.vocab_size}, hidden {loaded.config.hidden_size})"
            )
        head = TargetHead(verifier.embed_tokens_VH.to(dtype), verifier.lm_head_VH.to(dtype))
        # The drafter sees hidden states rounded as the cache stores them (bf16 also stands in for fp8).
        log.info(
            "eval: speculative and plain decoding of %d prompts x %d tokens with %s at %s",
            len(prompts),
            cfg.max_new_tokens,
            cfg.target,
            f"temperature {cfg.sampling.temperature:g}" if not cfg.sampling.greedy else "temperature 0 (greedy)",
        )
        proposer = ChainProposer(model, head, context_dtype=torch.bfloat16)
        decoding = decode_prompts(
            proposer,
            verifier,
            prompts,
            cfg.max_new_tokens,
            sampling=cfg.sampling,
            seed=cfg.seed,
            context_edges=tuple(cfg.context_buckets),
            modes=modes,
            batch=cfg.decode_batch,
            stop_ids=verifier.stop_ids,
        )
        decoding.longest_trained_response = loaded.longest_response  # the table warns when decoding ran past it
    mode_warning = "\n".join(w for w in mode_warnings if w) or None
    return EvalOutput(walk, decoding, trained_on, mode_warning, mode)


def recorded_mode(value: Any) -> dict | None:
    """A mode record read from a file (cache.json, a checkpoint, an export), normalised; None = unknown."""
    if not isinstance(value, dict) or value.get("thinking") not in ("on", "off"):
        return None
    kwargs = value.get("template_kwargs")
    return chat_mode(value["thinking"], kwargs if isinstance(kwargs, dict) else {})


def evaluated_mode(cfg: EvalConfig, recorded: dict | None) -> dict:
    """The serving mode evaluated: the recorded one (the drafter's training data's, else --cache's; else
    the chat template's default, thinking on), with what --thinking and --template-kwarg give over it."""
    base = recorded or chat_mode("on", {})
    given = parse_template_kwargs(cfg.template_kwargs)
    return chat_mode(cfg.thinking or base["thinking"], {**base["template_kwargs"], **given})


def mode_mismatch(ours: dict, recorded: dict | list[dict] | None, rendered: str) -> str | None:
    """A warning (logged, and returned for the table) when the serving mode evaluated differs from a
    recorded one (or from every one of a list: a cache of several modes): that of the data `rendered`
    names (--cache, or a drafter's training data from its checkpoint or export); None when they agree or
    none is recorded."""
    present = [recorded] if isinstance(recorded, dict) else list(recorded or [])
    if not present or ours in present:
        return None
    modes = " | ".join(map(describe_mode, present))
    warning = (
        f"WARNING: evaluating in serving mode {describe_mode(ours)}, but {rendered} was "
        f"rendered in {'one of ' if len(present) > 1 else ''}{modes}: acceptance collapses when a drafter is served in another mode "
        "than its data; pass that mode's --thinking and --template-kwarg, or evaluate on a cache made in this one"
    )
    log.warning("%s", warning)
    return warning
