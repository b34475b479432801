"""Training files read as untrusted (issue 26, class 2), through the dflash-train CLI: one line naming
the file and the field, never a traceback, and shapes compared before anything is allocated.

  1. train_state.json as `[]`, with an unknown drafter field, with a field of another type: export,
     eval and resume refuse naming file and field (AttributeError / TypeError tracebacks before).
  2. train_state.json edited (a value changed, its own checksum kept): export refuses naming it; resume
     skips that checkpoint with a warning and continues from the previous one.
  3. Drafter sizes inflated past the weights (train_state.json of a checkpoint, config.json of an
     export, an --init-from drafter): refused naming the tensor before any model is built (the model
     was allocated first, 80 GB asked, before the shapes were compared); a cache.json inflated past its
     shards: refused before the loader's buffers are allocated; an export of zero heads (a
     ZeroDivisionError before). Resume: a cursor past the run's shards (the epoch ended silently) and
     an RNG state of another size are refused naming the field.
  4. metrics.jsonl with a record {"step": "4"}: plot refuses naming file, line and field.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from click.testing import CliRunner

import train.checkpoint.export
from tests.helpers.train import tiny_cache, tiny_cli_args, tiny_config
from train.checkpoint.store import list_checkpoints, state_checksum
from train.cli import main as train_cli
from train.loop import run_training

INFLATED = 2**40  # an MLP width whose weights would take 4 TB per layer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run with checkpoints at steps 2 and 4, and its export."""
    root = tmp_path_factory.mktemp("trained")
    cache = tiny_cache(root / "cache", num_batches=4)
    run = root / "run"
    run_training(tiny_config(cache, run, epochs=1, checkpoint_every=2, keep_checkpoints=5))
    assert [c.step for c in list_checkpoints(run)] == [2, 4]
    assert invoke("export", run, root / "export").exit_code == 0
    return cache, run, root / "export"


@pytest.fixture
def no_model(monkeypatch):
    """Building a drafter for export, eval or --init-from fails the test: the refusal must come first."""

    def built(*a, **kw):
        raise AssertionError("a drafter model was built before its shapes were compared with the weights")

    monkeypatch.setattr(train.checkpoint.export, "DFlashDrafter", built)


def invoke(*args):
    return CliRunner().invoke(train_cli, [str(a) for a in args])


def refused(result) -> bool:
    return result.exit_code == 1 and (result.exception is None or isinstance(result.exception, SystemExit))


def evaluate(drafter, cache):
    return invoke("eval", "--drafter", drafter, "--cache", cache, "--eval-shards", "1", "--budgets", "")


def craft(path, edit, keep_checksum=False) -> None:
    """Rewrite a train_state.json with edit(state) applied; its own checksum recomputed (a crafted file)
    unless keep_checksum (an edited one)."""
    state = json.loads(path.read_text())
    edited = edit(state)
    if isinstance(edited, dict) and not keep_checksum:
        edited["state_checksum"] = state_checksum(edited)
    path.write_text(json.dumps(edited))


def resume(cache, run):
    """dflash-train train --resume with the settings the `trained` run was made with."""
    settings = ["--epochs", "1", "--checkpoint-every", "2", "--keep-checkpoints", "5", "--metrics-every", "2"]
    return invoke(*tiny_cli_args(cache, run, "--resume", *settings))


def copy_run(trained, tmp_path):
    shutil.copytree(trained[1], tmp_path / "run")
    return tmp_path / "run", tmp_path / "run" / "step-00000004" / "train_state.json"


def with_drafter(**fields):
    def edit(state):
        state["drafter"].update(fields)
        return state

    return edit


CRAFTED = [
    ("an array", lambda s: [], "expected a JSON object, found an array"),
    ("an unknown drafter field", with_drafter(colour="blue"), "unknown field drafter.colour"),
    ("a string step count", lambda s: {**s, "epoch": "0"}, "field epoch must be an integer, found a string"),
    ("a drafter size as text", with_drafter(head_dim="8"), "field drafter.head_dim must be an integer, found a string"),
    ("rng of another rank count", lambda s: {**s, "rng": []}, "rng holds 0 states, world_size is 1"),
]


