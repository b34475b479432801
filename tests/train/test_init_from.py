"""--init-from: training starts from an exported / published DFlashDraftModel directory, refused (every
differing field named) when it does not fit the cache; sliding-layer drafters train end to end."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from click.testing import CliRunner

from shards import ShardReader
from tests.helpers.drafter import drafter_for_target
from tests.helpers.train import hand_step_loss, read_records, tiny_cache, tiny_cli_args, tiny_config
from train.checkpoint.export import export_drafter, load_exported_drafter
from train.cli import main as train_cli
from train.drafter.model import DFlashDrafter
from train.loop import run_training
from train.resolve import resolve_run

SLIDING = dict(num_layers=2, layer_types=["sliding", "full"], sliding_window=6)


def first_step_loss_of(drafter_dir, cache, cfg) -> float:
    """The loss the trainer's first step must see: the loaded drafter on the first shard of epoch 0, the
    anchors of rank 0's generator, fp32, computed here without the trainer."""
    model, dcfg = load_exported_drafter(drafter_dir, dtype=torch.float32)
    with torch.no_grad():
        return hand_step_loss(model, dcfg, cache, cfg).total.item()


def test_init_from_an_exported_drafter_continues_from_its_weights(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=4)
    first = tmp_path / "first"
    run_training(tiny_config(cache, first, max_steps=4, lr=3e-3, **SLIDING))
    result = CliRunner().invoke(train_cli, ["export", str(first), str(tmp_path / "exported")])
    assert result.exit_code == 0, result.output

    cfg = tiny_config(cache, tmp_path / "second", max_steps=2, init_from=str(tmp_path / "exported"), **SLIDING)
    run_training(cfg)
    loss = read_records(tmp_path / "second")[0]["loss/total"]
    want = first_step_loss_of(tmp_path / "exported", cache, cfg)
    assert abs(loss - want) < 1e-5 * max(1.0, abs(want)), f"first step loss {loss}, loaded drafter's {want}"

    fresh = tiny_config(cache, tmp_path / "fresh", max_steps=1, **SLIDING)  # the test can tell the difference
    run_training(fresh)
    assert abs(read_records(tmp_path / "fresh")[0]["loss/total"] - want) > 1e-3


def test_the_first_evaluation_of_an_init_from_run_is_called_initial_not_untrained(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=4)
    run_training(tiny_config(cache, tmp_path / "first", max_steps=2))
    assert CliRunner().invoke(train_cli, ["export", str(tmp_path / "first"), str(tmp_path / "exported")]).exit_code == 0
    args = tiny_cli_args(cache, tmp_path / "second", "--max-steps", "1", "--eval-shards", "1")
    res = CliRunner().invoke(train_cli, [*args, "--init-from", str(tmp_path / "exported")])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("acceptance length on held-out shards"))
    assert " initial (--init-from) -> " in line and "untrained" not in line and "after 1 step;" in line, line
    fresh = CliRunner().invoke(
        train_cli, tiny_cli_args(cache, tmp_path / "fresh", "--max-steps", "2", "--eval-shards", "1")
    )
    assert fresh.exit_code == 0 and " untrained -> " in fresh.output and "after 2 steps;" in fresh.output


