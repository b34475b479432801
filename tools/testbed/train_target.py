"""Train the proxy target (tools/testbed/proxy_config.py) on the Django corpus with HF transformers'
Qwen3_5ForCausalLM, and write it as a Qwen3.5 release: config.json, model.safetensors, tokenizer files.

    python -m tools.testbed.train_target --out OUT_DIR            # the full run (one H200: minutes)
    python -m tools.testbed.train_target --out OUT_DIR --smoke    # a few CPU steps on a few chats (CI)

Inputs: the corpus file (checked against its pinned sha256) and the committed tokenizer files
(copied into OUT_DIR first; the run trains no tokenizer and downloads nothing).
Loop (tools/testbed/train_loop.py): AdamW (no decay on norms and decay parameters), linear warmup
then cosine to min_lr_ratio over steps or --time-limit, whichever ends first, bf16 autocast on CUDA
(fp32 master weights), gradient clipping, a fixed seed; batches of whole chats
(tools/testbed/target_data.py). Settings: tools/testbed/train_config.py. Loss on every token by default (--loss-on all): the prompts are real corpus text too, and with ~2M
train tokens dropping them would cost a third of the training signal; the reply-token loss is
reported beside it, as it is what a drafter learns to predict.
On CUDA the GatedDeltaNet runs on fla-core's kernels when they import (HF falls back to its torch
loop without them, silently): a missing fla-core is refused unless --allow-slow-kernels, and so is
an fla-core whose gated-delta backward refuses this Triton on Hopper (fla-core 0.6.0 raises only at
the first backward, after the data is prepared). At this model's size the torch loop is not slow:
223K tokens/s on the H200, the run that trained the committed weights.

Outputs in OUT_DIR (refused unless empty or new): the checkpoint, metrics.json (tools/testbed/card.py
says what is in it), README.md (the model card), train_log.jsonl (one record per log line). The
figures are those of the weights as stored (rounded to bf16 before the final evaluation).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import logging
import math
import shutil
import time
from pathlib import Path

import click
import numpy as np
import torch

from shards.common.cli_options import (
    CONTEXT_SETTINGS,
    build_config,
    config_options,
    flag_name,
    shown,
    to_options,
)
from shards.common.errors import UserError, user_errors
from shards.common.progress import format_duration
from shards.common.provenance import provenance
from tools.fixtures.tiny_target import write_checkpoint
from tools.fixtures.tiny_tokenizer import TOKENIZER_FILES
from tools.testbed.card import write_card
from tools.testbed.corpus import CORPUS_SHA256, load_corpus, sha256_file
from tools.testbed.proxy_config import NAMING, proxy_config_dict
from tools.testbed.target_data import encode_chats
from tools.testbed.target_eval import greedy_replies, heldout_loss, repetitiveness, unigram_baseline
from tools.testbed.train_config import SMOKE, TrainTargetConfig
from tools.testbed.train_loop import Trainer

logger = logging.getLogger(__name__)

LOG_FILE = "train_log.jsonl"
METRICS_FILE = "metrics.json"
NUM_EXAMPLES = 3  # greedy replies quoted in the card


def resolve_device(cfg: TrainTargetConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible; use --device cpu (slow) or auto")
    return torch.device(cfg.device)


def announce_kernels(device: torch.device, allow_slow: bool) -> dict[str, str]:
    """Which GatedDeltaNet and conv implementations HF's qwen3_5 will pick: it binds fla-core's and
    causal-conv1d's when their modules import, else its torch code, silently. The same imports are
    tried here; a torch GatedDeltaNet on CUDA is refused unless allowed."""
    fla, conv = _imports("fla.ops.gated_delta_rule"), _imports("causal_conv1d")
    kernels = {
        "gated_delta_rule": f"fla-core ({_version('fla-core')})" if fla else "torch (HF's reference loop)",
        "causal_conv1d": f"causal-conv1d ({_version('causal-conv1d')})" if conv else "torch",
    }
    for op, backend in kernels.items():
        logger.info("kernel %s: %s", op, backend)
    if device.type == "cuda" and fla and _fla_backward_refused():
        import triton

        raise UserError(
            f"fla-core {_version('fla-core')} refuses its gated-delta backward with Triton {triton.__version__} on "
            "Hopper (wrong gradients, fla issue #640): leave fla-core off PYTHONPATH and pass --allow-slow-kernels "
            "(HF's torch loop; fast enough at this size), or install Triton >= 3.7.1"
        )
    if device.type == "cuda" and not fla and not allow_slow:
        raise UserError(
            "fla-core does not import: HF's qwen3_5 would run its GatedDeltaNet in a slow torch loop on the GPU; "
            "put fla-core on PYTHONPATH (../shared/device/stage-wheels) or pass --allow-slow-kernels"
        )
    return kernels


def _fla_backward_refused() -> bool:
    """fla-core's own condition for refusing chunk_bwd_dqkwg with a gate (fla/ops/common/chunk_o.py)."""
    flags = importlib.import_module("fla.utils")
    above_3_7_1 = getattr(flags, "TRITON_ABOVE_3_7_1", True)  # versions without the flag do not refuse
    return bool(getattr(flags, "IS_NVIDIA_HOPPER", False) and getattr(flags, "TRITON_ABOVE_3_4_0", False)) and (
        not above_3_7_1
    )


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or a kernel package that fails on this machine: HF falls back alike
        return False
    return True


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "version unknown"


