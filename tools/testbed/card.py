"""The proxy target's model card (README.md beside the weights), written from metrics.json.

metrics.json (tools/testbed/train_target.py) holds: corpus (file, sha256 of its rows and of the
file, chats and tokens per split), model (parameters, bytes, text config), training (steps, epochs,
seconds, tokens/s, device, kernels, why it stopped), heldout_loss and unigram_baseline (nats per
token, all tokens and reply tokens), heldout_curve (held-out losses during training), greedy_replies
and reference_continuations (repetitiveness, tools/testbed/target_eval.py), examples, settings,
command, provenance.
"""

from __future__ import annotations

from pathlib import Path

from shards.common.progress import format_duration
from tools.testbed.corpus import DJANGO_SDIST_SHA256
from tools.testbed.tokenizer import NUM_FREE_IDS

CARD_FILE = "README.md"


def write_card(out_dir: Path, metrics: dict) -> Path:
    path = Path(out_dir) / CARD_FILE
    path.write_text("\n".join(card_lines(metrics)) + "\n", encoding="utf-8")
    return path


def card_lines(m: dict) -> list[str]:
    corpus, model, training, cfg = m["corpus"], m["model"], m["training"], m["model"]["config"]
    loss, unigram = m["heldout_loss"], m["unigram_baseline"]
    g, ref = m["greedy_replies"], m["reference_continuations"]
    lines = [
        "# Proxy target: a Qwen3.5-style hybrid trained on Django 5.1.4",
        "",
        "A small stand-in for Qwen3.5-27B with trained weights, for acceptance measurements that random-weight",
        "targets cannot give (issue 27). Written by `tools/testbed/train_target.py`; every figure below is from",
        "metrics.json beside this card, measured on the weights as stored (bf16).",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | Qwen3.5 text decoder, {cfg['num_hidden_layers']} layers 3:1 GatedDeltaNet : gated attention, "
        f"hidden {cfg['hidden_size']}, MLP {cfg['intermediate_size']}, vocab {cfg['vocab_size']}, untied embeddings |",
        f"| GatedDeltaNet | {cfg['linear_num_key_heads']} q/k heads, {cfg['linear_num_value_heads']} v heads, "
        f"head dim {cfg['linear_key_head_dim']}, conv {cfg['linear_conv_kernel_dim']} |",
        f"| attention | {cfg['num_attention_heads']} q heads, {cfg['num_key_value_heads']} kv heads, head dim "
        f"{cfg['head_dim']}, partial RoPE {cfg['partial_rotary_factor']}, output gate |",
        f"| parameters | {model['parameters']:,} ({model['safetensors_bytes'] / 2**20:.1f} MiB model.safetensors, bf16; A_log fp32) |",
        "| layout | the 27B release's: multimodal config.json (text_config), `model.language_model.*` names |",
        f"| tokenizer | byte-level BPE, ids 0-{cfg['vocab_size'] - NUM_FREE_IDS - 1} (special and markup tokens last); ids "
        f"{cfg['vocab_size'] - NUM_FREE_IDS}-{cfg['vocab_size'] - 1} unused (room for a drafter's MASK id); Qwen3.5-shaped chat template |",
        "| serve with | thinking off (`--thinking off`): trained on replies after an empty think block |",
        f"| corpus | `{Path(corpus['file']).name}`: rows sha256 `{corpus['rows_sha256']}`, file sha256 `{corpus['file_sha256']}` |",
        f"| corpus source | PyPI sdist Django-5.1.4.tar.gz, sha256 `{DJANGO_SDIST_SHA256}` |",
        f"| split | {corpus['train_chats']} train chats ({corpus['train_tokens']:,} tokens), {corpus['heldout_chats']} "
        f"held-out chats ({corpus['heldout_tokens']:,} tokens), by file; {corpus['chats_cut_to_max_seq_len']} cut to the maximum length |",
        f"| training | {training['steps']} steps ({training['epochs']:.1f} epochs, stopped by {training['stopped_by']}), "
        f"{training['tokens']:,} tokens in {format_duration(training['seconds'])}, {training['tokens_per_s']:,.0f} tokens/s "
        f"on {training['device']} (gated delta rule: {training['kernels']['gated_delta_rule']}) |",
        "",
        "Command:",
        "",
        "```bash",
        m["command"],
        "```",
        "",
        "## Held-out loss",
        "",
        "Mean next-token cross-entropy in nats on the held-out split (files the target never saw), against the",
        "train split's unigram distribution (add-one smoothed) on the same tokens:",
        "",
        "| tokens | model | unigram baseline |",
        "|---|---|---|",
        f"| all | {loss['all']:.4f} | {unigram['all']:.4f} |",
        f"| reply (assistant) | {loss['assistant']:.4f} | {unigram['assistant']:.4f} |",
        "",
        "During training:",
        "",
        "| step | epoch | all tokens | reply tokens |",
        "|---|---|---|---|",
        *(f"| {p['step']} | {p['epoch']:.1f} | {p['all']:.4f} | {p['assistant']:.4f} |" for p in m["heldout_curve"]),
        "",
        "## Repetitiveness of greedy replies",
        "",
        f"Greedy replies to {g['prompts']} held-out prompts (at most {g['max_new_tokens']} tokens), against the corpus'",
        "own continuations of the same prompts cut to the same length. Repeated 4-grams: share of a reply's 4-grams",
        "already seen earlier in it (a loop tends to 1); distinct-n: distinct n-grams / n-grams over all replies.",
        "",
        "| | repeated 4-grams | distinct-1 | distinct-2 | mean tokens | ended by <\\|im_end\\|> |",
        "|---|---|---|---|---|---|",
        f"| greedy replies | {g['repeated_4gram_share']:.3f} | {g['distinct_1']:.3f} | {g['distinct_2']:.3f} | "
        f"{g['mean_tokens']:.0f} | {g['finished_share']:.2f} |",
        f"| corpus continuations | {ref['repeated_4gram_share']:.3f} | {ref['distinct_1']:.3f} | {ref['distinct_2']:.3f} | "
        f"{ref['mean_tokens']:.0f} | |",
        "",
        "## Examples (held-out prompts, greedy)",
    ]
    for ex in m["examples"]:
        lines += ["", "Prompt:", "", _quoted(ex["prompt"]), "", "Reply:", "", _quoted(ex["reply"])]
    return lines


def _quoted(text: str) -> str:
    """Text shown verbatim: an indented block (fences inside the text stay inert)."""
    return "\n".join("    " + line for line in text.splitlines()) or "    (empty)"
