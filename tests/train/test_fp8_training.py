"""--fp8 (train/drafter/fp8.py, train/loss/head_gemms.py) on CPU, in torchao's emulation (the same casts,
dequantised matmuls) and torch's CPU _scaled_mm for the head.

Tolerances, from the formats: e4m3 keeps 3 mantissa bits (a rounding is within 2^-4 relative), e5m2 keeps
2 (2^-3). A weight gradient of an FP8 linear multiplies an e4m3 input by an e5m2 output gradient, that
gradient itself carries the FP8 error of the layers after it, so per element up to ~2^-4 + 2^-3 + what
came from above; summed over tokens the errors partly cancel. So every parameter's gradient must be
within 0.3 of its largest float64 entry (FP8_GRAD_TOL) and the loss within 1e-2 relative (the logits
through an e4m3 head are off by ~2^-4 / sqrt(H) relative); measured here: 0.14 and 6e-5 for the
linears, 0.21 and 2.6e-3 with the head. And FP8 must show: its gradient error is at least 1e-2 where
the float32 path's is ~5e-7, and no converted layer's gradient equals the float32 one, so the tests fail
if --fp8 silently computes in high precision.
"""

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import train.loop
import train.step
from shards.common.errors import UserError
from tests.helpers.drafter import blocks_and_layout, forward_blocks, make_batch, tiny_config, tiny_model_and_head
from tests.helpers.train import run_steps, tiny_cache, tiny_cli_args
from train.checkpoint.export import export_drafter, load_exported_drafter
from train.checkpoint.store import MODEL_FILE
from train.cli import main
from train.drafter.fp8 import float8_linears_, require_fp8, resolve_fp8
from train.drafter.linear import Linear
from train.drafter.model import TargetHead
from train.drafter.pointwise import compile_pointwise_
from train.loss.chunked import block_loss
from train.loss.config import LossConfig
from train.loss.head_gemms import Fp8HeadGemms

