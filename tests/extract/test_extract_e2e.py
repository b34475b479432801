"""dflash-extract end to end on the tiny target: cache contents, resume after SIGKILL, ranks, refusals."""

import json
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from extract.cache_dir import CacheMismatchError
from extract.cli import main as extract_cli
from extract.dataset.index import write_jsonl, write_parquet
from extract.runner import run_extract
from extract.target.model import TargetModel
from extract.writer import NonFiniteHiddenError
from shards import ShardReader, decode_hidden, read_manifest
from shards.common.cli_options import to_options
from shards.inspect import verify_cache
from tests.helpers.extract import all_tensors, cli_args, extract_cfg, make_samples
from tests.helpers.process import REPO, torchrun_command
from tools.fixtures.tiny_target import write_random_checkpoint


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_cache_equals_direct_forward_of_each_sample(target, data, tmp_path, storage):
    out = tmp_path / "cache"
    summary = run_extract(extract_cfg(target, data, out, storage_dtype=storage, target_topk=3))
    assert summary.written == summary.num_batches > 1
    assert verify_cache(out).ok
    reader = ShardReader(out)
    taps = reader.config.tap_layer_ids
    model = TargetModel.from_pretrained(target, "cpu", dtype=torch.float32, with_head=True)
    samples = {s.sample_id: s for s in make_samples()}
    seen = set()
    for b in reader.batch_ids():
        tensors, info = reader.read(b)
        hidden = decode_hidden(tensors["hidden"], tensors.get("hidden_scale")).float()
        for entry in info.samples:
            s = samples[entry.sample_id]
            seen.add(entry.sample_id)
            n = len(s)
            ids = torch.from_numpy(s.input_ids.astype(np.int64))
            ref, top_ids, top_lp = model.topk_next_tokens(
                ids, torch.arange(n), torch.tensor([0, n], dtype=torch.int32), taps, 3
            )
            got = hidden[entry.offset : entry.offset + n]
            rel = ((got - ref.float()).norm() / ref.float().norm()).item()
            # Stored in bf16 (2^-8 relative rounding) or fp8 e4m3 (per-row scaled, ~2-3%).
            assert rel < (0.006 if storage == "bf16" else 0.04), (entry.sample_id, rel)
            span = slice(entry.offset, entry.offset + n)
            assert torch.equal(tensors["input_ids"][span], torch.from_numpy(s.input_ids))
            assert torch.equal(tensors["loss_mask"][span], torch.from_numpy(s.loss_mask))
            assert torch.equal(tensors["position_ids"][span], torch.arange(n, dtype=torch.int32))
            assert torch.equal(tensors["target_topk_ids"][span], top_ids)
            torch.testing.assert_close(tensors["target_topk_logprobs"][span].float(), top_lp, atol=0.05, rtol=0.01)
        assert torch.count_nonzero(hidden[info.num_tokens :]) == 0
    assert seen == set(samples)
    manifest = read_manifest(out)
    assert sorted(manifest.column("sample_id").to_pylist()) == sorted(samples)


@pytest.mark.slow
def test_sigkill_then_resume_gives_identical_cache(target, data, tmp_path):
    reference = tmp_path / "reference"
    run_extract(extract_cfg(target, data, reference))
    out = tmp_path / "cache"
    kills = 0
    for seed in (3, 5):
        # Kill the run inside the Nth shard write (mid-file), N differing per seed.
        die_after = 1 + seed % 3
        script = textwrap.dedent(f"""
            import os, signal, sys
            sys.path.insert(0, {REPO!r})
            import shards.writer as w
            from extract.config import ExtractConfig
            from extract.runner import run_extract
            from shards.common.cli_options import from_options
            count = [0]
            real = w.write_container
            def dying(f, tensors, meta):
                count[0] += 1
                if count[0] > {die_after}:
                    f.write(b"partial")
                    os.kill(os.getpid(), signal.SIGKILL)
                real(f, tensors, meta)
            w.write_container = dying
            import json
            run_extract(from_options(ExtractConfig, json.loads({json.dumps(to_options(extract_cfg(target, data, out)))!r})))
        """)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
        if proc.returncode == -signal.SIGKILL:
            kills += 1
        else:
            assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert kills >= 1
    assert list((out / "shards").glob(".tmp-*")) or len(ShardReader(out).batch_ids()) < len(
        ShardReader(reference).batch_ids()
    )
    summary = run_extract(extract_cfg(target, data, out))
    assert summary.resumed >= 1
    assert not list((out / "shards").glob(".tmp-*"))
    got, want = all_tensors(out), all_tensors(reference)
    assert got.keys() == want.keys()
    for b in want:
        for name in want[b]:
            assert torch.equal(got[b][name].view(torch.uint8), want[b][name].view(torch.uint8)), (b, name)
    assert read_manifest(out).equals(read_manifest(reference))