@pytest.mark.parametrize("name, edit, reason", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_a_crafted_train_state_is_refused_by_export_and_eval_naming_the_field(
    trained, tmp_path, no_model, name, edit, reason
):
    cache, _, _ = trained
    run, state = copy_run(trained, tmp_path)
    craft(state, edit)
    for result in (invoke("export", run / "step-00000004", tmp_path / "out"), evaluate(run / "step-00000004", cache)):
        assert refused(result), result.output
        assert f"{state}: {reason}" in result.output, result.output


RESUME_CRAFTED = [
    ("a string step count", lambda s: {**s, "epoch": "0"}, "field epoch must be an integer, found a string"),
    ("a cursor past the shards", lambda s: {**s, "cursor": 10**9}, "cursor 1000000000 is past this run's 4"),
    ("an rng state of another size", lambda s: {**s, "rng": [{"torch_cpu": "AAAA"}]}, "rng[0] does not restore"),
]


@pytest.mark.parametrize("name, edit, reason", RESUME_CRAFTED, ids=[c[0] for c in RESUME_CRAFTED])
def test_a_crafted_train_state_is_refused_by_resume_naming_the_field(trained, tmp_path, name, edit, reason):
    cache, _, _ = trained
    run, _ = copy_run(trained, tmp_path)
    shutil.rmtree(run / "step-00000004")  # step 2 the newest: a resume with steps left to train
    state = run / "step-00000002" / "train_state.json"
    craft(state, edit)
    result = resume(cache, run)
    assert refused(result), result.output
    assert f"{state}: {reason}" in result.output, result.output


def test_an_edited_train_state_is_refused_by_name_and_skipped_by_resume(trained, tmp_path, caplog):
    cache, _, _ = trained
    run, state = copy_run(trained, tmp_path)
    craft(state, lambda s: {**s, "tokens_seen": 0}, keep_checksum=True)
    result = invoke("export", run / "step-00000004", tmp_path / "out")
    assert refused(result), result.output
    assert f"{state}: checksum mismatch" in result.output and "edited or damaged" in result.output, result.output
    caplog.set_level(logging.INFO)
    result = resume(cache, run)
    assert result.exit_code == 0, result.output
    assert f"{state}: checksum mismatch" in caplog.text, caplog.text
    assert f"resume: {run / 'step-00000002'}" in caplog.text, caplog.text
    assert [c.step for c in list_checkpoints(run)] == [2, 4], "step 4 trained again and written anew"


INFLATED_STATES = [
    (with_drafter(intermediate_size=INFLATED), "tensor layers.0.mlp.gate_proj.weight has shape [", f"[{INFLATED}, 32]"),
    (with_drafter(num_layers=10**6, layer_types=None), "the weights hold layers 0-0", "1000000 (layers 0-999999)"),
]


@pytest.mark.parametrize("edit, found, described", INFLATED_STATES, ids=["MLP width", "layer count"])
def test_inflated_sizes_in_train_state_are_refused_naming_the_tensor_before_any_model(
    trained, tmp_path, no_model, edit, found, described
):
    cache, _, _ = trained
    run, state = copy_run(trained, tmp_path)
    craft(state, edit)
    weights = run / "step-00000004" / "model.safetensors"
    for result in (invoke("export", run / "step-00000004", tmp_path / "out"), evaluate(run / "step-00000004", cache)):
        assert refused(result), result.output
        assert f"{weights}: {found}" in result.output, result.output
        assert f"{state} describes {described}" in result.output, result.output


def test_a_cache_json_edited_past_its_shards_is_refused_before_any_buffer(trained, tmp_path, no_work):
    cache = tmp_path / "cache"
    shutil.copytree(trained[0], cache)
    config = json.loads((cache / "cache.json").read_text())
    (cache / "cache.json").write_text(json.dumps({**config, "token_budget": 10**10}))  # 3.8 TB of buffers
    result = invoke(*tiny_cli_args(cache, tmp_path / "run"))
    assert refused(result), result.output
    assert f"cache {cache}: {cache / 'shards' / 'b00000000.safetensors'}: belongs to another cache" in result.output
    assert "if cache.json was edited, restore it" in result.output, result.output


def test_an_export_of_zero_heads_is_refused_naming_the_field(trained, tmp_path):
    drafter = tmp_path / "drafter"
    shutil.copytree(trained[2], drafter)
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0, "head_dim": None}))
    result = evaluate(drafter, trained[0])
    assert refused(result), result.output
    assert f"{drafter / 'config.json'}: num_attention_heads must be positive, found 0" in result.output


def inflated_export(trained, tmp_path):
    """A copy of the trained run's export whose config.json describes an MLP of INFLATED width."""
    drafter = tmp_path / "drafter"
    shutil.copytree(trained[2], drafter)
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "intermediate_size": INFLATED}))
    return drafter


def test_inflated_sizes_in_an_export_are_refused_naming_the_tensor_before_any_model(trained, tmp_path, no_model):
    cache, _, _ = trained
    drafter = inflated_export(trained, tmp_path)
    result = evaluate(drafter, cache)
    assert refused(result), result.output
    assert f"{drafter / 'model.safetensors'}: tensor layers.0.mlp.gate_proj.weight has shape" in result.output
    assert f"{drafter / 'config.json'} describes [{INFLATED}, 32]" in result.output, result.output


def test_an_inflated_init_from_drafter_is_refused_before_any_work(trained, tmp_path, no_work):
    cache, _, _ = trained
    drafter = inflated_export(trained, tmp_path)
    args = tiny_cli_args(cache, tmp_path / "run", "--init-from", str(drafter))
    at = args.index("--num-layers")
    result = invoke(*args[:at], *args[at + 2 :])  # the drafter's own layer count
    assert refused(result), result.output
    assert f"--init-from {drafter}: {drafter / 'model.safetensors'}: tensor layers.0.mlp" in result.output
    assert not (tmp_path / "run").exists(), "refused before the run directory is made"


def test_plot_refuses_a_metrics_record_of_another_type_naming_file_line_and_field(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained[1], run)
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines.insert(2, json.dumps({"step": "4", "loss/total": 1.0}))
    metrics.write_text("\n".join(lines) + "\n")
    result = invoke("plot", run)
    assert refused(result), result.output
    assert f"{metrics}, line 3: field step must be an integer, found a string" in result.output, result.output
    metrics.write_text("[" * 200_000 + "]" * 200_000 + "\n" + "\n".join(lines) + "\n")
    result = invoke("plot", run)
    assert refused(result), result.output
    assert f"{metrics}, line 1: JSON nested more than" in result.output, result.output