FP8_GRAD_TOL = 0.3  # of the gradient's largest float64 entry (module docstring)
FP8_LOSS_TOL = 1e-2  # relative
FP8_SHOWS = 1e-2  # the least gradient error FP8 must show (float32: ~5e-7)
# A drafter whose every backbone linear has dimensions in multiples of 16 (the FP8 GEMM layout rule):
# kv heads x head dim = 16, MLP 48, fc 3 x 32.
FP8_SHAPE = dict(num_key_value_heads=2, head_dim=8, intermediate_size=48)
STEP = dict(
    num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, attention="sdpa"
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield


def model_loss_and_grads(dtype: torch.dtype, fp8: str, recipe: str = "tensorwise", fused: bool = True):
    """The tiny drafter's loss and gradients, one forward and backward, weights made in float32 first
    (so the float64 reference has the same values)."""
    cfg = tiny_config(**FP8_SHAPE)
    batch = make_batch([9, 14, 3, 11], 48, 6, cfg.num_taps, cfg.hidden_size)
    batch["hidden_TKH"] = batch["hidden_TKH"].to(dtype)
    blocks, layout = blocks_and_layout(cfg, batch, num_blocks=12)
    model, head = tiny_model_and_head(cfg)
    model = model.to(dtype)
    head = TargetHead(head.embed_tokens_VH.to(dtype), head.lm_head_VH.to(dtype))
    converted = float8_linears_(model, recipe, emulate=True) if fp8 != "off" else []
    gemms = Fp8HeadGemms(head.lm_head_VH) if fp8 == "linears+head" else None
    out = forward_blocks(model, head, batch, blocks, layout)
    parts = block_loss(out, head, blocks, LossConfig(chunk_blocks=5, fused=fused), gemms=gemms)
    parts.total.backward()
    grads = {name: p.grad.double() for name, p in model.named_parameters()}
    return float(parts.total.detach()), grads, converted


def relative_errors(grads: dict, reference: dict) -> dict:
    return {n: ((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in reference.items()}


@pytest.mark.parametrize(
    "fp8,recipe,fused",
    [("linears", "tensorwise", True), ("linears", "rowwise", True), ("linears+head", "tensorwise", True)]
    + [("linears+head", "tensorwise", False)],
)
def test_fp8_loss_and_gradients_against_float64(fp8, recipe, fused):
    loss64, grads64, _ = model_loss_and_grads(torch.float64, "off")
    loss32, grads32, _ = model_loss_and_grads(torch.float32, "off", fused=fused)
    loss8, grads8, converted = model_loss_and_grads(torch.float32, fp8, recipe, fused)
    assert len(converted) == 1 + 2 * 7, converted  # fc and every layer's q/k/v/o and MLP
    errors = relative_errors(grads8, grads64)
    worst = max(errors, key=errors.get)
    assert errors[worst] < FP8_GRAD_TOL, f"{worst}: relative max grad diff {errors[worst]:.3e}"
    assert abs(loss8 - loss64) <= FP8_LOSS_TOL * abs(loss64), f"loss fp8 {loss8} vs float64 {loss64}"
    assert max(relative_errors(grads32, grads64).values()) < 1e-5  # the float32 path is the baseline
    assert errors[worst] > FP8_SHOWS, f"FP8 gradients are as exact as float32 ({errors[worst]:.3e}): no FP8 ran"
    for name in converted:
        assert not torch.equal(grads8[f"{name}.weight"], grads32[f"{name}.weight"]), f"{name}: not in FP8"


def test_fp8_head_moves_the_loss_beyond_the_linears_alone():
    """The head's FP8 GEMMs act: with them the loss and the gradients differ from the linears alone."""
    loss64, _, _ = model_loss_and_grads(torch.float64, "off")
    loss_linears, grads_linears, _ = model_loss_and_grads(torch.float32, "linears")
    loss_head, grads_head, _ = model_loss_and_grads(torch.float32, "linears+head")
    assert abs(loss_head - loss64) > 10 * abs(loss_linears - loss64), (loss64, loss_linears, loss_head)
    assert not torch.equal(grads_head["norm.weight"], grads_linears["norm.weight"])


def test_fp8_head_gemms_against_float64():
    """Fp8HeadGemms: logits and input gradient within the e4m3 / e5m2 rounding of the exact products."""
    g = torch.Generator().manual_seed(0)
    w_VH = torch.randn(200, 64, generator=g) * 0.02
    h_XH = torch.randn(24, 64, generator=g)
    grad_XV = torch.softmax(torch.randn(24, 200, generator=g) * 3, -1) - torch.eye(24, 200)
    gemms = Fp8HeadGemms(w_VH)
    logits, want = gemms.logits(h_XH).double(), h_XH.double() @ w_VH.double().T
    dh, want_dh = gemms.input_grad(grad_XV).double(), grad_XV.double() @ w_VH.double()
    # Each product carries two roundings (2^-4 each in e4m3; 2^-3 + 2^-4 with the e5m2 gradient);
    # random signs over 64 (200) terms: the error of a sum is far below that of its largest term.
    assert (logits - want).abs().max() < 2**-3 * want.abs().max()
    assert (dh - want_dh).abs().max() < 2**-2 * want_dh.abs().max()
    assert not torch.equal(logits, want.float().double())  # FP8 ran
    hidden = h_XH.clone().requires_grad_()
    gemms.logits(hidden).backward(grad_XV)
    assert torch.equal(hidden.grad, gemms.input_grad(grad_XV))  # autograd's path is the same GEMM


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_fp8_step_in_bf16_with_weight_copies(tmp_path, arch):
    """The training step in bf16 with --fp8 linears+head: the FP8 linears leave the working copies, the
    linears that stay bf16 (DFlash 2's kernel and selector projections) keep them, and two steps' losses
    and gradients stay within FP8's rounding of the bf16 step's yet differ from it."""
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    # DFlash 2 with activation checkpointing: the FP8 linears recompute in backward
    extra = dict(arch="dflash2", selector_gold="swap", checkpoint_layers=True) if arch == "dflash2" else {}
    common = dict(compute_dtype="bfloat16", **STEP, **extra)
    plain = run_steps(cache, tmp_path / "a", 2, **common)
    fp8 = run_steps(cache, tmp_path / "b", 2, fp8="linears+head", fp8_emulate=True, **common)
    state = fp8["state"]
    kept = [m for m in state.model.modules() if isinstance(m, Linear)]
    if arch == "dflash":
        assert kept == [] and state.working_weights is None
    else:
        assert {type(m).__name__ for m in kept} == {"Linear"} and len(kept) == 2 * 2 + 1  # 2 convs per layer + selector
        assert [w.data_ptr() for w in state.working_weights.masters] == [m.weight.data_ptr() for m in kept]
    assert type(state.model.fc).__name__ == "Float8Linear" and state.head_gemms is not None
    assert torch.allclose(plain["sums"], fp8["sums"], rtol=FP8_LOSS_TOL), (plain["sums"] - fp8["sums"]).abs().max()
    assert not torch.equal(plain["sums"], fp8["sums"])
    for step, (a, b) in enumerate(zip(plain["grads"], fp8["grads"])):
        err = ((a - b).abs().max() / a.abs().max()).item()
        assert FP8_SHOWS / 10 < err < FP8_GRAD_TOL, f"step {step + 1}: relative max gradient diff {err:.3e}"


def test_fp8_linears_under_compiled_pointwise_equal_the_eager_fp8_step(tmp_path, monkeypatch):
    """--compile-pointwise compiles the FP8 linears' casts too (aot_eager on CPU: the same graphs, no
    compiler): the same step as the eager FP8 one, to float32 rounding."""
    monkeypatch.setattr(train.step, "compile_pointwise_", lambda model: compile_pointwise_(model, backend="aot_eager"))
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    common = dict(compute_dtype="float32", fp8="linears", fp8_emulate=True, **STEP)
    eager = run_steps(cache, tmp_path / "a", 2, compile_pointwise=False, **common)
    compiled = run_steps(cache, tmp_path / "b", 2, compile_pointwise=True, **common)
    assert "forward" in vars(compiled["state"].model.fc)  # the compiled twin, set on the instance
    assert torch.allclose(eager["sums"], compiled["sums"], rtol=1e-5), (eager["sums"] - compiled["sums"]).abs().max()
    for step, (a, b) in enumerate(zip(eager["grads"], compiled["grads"])):
        err = ((a - b).abs().max() / a.abs().max()).item()
        assert err < 1e-4, f"step {step + 1}: relative max gradient diff {err:.3e}"


def test_fp8_checkpoint_and_export_hold_plain_tensors(tmp_path):
    """What a FP8 run saves (the loop writes model.state_dict()) and exports: the non-FP8 run's names,
    plain float32 tensors, a safetensors round trip, and an export that loads into a standard drafter
    with the trained values."""
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    plain = run_steps(cache, tmp_path / "a", 1, compute_dtype="float32", **STEP)["state"].model.state_dict()
    model = run_steps(cache, tmp_path / "b", 1, compute_dtype="float32", fp8="linears", fp8_emulate=True, **STEP)[
        "state"
    ].model
    state = model.state_dict()
    assert list(state) == list(plain)
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in state.values())
    save_file(state, tmp_path / MODEL_FILE)
    assert all(torch.equal(t, state[name]) for name, t in load_file(tmp_path / MODEL_FILE).items())
    export_drafter(model, model.config, tmp_path / "export")
    loaded, _ = load_exported_drafter(tmp_path / "export")
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, state[name].bfloat16()), name


def test_fp8_refused_on_cpu_without_emulation():
    with pytest.raises(UserError, match="--fp8 needs a CUDA GPU of compute capability 8.9"):
        require_fp8(torch.device("cpu"), emulate=False)


def test_fp8_refused_below_compute_capability_8_9(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(UserError, match=r"--fp8 needs compute capability 8.9\+.*A100 is 8.0: drop --fp8"):
        require_fp8(torch.device("cuda:0"), emulate=False)


def test_fp8_refused_without_torchao(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if not installed
    with pytest.raises(UserError, match=r"pip install 'dflash-pipeline\[fp8\]'"):
        require_fp8(torch.device("cpu"), emulate=True)


def test_dflash_train_refuses_fp8_on_cpu_before_the_run_directory(tmp_path):
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    res = CliRunner().invoke(main, tiny_cli_args(cache, tmp_path / "run", "--fp8", "linears"))
    assert res.exit_code == 1, res.output
    assert "Error: --fp8 needs a CUDA GPU of compute capability 8.9+" in res.output
    assert not (tmp_path / "run").exists()


def test_dflash_train_help_teaches_fp8():
    text = " ".join(CliRunner().invoke(main, ["train", "--help"]).output.split())
    for phrase in (
        "--fp8 [auto|off|linears|linears+head]",
        "8.9+",
        "within the seed spread of bf16",
        "--fp8-recipe",
        "1.44x",
    ):
        assert phrase in text, phrase


def test_fp8_recipe_without_fp8_is_refused_before_the_run_directory(tmp_path):
    # The recipe is part of the run's identity: accepted with --fp8 off, it would do nothing yet make a
    # later resume without it refused.
    cache = tiny_cache(tmp_path / "cache", num_batches=2)
    res = CliRunner().invoke(main, tiny_cli_args(cache, tmp_path / "run", "--fp8-recipe", "rowwise"))
    assert res.exit_code != 0 and "--fp8-recipe rowwise" in res.output, res.output
    assert "--fp8 auto trains in bf16 here" in res.output, res.output
    assert not (tmp_path / "run").exists()


def test_fp8_head_refused_for_sizes_no_fp8_gemm_takes():
    from train.loss.head_gemms import require_fp8_head

    require_fp8_head(248320, 5120)
    with pytest.raises(UserError, match=r"LM head is 250 x 64; .*use --fp8 linears"):
        require_fp8_head(250, 64)


def resolved_on(
    monkeypatch, capability, *, arch="dflash", compute_dtype="bfloat16", head_shape=(4096, 256), torchao=True
):
    """--fp8 auto resolved on a stand-in CUDA GPU of `capability` (no GPU needed: only its queries)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stand-in GPU")
    if not torchao:
        monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as when not installed
    device = torch.device("cuda:0")
    return resolve_fp8("auto", device, arch=arch, compute_dtype=compute_dtype, head_shape=head_shape)


def test_fp8_auto_is_linears_and_head_where_fp8_training_runs(monkeypatch):
    assert resolved_on(monkeypatch, (9, 0)) == "linears+head"
    assert resolved_on(monkeypatch, (8, 9)) == "linears+head"
    assert resolved_on(monkeypatch, (9, 0), head_shape=(250, 64)) == "linears"  # no FP8 GEMM takes the head


def test_fp8_auto_is_off_where_fp8_training_cannot_run(monkeypatch, caplog):
    cpu = torch.device("cpu")
    assert resolve_fp8("auto", cpu, arch="dflash", compute_dtype="bfloat16", head_shape=(4096, 256)) == "off"
    assert resolved_on(monkeypatch, (8, 0)) == "off"  # A100: no FP8 tensor cores
    assert resolved_on(monkeypatch, (9, 0), arch="dflash2") == "off"  # not yet judged by the table
    assert resolved_on(monkeypatch, (9, 0), compute_dtype="float32") == "off"
    with caplog.at_level(logging.WARNING, logger="train.drafter.fp8"):
        assert resolved_on(monkeypatch, (9, 0), torchao=False) == "off"
    assert "pip install 'dflash-pipeline[fp8]'" in caplog.text and "unusable" in caplog.text


def test_fp8_explicit_modes_are_kept(monkeypatch):
    for mode in ("off", "linears", "linears+head"):
        cpu = torch.device("cpu")
        assert resolve_fp8(mode, cpu, arch="dflash2", compute_dtype="float32", head_shape=(250, 64)) == mode


def test_dflash_train_records_the_mode_auto_chose(tmp_path):
    cache, run = tiny_cache(tmp_path / "cache", num_batches=3), tmp_path / "run"
    args = tiny_cli_args(cache, run, "--max-steps", "1", "--checkpoint-every", "1")
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert json.loads((run / "run.json").read_text())["config"]["fp8"] == "off"  # a CPU: bf16
    state = json.loads((run / "step-00000001" / "train_state.json").read_text())
    assert state["resolved_identity"]["fp8"] == "off"


def record_fp8(run: Path, mode: str) -> None:
    """Make step 1's train_state.json say it trained with --fp8 `mode` (its checksum dropped, as before one was kept)."""
    state_path = run / "step-00000001" / "train_state.json"
    state = json.loads(state_path.read_text())
    state["resolved_identity"]["fp8"] = mode
    del state["state_checksum"]
    state_path.write_text(json.dumps(state))


def test_a_resume_under_auto_keeps_its_checkpoints_mode(tmp_path):
    """Resumed with --fp8 auto, a run goes on in the mode its checkpoint trained with, not the one this
    machine would pick: a checkpoint that trained FP8 is refused on a CPU, naming the need, where a fresh
    run would train in bf16."""
    cache, run = tiny_cache(tmp_path / "cache", num_batches=3), tmp_path / "run"
    args = tiny_cli_args(cache, run, "--max-steps", "2", "--checkpoint-every", "1")
    assert CliRunner().invoke(main, args).exit_code == 0
    shutil.rmtree(run / "step-00000002")
    record_fp8(run, "linears+head")  # as an FP8 GPU's run records it
    res = CliRunner().invoke(main, [*args, "--resume"])
    assert res.exit_code == 1, res.output
    assert "step-00000001 trained with --fp8 linears+head, which a resumed run keeps" in res.output, res.output
    assert "--fp8 needs a CUDA GPU of compute capability 8.9+" in res.output, res.output
    assert not (run / "step-00000002").exists()
    res = CliRunner().invoke(main, [*args, "--resume", "--fp8", "off"])  # an explicit mode is compared, named
    assert res.exit_code == 1 and "--fp8" in res.output and "linears+head" in res.output, res.output


def test_a_resume_under_auto_trains_as_its_checkpoint_did_not_as_this_machine_would(tmp_path, monkeypatch):
    """A bf16 checkpoint resumed under auto on a machine where auto would pick FP8 goes on in bf16."""
    cache, run = tiny_cache(tmp_path / "cache", num_batches=3), tmp_path / "run"
    args = tiny_cli_args(cache, run, "--max-steps", "2", "--checkpoint-every", "1")
    assert CliRunner().invoke(main, args).exit_code == 0
    shutil.rmtree(run / "step-00000002")
    monkeypatch.setattr(train.loop, "resolve_fp8", lambda *a, **k: "linears+head")  # an FP8 GPU's pick
    res = CliRunner().invoke(main, [*args, "--resume"])
    assert res.exit_code == 0, res.output
    state = json.loads((run / "step-00000002" / "train_state.json").read_text())
    assert state["resolved_identity"]["fp8"] == "off"


def test_a_finished_fp8_run_reports_complete_where_fp8_cannot_run(tmp_path):
    cache, run = tiny_cache(tmp_path / "cache", num_batches=3), tmp_path / "run"
    args = tiny_cli_args(cache, run, "--max-steps", "1", "--checkpoint-every", "1")
    assert CliRunner().invoke(main, args).exit_code == 0
    record_fp8(run, "linears+head")
    res = CliRunner().invoke(main, [*args, "--resume"])
    assert res.exit_code == 0 and "already complete" in res.output, res.output


def test_a_checkpoint_recording_an_unknown_fp8_mode_is_refused_naming_it(tmp_path):
    cache, run = tiny_cache(tmp_path / "cache", num_batches=3), tmp_path / "run"
    args = tiny_cli_args(cache, run, "--max-steps", "2", "--checkpoint-every", "1")
    assert CliRunner().invoke(main, args).exit_code == 0
    shutil.rmtree(run / "step-00000002")
    record_fp8(run, "fp4")
    res = CliRunner().invoke(main, [*args, "--resume"])
    assert res.exit_code == 1 and "records --fp8 'fp4', not one of off, linears, linears+head" in res.output
    assert "step-00000001" in res.output, res.output