def check_out_dir(cfg: TrainTargetConfig) -> None:
    """Refuse, before any work, an output directory holding anything, or missing tokenizer files."""
    out = Path(cfg.out_dir)
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise UserError(f"--out {out}: exists and is not an empty directory; the run writes into a new one only")
    source = Path(cfg.tokenizer_from)
    missing = [name for name in TOKENIZER_FILES if not (source / name).is_file()]
    if missing:
        raise UserError(
            f"--tokenizer-from {source}: lacks {', '.join(missing)}; write them with python -m tools.testbed.tokenizer"
        )


def prepare_out_dir(cfg: TrainTargetConfig) -> Path:
    """The output directory (checked by check_out_dir) made, with a copy of the tokenizer files."""
    out, source = Path(cfg.out_dir), Path(cfg.tokenizer_from)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, out / name)
    return out


def build_model(text_config: dict, seed: int, device: torch.device):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_config)).to(device)


def local_state_dict(model) -> dict[str, torch.Tensor]:
    """HF Qwen3_5ForCausalLM's parameters under our names (extract/target: the text model's names
    without its `model.` prefix, lm_head.weight as it is)."""
    out = {}
    for name, value in model.state_dict().items():
        local = name if name == "lm_head.weight" else name.removeprefix("model.")
        out[local] = value.detach().float().cpu()
    return out


def round_to_storage(model) -> None:
    """Round the weights to what the checkpoint stores (bf16; A_log stays fp32) so the final figures
    are those of the shipped weights."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("A_log"):
                p.copy_(p.to(torch.bfloat16).float())


def evenly_spaced(n: int, count: int) -> list[int]:
    """`count` indices spread evenly over range(n) (all of them when count >= n)."""
    if count >= n:
        return list(range(n))
    return [int(i * n / count) for i in range(count)]


def mixed_kinds(kinds: list[str], count: int) -> list[int]:
    """`count` positions of `kinds`, taking each kind in turn (code, docs, code, ...), first ones first."""
    queues = {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in sorted(set(kinds))}
    out: list[int] = []
    while len(out) < min(count, len(kinds)):
        for queue in queues.values():
            if queue and len(out) < count:
                out.append(queue.pop(0))
    return out


def train_target(cfg: TrainTargetConfig) -> dict:
    """The whole run (module docstring); returns metrics.json's content."""
    device = resolve_device(cfg)
    kernels = announce_kernels(device, cfg.allow_slow_kernels)
    check_out_dir(cfg)
    chats = load_corpus(cfg.corpus)
    out = prepare_out_dir(cfg)
    from extract.chats.template import load_tokenizer

    tokenizer = load_tokenizer(out)
    eos_id, pad_id = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text_config = proxy_config_dict(eos_token_id=eos_id, pad_token_id=pad_id)

    train_chats = [c for c in chats if c.split == "train"][: cfg.max_train_chats]
    heldout_chats = [c for c in chats if c.split == "heldout"][: cfg.max_heldout_chats]
    t0 = time.perf_counter()
    train = encode_chats(train_chats, out, cfg.max_seq_len)
    heldout = encode_chats(heldout_chats, out, cfg.max_seq_len)
    logger.info(
        "corpus: %d train chats (%d tokens), %d held-out chats (%d tokens), %d cut to %d tokens; rendered in %.1f s",
        len(train_chats), train.num_tokens, len(heldout_chats), heldout.num_tokens,
        train.num_truncated + heldout.num_truncated, cfg.max_seq_len, time.perf_counter() - t0,
    )  # fmt: skip

    model = build_model(text_config, cfg.seed, device)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("model: %d parameters on %s; training for %s", num_params, device, format_duration(cfg.time_limit))
    trainer = Trainer(cfg, model, train, heldout, pad_id, device, out / LOG_FILE)
    logger.info("plan: %d steps (%.1f epochs of %d steps), at most %s", trainer.total_steps,
                trainer.total_steps / trainer.steps_per_epoch, trainer.steps_per_epoch, format_duration(cfg.time_limit))  # fmt: skip
    training = trainer.run()

    round_to_storage(model)
    final = heldout_loss(model, heldout, cfg.batch_tokens, pad_id, device)
    trainer.curve.append({"step": training["steps"], "epoch": training["epochs"], **final})
    logger.info("final held-out loss %.4f (all tokens), %.4f (reply tokens)", final["all"], final["assistant"])
    unigram = unigram_baseline(train, heldout, text_config["vocab_size"])

    picks = evenly_spaced(len(heldout_chats), cfg.num_reply_prompts)
    replies = _greedy(model, tokenizer, out, [heldout_chats[i] for i in picks], cfg, {eos_id, pad_id}, pad_id, device)
    reference = [
        tokenizer(heldout_chats[i].continuation, add_special_tokens=False)["input_ids"][: cfg.max_new_tokens]
        for i in picks
    ]

    write_checkpoint(out, text_config, local_state_dict(model), naming=NAMING, dtype=torch.bfloat16)
    metrics = {
        "corpus": {
            "file": str(cfg.corpus),
            "rows_sha256": CORPUS_SHA256,
            "file_sha256": sha256_file(cfg.corpus),
            "train_chats": len(train_chats),
            "heldout_chats": len(heldout_chats),
            "train_tokens": train.num_tokens,
            "heldout_tokens": heldout.num_tokens,
            "chats_cut_to_max_seq_len": train.num_truncated + heldout.num_truncated,
        },
        "model": {
            "parameters": num_params,
            "safetensors_bytes": (out / "model.safetensors").stat().st_size,
            "config": text_config,
        },
        "training": {**training, "device": str(device), "kernels": kernels},
        "heldout_loss": final,
        "unigram_baseline": unigram,
        "heldout_curve": trainer.curve,
        "greedy_replies": {
            "prompts": len(replies),
            "max_new_tokens": cfg.max_new_tokens,
            "finished_share": float(np.mean([finished for _, finished in replies])) if replies else math.nan,
            **repetitiveness([ids for ids, _ in replies]),
        },
        "reference_continuations": repetitiveness(reference),
        "examples": [
            {
                "prompt": heldout_chats[picks[k]].prompt,
                "reply": tokenizer.decode(replies[k][0]),
                "finished": replies[k][1],
            }
            for k in mixed_kinds([heldout_chats[i].kind for i in picks], NUM_EXAMPLES)
        ],
        "settings": dataclasses.asdict(cfg),
        "command": command_line(cfg),
        "provenance": provenance(),
    }
    (out / METRICS_FILE).write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    write_card(out, metrics)
    return metrics


