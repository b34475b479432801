"""The proxy target's training script (tools/testbed/train_target.py, train_loop.py) in --smoke mode, end to end:
a checkpoint in the 27B release's layout that dflash-extract reads (the HF parity tests are in
tests/extract/target/test_target_model.py), figures that are those of the stored weights, the
schedule, and the refusals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from extract.chats.conversations import conversation_from_row
from extract.chats.template import ChatRenderer
from extract.cli import main as extract_cli
from shards import ShardReader, decode_hidden
from shards.common.errors import UserError
from tools.testbed.target_data import encode_chats
from tools.testbed.target_eval import heldout_loss
from tools.testbed.train_config import SMOKE, TrainTargetConfig
from tools.testbed.train_loop import Trainer, lr_at
from tools.testbed.train_target import announce_kernels, main

transformers = pytest.importorskip("transformers")
SMOKE_FILES = {"README.md", "metrics.json", "train_log.jsonl", "config.json", "model.safetensors"}


def test_smoke_run_writes_a_release_shaped_checkpoint(proxy_smoke):
    assert SMOKE_FILES | {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} == {
        p.name for p in proxy_smoke.iterdir()
    }
    config = json.loads((proxy_smoke / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "text_config" in config
    text = config["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]
    assert not text["tie_word_embeddings"]
    with safe_open(str(proxy_smoke / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        dtypes = {name: f.get_slice(name).get_dtype() for name in names}
    assert all(n.startswith("model.language_model.") or n == "lm_head.weight" for n in names)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in names
    assert {d for n, d in dtypes.items() if not n.endswith("A_log")} == {"BF16"}
    assert {d for n, d in dtypes.items() if n.endswith("A_log")} == {"F32"}
    assert (proxy_smoke / "model.safetensors").stat().st_size <= 16 * 2**20  # one file a GPU run can hand back


def test_smoke_figures_are_those_of_the_stored_weights(proxy_smoke, corpus):
    metrics = json.loads((proxy_smoke / "metrics.json").read_text())
    heldout_chats = [c for c in corpus if c.split == "heldout"][: SMOKE["max_heldout_chats"]]
    heldout = encode_chats(heldout_chats, proxy_smoke, SMOKE["max_seq_len"])
    assert metrics["corpus"]["heldout_tokens"] == heldout.num_tokens
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(proxy_smoke, dtype=torch.float32).eval()
    pad = hf.config.pad_token_id
    reloaded = heldout_loss(hf, heldout, SMOKE["batch_tokens"], pad, torch.device("cpu"))
    for key in ("all", "assistant"):
        assert reloaded[key] == pytest.approx(metrics["heldout_loss"][key], rel=1e-5), key
    assert metrics["heldout_curve"][-1]["all"] == metrics["heldout_loss"]["all"]
    log = [json.loads(line) for line in (proxy_smoke / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and log[-1]["loss"] < log[0]["loss"]
    replies = metrics["greedy_replies"]
    assert replies["prompts"] == SMOKE["num_reply_prompts"] and 0 <= replies["repeated_4gram_share"] <= 1
    assert len(metrics["examples"]) == SMOKE["num_reply_prompts"]
    card = (proxy_smoke / "README.md").read_text()
    assert metrics["corpus"]["rows_sha256"] in card and f"{metrics['heldout_loss']['all']:.4f}" in card
    assert metrics["command"].startswith("python -m tools.testbed.train_target --out ")


def test_dflash_extract_reads_the_smoke_checkpoint(proxy_smoke, corpus, tmp_path):
    chats = [c for c in corpus if c.split == "heldout"][:3]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c.to_row()) + "\n" for c in chats))
    out = tmp_path / "cache"
    args = ["--target", str(proxy_smoke), "--data", str(data), "--out", str(out), "--thinking", "off", "--taps", "1,5",
            "--token-budget", "4096", "--max-seqs", "4", "--dtype", "float32", "--mask-token-id", "4088"]  # fmt: skip
    result = CliRunner().invoke(extract_cli, args)
    assert result.exit_code == 0, result.output
    renderer = ChatRenderer(proxy_smoke, thinking=False)
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(proxy_smoke, dtype=torch.float32).eval()
    reader = ShardReader(out)
    tensors, info = reader.read(reader.batch_ids()[0])
    hidden = decode_hidden(tensors["hidden"], tensors.get("hidden_scale")).float()
    by_id = {c.id: c for c in chats}
    assert sorted(e.sample_id for e in info.samples) == sorted(by_id)
    for entry in info.samples:
        ids, mask, _ = renderer.encode(conversation_from_row(by_id[entry.sample_id].to_row(), "x", 0))
        span = slice(entry.offset, entry.offset + len(ids))
        assert tensors["input_ids"][span].tolist() == ids.tolist()
        assert tensors["loss_mask"][span].tolist() == mask.tolist()
        with torch.no_grad():
            ref = hf(input_ids=torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True).hidden_states
        for j, layer in enumerate((1, 5)):
            want = ref[layer + 1][0]
            rel = ((hidden[span, j] - want).norm() / want.norm()).item()
            assert rel < 0.006, (entry.sample_id, layer, rel)  # stored in bf16


def test_schedule_warms_up_then_anneals_to_its_floor():
    cfg = TrainTargetConfig(out_dir="x", lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(cfg, 0, 0.0) == pytest.approx(1e-4)
    assert lr_at(cfg, 9, 0.0) == pytest.approx(1e-3)
    assert lr_at(cfg, 50, 0.5) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr_at(cfg, 99, 1.0) == pytest.approx(1e-4)
    assert lr_at(cfg, 99, 3.0) == pytest.approx(1e-4)


def test_time_limit_ends_the_run_and_the_schedule(tmp_path):
    from tools.fixtures.tiny_target import tiny_config_dict
    from tools.testbed.target_data import Samples

    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**tiny_config_dict(num_hidden_layers=4)))
    rng = np.random.default_rng(0)
    samples = Samples([rng.integers(1, 500, size=40) for _ in range(64)], [np.ones(40, np.uint8)] * 64, 0)
    cfg = TrainTargetConfig(
        out_dir=str(tmp_path), max_steps=50, time_limit=1e-6, batch_tokens=160, max_seq_len=160, log_every=5
    )
    training = Trainer(cfg, model, samples, samples, 0, torch.device("cpu"), tmp_path / "log.jsonl").run()
    assert training["steps"] == 1 and training["planned_steps"] == 50 and training["stopped_by"] == "time"
    record = json.loads((tmp_path / "log.jsonl").read_text())
    assert record["step"] == 1 and math.isfinite(record["loss"])


def test_refusals_before_any_work(tmp_path, monkeypatch):
    import tools.testbed.train_target

    def started(*a, **kw):
        raise AssertionError("work started: the refusal must come before any work")

    monkeypatch.setattr(tools.testbed.train_target, "load_corpus", started)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, ["--out", str(taken), "--smoke"])
    assert result.exit_code == 1 and f"--out {taken}: exists and is not an empty directory" in result.output
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    result = CliRunner().invoke(
        main, ["--out", str(tmp_path / "new"), "--max-seq-len", "4096", "--batch-tokens", "2048"]
    )
    assert result.exit_code == 2 and "--max-seq-len 4096: must be at most --batch-tokens 2048" in result.output
    with pytest.raises(UserError, match="fla-core does not import"):
        announce_kernels(torch.device("cuda"), allow_slow=False)
    assert announce_kernels(torch.device("cuda"), allow_slow=True)["gated_delta_rule"].startswith("torch")


def test_an_fla_whose_gated_backward_refuses_this_triton_is_refused_before_any_work(monkeypatch):
    """fla-core 0.6.0 raises only at the first backward on Hopper with Triton in [3.4, 3.7.1): say so first."""
    import sys
    import types

    import tools.testbed.train_target as train_target

    monkeypatch.setattr(train_target, "_imports", lambda module: True)
    flags = types.SimpleNamespace(IS_NVIDIA_HOPPER=True, TRITON_ABOVE_3_4_0=True, TRITON_ABOVE_3_7_1=False)
    monkeypatch.setitem(sys.modules, "fla.utils", flags)
    with pytest.raises(UserError, match="refuses its gated-delta backward.*--allow-slow-kernels"):
        announce_kernels(torch.device("cuda"), allow_slow=True)
    flags.TRITON_ABOVE_3_7_1 = True
    assert announce_kernels(torch.device("cuda"), allow_slow=False)["gated_delta_rule"].startswith("fla-core")