def test_init_from_takes_the_drafter_shape_and_refuses_other_shape_options(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    cc = ShardReader(cache).config
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    # A drafter for this cache's target whose shape the run would not derive (1 kv head, MLP 40, 3 layers).
    dcfg = drafter_for_target(
        cc.target.hidden_size,
        40,
        cc.target.vocab_size,
        num_layers=3,
        rope_theta=5e5,
        layer_types=layer_types,
        sliding_window=5,
        block_size=4,
    ).replace(num_key_value_heads=1)
    assert (dcfg.tap_layer_ids, dcfg.num_target_layers) == (list(cc.tap_layer_ids), cc.target.num_layers)
    torch.manual_seed(0)
    export_drafter(DFlashDrafter(dcfg), dcfg, tmp_path / "published")
    run = resolve_run(tiny_config(cache, tmp_path / "run", init_from=str(tmp_path / "published"), num_layers=None))
    got = run.drafter
    assert (
        got.num_layers,
        got.intermediate_size,
        got.num_key_value_heads,
        got.rope_theta,
        got.layer_types,
        got.sliding_window,
    ) == (3, 40, 1, 5e5, dcfg.layer_types, 5)
    # A flag given at its default value is still given: refused, not silently replaced by the drafter's.
    with pytest.raises(
        ValueError, match=r"--num-layers 5: the drafter has 3.*--rope-theta 10000000.0: the drafter has 500000.0"
    ):
        resolve_run(
            tiny_config(cache, tmp_path / "run", init_from=str(tmp_path / "published"), num_layers=5, rope_theta=1e7)
        )
    with pytest.raises(
        ValueError,
        match=r"--num-layers 2: the drafter has 3 \(drop --num-layers\).*"
        r"--layer-types sliding,full: the drafter has sliding_attention,full_attention,sliding_attention.*"
        r"--sliding-window 7: the drafter has 5",
    ):
        resolve_run(
            tiny_config(
                cache,
                tmp_path / "run",
                init_from=str(tmp_path / "published"),
                num_layers=2,
                layer_types=["sliding", "full"],
                sliding_window=7,
            )
        )


def test_init_from_refuses_a_drafter_that_does_not_fit_the_cache(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    dcfg = drafter_for_target(
        32, 40, 128, num_layers=1, block_size=8, mask_token_id=5, tap_layer_ids=[0, 1, 2], num_target_layers=6
    )
    export_drafter(DFlashDrafter(dcfg), dcfg, tmp_path / "other")
    with pytest.raises(ValueError) as e:
        resolve_run(tiny_config(cache, tmp_path / "run", init_from=str(tmp_path / "other")))
    for field in (
        "tap_layer_ids: drafter [0, 1, 2], cache [1, 3, 5]",
        "num_target_layers: drafter 6, cache 8",
        "block_size: drafter 8, this run 4",
        "mask_token_id: drafter 5, cache/run 127",
    ):
        assert field in str(e.value)
    wide = dcfg.replace(
        hidden_size=64,
        tap_layer_ids=[1, 3, 5],
        num_target_layers=8,
        block_size=4,
        mask_token_id=127,
    )
    export_drafter(DFlashDrafter(wide), wide, tmp_path / "wide")
    result = CliRunner().invoke(
        train_cli, tiny_cli_args(cache, tmp_path / "run2", "--init-from", str(tmp_path / "wide"))
    )
    assert result.exit_code != 0 and "hidden_size: drafter 64, cache 32" in result.output
    assert "Traceback" not in result.output


def test_sliding_layer_flags_through_the_cli(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    out = tmp_path / "run"
    result = CliRunner().invoke(
        train_cli,
        tiny_cli_args(
            cache,
            out,
            "--num-layers",
            "2",
            "--layer-types",
            "sliding,full",
            "--sliding-window",
            "6",
            "--max-steps",
            "2",
        ),
    )
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(train_cli, ["export", str(out), str(tmp_path / "exported")])
    assert result.exit_code == 0, result.output
    _, cfg = load_exported_drafter(tmp_path / "exported")
    assert cfg.layer_types == ["sliding_attention", "full_attention"] and cfg.sliding_window == 6
    # What the engines need to hear: vLLM runs mixed sliding / full layers only on its V2 model runner, and
    # llama.cpp (every layer non-causal, no window) is no target for this layout.
    assert "  vLLM:   VLLM_USE_V2_MODEL_RUNNER=1 vllm serve synthetic --speculative-config " in result.output
    assert "not llama.cpp: it runs every draft layer non-causally and its converter drops the sliding window" in (
        result.output
    )
    # Every refusal quotes --layer-types as typed (short names, the user's spelling), never normalised.
    for args, message in (
        (["--layer-types", "sliding,full"], r"--layer-types sliding,full: has sliding layers but --sliding-window"),
        (["--layer-types", "full,full", "--sliding-window", "6"], r"ignored: --layer-types full,full has no"),
        (
            ["--layer-types", "sliding,diagonal", "--sliding-window", "6"],
            r"--layer-types sliding,diagonal: 'diagonal' is not a layer type; give full or sliding",
        ),
        (["--layer-types", "full_attention,sliding,full"], r"--layer-types full_attention,sliding,full: 3 entries"),
    ):
        result = CliRunner().invoke(train_cli, tiny_cli_args(cache, tmp_path / "bad", "--num-layers", "2", *args))
        assert result.exit_code != 0 and "Traceback" not in result.output
        assert re.search(message, result.output), result.output
        assert "sliding_attention," not in result.output and "['" not in result.output, result.output


def _exported(tmp_path, cache):
    """A drafter of SLIDING's shape for `cache`, exported by dflash-train export."""
    run_training(tiny_config(cache, tmp_path / "source", max_steps=1, **SLIDING))
    result = CliRunner().invoke(train_cli, ["export", str(tmp_path / "source"), str(tmp_path / "exported")])
    assert result.exit_code == 0, result.output
    return tmp_path / "exported"


def test_a_resumed_init_from_run_compares_the_drafter_by_content_not_path(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=4)
    exported = _exported(tmp_path, cache)
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(exported, copy)
    run = tmp_path / "run"
    shape = ["--layer-types", "sliding,full", "--sliding-window", "6"]
    args = tiny_cli_args(cache, run, "--max-steps", "2", "--checkpoint-every", "1")
    at = args.index("--num-layers")
    args = args[:at] + args[at + 2 :]  # the drafter's own layer count

    def train(init, *extra):
        return CliRunner().invoke(train_cli, [*args, *shape, "--init-from", str(init), *extra])

    assert train(exported).exit_code == 0
    shutil.rmtree(run / "step-00000002")  # the run stopped after step 1
    result = train(copy, "--resume")  # the same drafter under another path
    assert result.exit_code == 0, result.output
    assert (run / "step-00000002").is_dir()

    # A checkpoint written before the content was recorded holds the path: that same directory resumes.
    # (Written before train_state.json recorded its own checksum, too: edited, it would be refused.)
    state_path = run / "step-00000001" / "train_state.json"
    original = state_path.read_text()
    state = json.loads(original)
    state["resolved_identity"]["init_from"] = str(exported)
    del state["state_checksum"]
    state_path.write_text(json.dumps(state))
    shutil.rmtree(run / "step-00000002")
    result = train(exported, "--resume")
    assert result.exit_code == 0, result.output
    shutil.rmtree(run / "step-00000002")
    state_path.write_text(json.dumps(state))  # and any other path cannot be told to be the same drafter
    result = train(copy, "--resume")
    assert result.exit_code == 1 and "--init-from: checkpoint " in result.output, result.output
    state_path.write_text(original)

    model, _ = load_exported_drafter(copy, dtype=torch.float32)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    shutil.rmtree(copy)
    export_drafter(model, load_exported_drafter(exported)[1], copy)  # another drafter under the same path
    result = train(copy, "--resume")
    assert result.exit_code == 1, result.output
    assert re.search(r"--init-from: checkpoint content crc32 \w+, now content crc32 \w+", result.output), result.output


def test_a_config_without_layer_types_gets_the_layers_hf_derives(tmp_path):
    """Qwen3Config (what engines read) derives layer_types from use_sliding_window, sliding_window and
    max_window_layers when config.json has none: the drafter must be read the same way."""
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    exported = _exported(tmp_path, cache)
    config_path = exported / "config.json"
    hf = json.loads(config_path.read_text())
    hf.pop("layer_types")
    hf.update(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    config_path.write_text(json.dumps(hf))
    transformers = pytest.importorskip("transformers")
    want = transformers.Qwen3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "dflash_config")})
    got = resolve_run(tiny_config(cache, tmp_path / "run", init_from=str(exported), num_layers=None)).drafter
    assert (got.layer_types, got.sliding_window) == (want.layer_types, want.sliding_window)
    assert got.layer_types == ["full_attention", "sliding_attention"]


def test_init_from_a_drafter_with_nan_weights_is_refused_before_training(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=4)
    exported = _exported(tmp_path, cache)
    model, dcfg = load_exported_drafter(exported, dtype=torch.float32)
    with torch.no_grad():
        model.norm.weight[0] = float("nan")
    shutil.rmtree(exported)
    export_drafter(model, dcfg, exported)
    args = tiny_cli_args(cache, tmp_path / "run", "--max-steps", "2", "--eval-shards", "1")
    at = args.index("--num-layers")
    result = CliRunner().invoke(
        train_cli,
        [
            *args[:at],
            *args[at + 2 :],
            "--layer-types",
            "sliding,full",
            "--sliding-window",
            "6",
            "--init-from",
            str(exported),
        ],
    )
    assert result.exit_code == 1, result.output
    assert "1 tensor(s) hold NaN or inf values (norm.weight)" in result.output, result.output
    assert "acceptance length" not in result.output  # refused before the step-0 evaluation