def _greedy(model, tokenizer, target_dir: Path, chats, cfg, stop_ids, pad_id, device):
    from extract.chats.template import ChatRenderer

    renderer = ChatRenderer(target_dir, thinking=False)
    prompts = [
        np.asarray(tokenizer(renderer.render([{"role": "user", "content": c.prompt}], add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"])
        for c in chats
    ]  # fmt: skip
    return greedy_replies(model, prompts, cfg.max_new_tokens, stop_ids, pad_id, device)


def command_line(cfg: TrainTargetConfig) -> str:
    """The command that repeats this run: its settings that differ from the defaults, as flags."""
    defaults = TrainTargetConfig(out_dir=cfg.out_dir)
    flags = [
        f"{flag_name(TrainTargetConfig, name)} {shown(value)}"
        if not isinstance(value, bool)
        else flag_name(TrainTargetConfig, name)
        for name, value in to_options(cfg).items()
        if name == "out_dir" or value != getattr(defaults, name)
    ]
    return " ".join(["python -m tools.testbed.train_target", *flags])


def summary_lines(metrics: dict) -> list[str]:
    """The figures the run prints at its end."""
    g, r = metrics["greedy_replies"], metrics["reference_continuations"]
    return [
        f"held-out loss (nats/token): {metrics['heldout_loss']['all']:.4f} all tokens, "
        f"{metrics['heldout_loss']['assistant']:.4f} reply tokens",
        f"unigram baseline:           {metrics['unigram_baseline']['all']:.4f} all tokens, "
        f"{metrics['unigram_baseline']['assistant']:.4f} reply tokens",
        f"greedy replies ({g['prompts']} held-out prompts): repeated 4-grams {g['repeated_4gram_share']:.3f}, "
        f"distinct-2 {g['distinct_2']:.3f}, finished {g['finished_share']:.2f}, mean {g['mean_tokens']:.0f} tokens",
        f"corpus continuations:       repeated 4-grams {r['repeated_4gram_share']:.3f}, distinct-2 {r['distinct_2']:.3f}",
        f"trained {metrics['training']['steps']} steps ({metrics['training']['epochs']:.1f} epochs) in "
        f"{format_duration(metrics['training']['seconds'])} at {metrics['training']['tokens_per_s']:.0f} tokens/s",
    ]


@click.command(context_settings=CONTEXT_SETTINGS)
@config_options(TrainTargetConfig)
@click.option("--smoke", is_flag=True, help="CI mode: a few CPU steps on a few chats (options left at their default).")
@click.pass_context
@user_errors(ValueError, OSError)
def main(ctx: click.Context, smoke: bool, **options) -> None:
    """Train the proxy target and write it with its card and metrics."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if smoke:
        for name, value in SMOKE.items():
            if ctx.get_parameter_source(name) is click.core.ParameterSource.DEFAULT:
                options[name] = value
    metrics = train_target(build_config(TrainTargetConfig, options))
    for line in summary_lines(metrics):
        click.echo(line)
    click.echo(f"wrote {metrics['settings']['out_dir']}")


if __name__ == "__main__":
    main()