@pytest.mark.slow
def test_two_ranks_cover_the_plan_disjointly(target, data, tmp_path):
    out = tmp_path / "cache"
    cmd = torchrun_command("extract.cli", *cli_args(target, data, out, "--device", "cpu", "--progress-interval", "0"))
    proc = subprocess.run(cmd, capture_output=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    logs = {p.name: [json.loads(line) for line in p.read_text().splitlines()] for p in (out / "logs").glob("*.jsonl")}
    assert set(logs) == {"extract-rank0.jsonl", "extract-rank1.jsonl"}
    assert verify_cache(out).ok
    # One summary, the job's: every rank's shards and tokens (the cache's totals), not one line per rank.
    stdout = proc.stdout.decode()
    shards, tokens = (
        len(ShardReader(out).batch_ids()),
        sum(ShardReader(out).info(b).num_tokens for b in ShardReader(out).batch_ids()),
    )
    assert stdout.count("done in") == 1, stdout
    assert f"(all 2 ranks): {shards} shards written" in stdout and f"; {tokens:,} tokens in" in stdout, stdout
    single = tmp_path / "single"
    run_extract(extract_cfg(target, data, single))
    assert read_manifest(out).equals(read_manifest(single))
    got, want = all_tensors(out), all_tensors(single)
    for b in want:
        assert torch.equal(got[b]["hidden"].view(torch.uint8), want[b]["hidden"].view(torch.uint8)), b


def test_resume_with_other_settings_is_refused(target, data, tmp_path):
    out = tmp_path / "cache"
    run_extract(extract_cfg(target, data, out))
    with pytest.raises(CacheMismatchError, match="storage_dtype: cache has 'bf16', this run has 'fp8'"):
        run_extract(extract_cfg(target, data, out, storage_dtype="fp8"))
    with pytest.raises(CacheMismatchError, match="tap_layer_ids"):
        run_extract(extract_cfg(target, data, out, tap_layer_ids=[1, 3]))
    other = tmp_path / "other.jsonl"
    write_jsonl(other, make_samples(seed=9))
    with pytest.raises(CacheMismatchError, match="dataset.fingerprint"):
        run_extract(extract_cfg(target, other, out))
    result = CliRunner().invoke(extract_cli, cli_args(target, other, out))
    assert result.exit_code != 0 and "--overwrite" in result.output
    summary = run_extract(extract_cfg(target, other, out, overwrite=True))
    assert summary.resumed == 0 and verify_cache(out).ok


def test_bad_rows_are_refused_before_the_model_loads(target, tmp_path, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    rows = [{"id": "ok", "input_ids": [1, 2, 3]}, {"id": "oob", "input_ids": [1, 999999], "loss_mask": [1, 1]}]
    bad.write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    def no_model(*a, **k):
        raise AssertionError("the model must not load for a bad dataset")

    monkeypatch.setattr(TargetModel, "from_pretrained", no_model)
    with pytest.raises(ValueError) as e:
        run_extract(extract_cfg(target, bad, tmp_path / "cache"))
    assert "bad.jsonl" in str(e.value) and "row 1" in str(e.value)


def test_non_finite_hidden_states_stop_the_run_naming_the_batch(target, data, tmp_path, monkeypatch):
    real = TargetModel.forward_packed

    def poisoned(self, ids, pos, cu, taps):
        h = real(self, ids, pos, cu, taps).clone()
        h[2, 0, 0] = float("nan")
        return h

    monkeypatch.setattr(TargetModel, "forward_packed", poisoned)
    out = tmp_path / "cache"
    with pytest.raises(NonFiniteHiddenError, match=r"batch 0: .*NaN/Inf.*doc-"):
        run_extract(extract_cfg(target, data, out))
    # Batch 0 is the first shard: no shard was written, so the new cache went with the failed run.
    assert not (out / "cache.json").exists() and not list(out.rglob("*.safetensors"))


def test_parquet_input_and_cli_summary(target, tmp_path):
    data = tmp_path / "data.parquet"
    write_parquet(data, make_samples(n=10))
    out = tmp_path / "cache"
    args = cli_args(target, data, out, "--storage", "fp8", "--taps", "1,3")
    result = CliRunner().invoke(extract_cli, args)
    assert result.exit_code == 0, result.output
    assert "tok/s" in result.output and "padding efficiency" in result.output
    assert ShardReader(out).config.tap_layer_ids == [1, 3]
    again = CliRunner().invoke(extract_cli, args)
    assert again.exit_code == 0, again.output
    assert "nothing to extract" in again.output and "is complete" in again.output
    assert "0 tok/s" not in again.output and "0.0%" not in again.output


def test_resume_with_a_same_shape_target_of_other_weights_is_refused(target, data, tmp_path):
    out = tmp_path / "cache"
    run_extract(extract_cfg(target, data, out))
    twin = write_random_checkpoint(tmp_path / "twin", seed=2, dtype=torch.float32)
    # Same config.json (same config hash), other weights: only the head checksum tells them apart.
    (twin / "config.json").write_bytes((target / "config.json").read_bytes())
    with pytest.raises(CacheMismatchError, match="target_head_checksum"):
        run_extract(extract_cfg(twin, data, out))


def test_drafter_copies_the_target_mlp_width_from_the_cache(target, data, tmp_path):
    from extract.target.config import TargetConfig
    from train.config import TrainConfig
    from train.resolve import resolve_run

    out = tmp_path / "cache"
    run_extract(extract_cfg(target, data, out))
    width = TargetConfig.from_dir(target).intermediate_size
    assert ShardReader(out).config.target.intermediate_size == width
    run = resolve_run(TrainConfig(cache=str(out), out_dir=str(tmp_path / "run")))
    assert run.drafter.intermediate_size == width


def test_drafter_export_carries_the_target_token_ids_from_the_cache(target, data, tmp_path):
    from extract.target.config import special_token_ids
    from train.checkpoint.export import drafter_config_to_hf
    from train.config import TrainConfig
    from train.resolve import resolve_run

    out = tmp_path / "cache"
    run_extract(extract_cfg(target, data, out))
    raw = json.loads((target / "config.json").read_text())
    raw = raw.get("text_config", raw) if "bos_token_id" in raw.get("text_config", {}) else raw
    want = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    assert special_token_ids(target) == want and None not in want.values()
    cached = ShardReader(out).config.target
    assert {k: getattr(cached, k) for k in want} == want
    drafter = resolve_run(TrainConfig(cache=str(out), out_dir=str(tmp_path / "run"))).drafter
    hf = drafter_config_to_hf(drafter)
    assert {k: hf[k] for k in want} == want
    # A cache written before these fields existed still resumes: they are not part of its identity.
    path = out / "cache.json"
    old = json.loads(path.read_text())
    for k in want:
        old["target"].pop(k)
    path.write_text(json.dumps(old))
    run_extract(extract_cfg(target, data, out))


def test_the_export_carries_the_target_context_and_the_longest_reply_and_says_how_to_serve_it(target, tmp_path):
    """Extraction records the target's max_position_embeddings and the longest supervised run of the data;
    training keeps both, the export writes them (never the trainer's 262144 default) and prints the vLLM and
    SGLang commands with the block it was trained on. A cache written before they were recorded resumes."""
    from tests.helpers.train import TINY_DRAFTER
    from train.cli import main as train_cli

    samples = make_samples(n=12)
    data = tmp_path / "data.jsonl"
    write_jsonl(data, samples)
    cache = tmp_path / "cache"
    assert CliRunner().invoke(extract_cli, cli_args(target, data, cache)).exit_code == 0
    context = json.loads((target / "config.json").read_text())
    context = context.get("text_config", context)["max_position_embeddings"]
    longest = max(int(s.loss_mask.sum()) for s in samples)  # make_samples: one supervised run per sample
    cfg = ShardReader(cache).config
    assert (cfg.target.max_position_embeddings, cfg.dataset.longest_response) == (context, longest) != (262144, None)

    run, drafter = tmp_path / "run", tmp_path / "drafter"
    train = ["train", "--cache", str(cache), "--out", str(run), "--max-steps", "1", "--device", "cpu"]
    train += ["--block-size", str(TINY_DRAFTER["block_size"]), "--num-layers", "1", "--compute-dtype", "float32"]
    assert CliRunner().invoke(train_cli, train).exit_code == 0
    res = CliRunner().invoke(train_cli, ["export", str(run), str(drafter)])
    assert res.exit_code == 0, res.output
    hf = json.loads((drafter / "config.json").read_text())
    assert hf["max_position_embeddings"] == context and hf["dflash_training"] == {"longest_response": longest}
    block = TINY_DRAFTER["block_size"]
    spec = json.dumps({"method": "dflash", "model": str(drafter), "num_speculative_tokens": block - 1})
    assert f"vllm serve {target.resolve()} --speculative-config '{spec}' --attention-backend flash_attn" in res.output
    assert (
        f"python -m sglang.launch_server --model-path {target.resolve()} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {drafter} --speculative-num-draft-tokens {block}"
    ) in res.output
    assert "llama.cpp" not in res.output, "all layers full: nothing to say about llama.cpp"

    path = cache / "cache.json"  # as written before these were recorded: the cache still resumes
    old = json.loads(path.read_text())
    old["target"].pop("max_position_embeddings"), old["dataset"].pop("longest_response")
    path.write_text(json.dumps(old))
    again = CliRunner().invoke(extract_cli, cli_args(target, data, cache))
    assert again.exit_code == 0 and "nothing to extract" in again.output, again.output


@pytest.mark.slow
def test_a_refusal_on_rank_0_stops_every_rank(target, data, tmp_path):
    out = tmp_path / "cache"
    run_extract(extract_cfg(target, data, out))
    cmd = torchrun_command("extract.cli", *cli_args(target, data, out, "--device", "cpu", "--storage", "fp8"))
    # Rank 1 must not wait at a barrier for rank 0, which refused the resume.
    proc = subprocess.run(cmd, capture_output=True, timeout=240, cwd=REPO)
    assert proc.returncode != 0
    assert "storage_dtype" in proc.stderr.decode()


def test_the_job_summary_sums_the_ranks_and_keeps_every_progress_log():
    from extract.runner import ExtractSummary, job_summary

    idle = ExtractSummary("c", 4, written=0, resumed=2, tokens=0, seconds=0.0, padding_efficiency=0.0, bytes_written=0)
    busy = ExtractSummary(
        "c", 4, written=2, resumed=0, tokens=90, seconds=3.0, padding_efficiency=0.9, bytes_written=10, rank=1
    )
    busy.progress_log = "c/logs/extract-rank1.jsonl"
    job = job_summary([idle, busy])
    assert (job.written, job.resumed, job.tokens, job.seconds, job.ranks) == (2, 2, 90, 3.0, 2)
    assert job.padding_efficiency == pytest.approx(0.9) and job.progress_log == "c/logs/extract-rank1.jsonl"
    assert "(all 2 ranks): 2 shards written" in job.report()
