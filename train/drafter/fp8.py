"""FP8 training of the drafter's linear layers (TrainConfig.fp8), on torchao's float8 training.

Which layers: every `Linear` of the backbone (fc, q/k/v/o, gate/up/down), the GEMMs that are ~2/3 of a
27B-width step. DFlash 2's kernel projections (H -> 2 x taps x groups, 320 outputs at 27B width) and
the selector's hidden projection (H -> rank) stay in bf16: each is well under 1% of the step's FLOPs
while its FP8 casts read and write the whole [Q, H] input and the weight again, so they cost more than
they save, and both start at zero (inert DFlash 2 start), where a per-tensor scale is all clamp. A
linear whose dimensions are not multiples of 16 (cuBLAS FP8's layout rule) stays in bf16 as well.

How (torchao Float8Linear, swapped in place of each chosen Linear): the forward casts the input and
the weight to e4m3 and runs the GEMM in FP8; the backward casts the output gradient to e5m2 (recipe
"tensorwise", one scale per tensor, cuBLAS) or to e4m3 with one scale per row (recipe "rowwise",
power-of-two scales, CUTLASS). The swapped module keeps the same fp32 Parameter, so the optimizer, the
flat gradients, checkpoints and export see plain tensors under the same names. Scales are dynamic: each
amax is a device reduction and each scale a device tensor, so nothing syncs to the host and the step
still captures as one CUDA graph of fixed shapes.

With working weights (precision.WorkingWeights): an FP8 linear casts its fp32 master straight to FP8
at each use (one read of the master; a bf16 copy in between would only add a rounding), so the copies
cover the linears that stay in bf16. With compiled pointwise regions: each FP8 linear's forward is
compiled too (its amax, scale and cast fuse into a few kernels instead of a pass each), under the same
raised recompile limit.

FP8 GEMMs need compute capability 8.9 (Ada, Hopper) or newer; elsewhere an explicit `--fp8 linears` or
`linears+head` is refused. The default, `auto`, is `linears+head` for a DFlash 1 drafter wherever those run
(a CUDA GPU of 8.9+, torchao installed, bf16 compute) and off elsewhere (`resolve_fp8`): the acceptance
testbed found FP8-trained DFlash 1 drafters within the seed spread of bf16 ones on every column
(BENCHMARKS.md, "Acceptance by numerics choice"), and the step is 1.44x faster at 27B width. DFlash 2
stays bf16 under auto until the table's `dflash2-fp8-train` row has judged it (the selector reads the
FP8 head's logits too). A resumed run keeps the mode its checkpoint trained with.
`emulate` (not a user flag: build_step_state(fp8_emulate=True), the CPU tests) runs the same casts and
dequantised matmuls in high precision on any device.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn as nn

from shards.common.errors import UserError
from train.drafter.config import DFLASH1
from train.drafter.linear import Linear

log = logging.getLogger(__name__)

FP8_MODES = ("off", "linears", "linears+head")  # what a run trains with
AUTO = "auto"  # TrainConfig.fp8's default: resolve_fp8 picks one of FP8_MODES
AUTO_MODE = "linears+head"  # what auto picks where FP8 training runs: the testbed's fp8-train row
FP8_RECIPES = ("tensorwise", "rowwise")  # TrainConfig.fp8_recipe: torchao's recipe names, the default first
MIN_CAPABILITY = (8, 9)  # the first compute capability with FP8 tensor cores (Ada); Hopper is 9.0
BF16_LINEARS = ("kernel_projection", "hidden_projection")  # DFlash 2's, see the module docstring
INSTALL_HINT = "pip install 'dflash-pipeline[fp8]'"


def require_fp8(device: torch.device, *, emulate: bool) -> None:
    """Refuse --fp8 without torchao, or where no FP8 GEMM runs: a CPU (unless emulated), a GPU below
    compute capability 8.9."""
    _torchao_float8()
    if emulate:
        return
    if device.type != "cuda":
        raise UserError(
            f"--fp8 needs a CUDA GPU of compute capability 8.9+ (FP8 GEMMs); device is {device}: drop --fp8"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise UserError(
            f"--fp8 needs compute capability 8.9+ (Ada, Hopper: FP8 tensor cores); {torch.cuda.get_device_name(device)} "
            f"is {capability[0]}.{capability[1]}: drop --fp8"
        )


def resolve_fp8(
    mode: str,
    device: torch.device,
    *,
    arch: str,
    compute_dtype: str,
    head_shape: tuple[int, int],
    recipe: str = FP8_RECIPES[0],
) -> str:
    """--fp8 as this run trains: `mode` itself unless it is auto, which is AUTO_MODE where FP8 training
    runs (the module docstring), `linears` where the head's GEMMs cannot (head_shape = vocabulary x hidden,
    not multiples of 16) and off elsewhere, each choice logged with its reason. An auto that comes out off
    refuses a --fp8-recipe other than the default, which would do nothing."""
    if mode != AUTO:
        return mode
    why_not = _why_no_fp8(device, compute_dtype, arch)
    if why_not is not None:
        if recipe != FP8_RECIPES[0]:
            raise UserError(f"--fp8-recipe {recipe}: --fp8 auto trains in bf16 here ({why_not}); drop --fp8-recipe")
        log.info("--fp8 auto: off (%s)", why_not)
        return "off"
    if head_shape[0] % 16 or head_shape[1] % 16:
        log.info("--fp8 auto: linears (the LM head is %d x %d; FP8 GEMMs need multiples of 16)", *head_shape)
        return "linears"
    log.info(
        "--fp8 auto: %s (FP8 GEMMs on %s; --fp8 off trains in bf16)", AUTO_MODE, torch.cuda.get_device_name(device)
    )
    return AUTO_MODE


def _why_no_fp8(device: torch.device, compute_dtype: str, arch: str) -> str | None:
    if device.type != "cuda":
        return f"device {device}: FP8 GEMMs need a CUDA GPU"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"{torch.cuda.get_device_name(device)} is compute capability {capability[0]}.{capability[1]}, below 8.9"
    if compute_dtype != "bfloat16":
        return f"--compute-dtype {compute_dtype}: FP8 replaces bf16 matmuls only"
    if arch != DFLASH1:
        return f"--arch {arch}: not yet judged by the acceptance table; --fp8 linears+head opts in"
    try:
        _torchao_float8()
    except Exception as e:  # not installed, or an install that fails to import: the default must still run
        log.warning("--fp8 auto: torchao's float8 training is unusable (%s); training in bf16: %s", e, INSTALL_HINT)
        return "torchao's float8 training is unusable"
    return None


def _torchao_float8():
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise UserError(f"--fp8 needs torchao's float8 training, which is not installed ({e}): {INSTALL_HINT}") from e
    return float8


def _goes_fp8(module: nn.Module, fqn: str) -> bool:
    return (
        isinstance(module, Linear)
        and fqn.rsplit(".", 1)[-1] not in BF16_LINEARS
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def float8_linears_(model: nn.Module, recipe: str, *, emulate: bool = False) -> list[str]:
    """Swap the chosen Linears of `model` (module docstring) for torchao Float8Linears; their names."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe must be one of {FP8_RECIPES}, got {recipe!r}")
    float8 = _torchao_float8()
    chosen = [name for name, module in model.named_modules() if _goes_fp8(module, name)]
    config = dataclasses.replace(
        # pad_inner_dim: _scaled_mm needs inner dimensions that are multiples of 16, and the weight
        # gradient's inner dimension is the row count (the cache's token budget, the blocks' tokens).
        float8.Float8LinearConfig.from_recipe_name(recipe),
        emulate=emulate,
        pad_inner_dim=True,
    )
    float8.convert_to_float8_training(model, config=config, module_filter_fn=_goes_fp8)
    kept = [name for name, module in model.named_modules() if isinstance(module, Linear)]
    log.info(
        "fp8: %d linear layers on torchao float8 training (%s recipe%s); %d stay bf16%s",
        len(chosen),
        recipe,
        ", emulated" if emulate else "",
        len(kept),
        f" ({', '.join(sorted({n.rsplit('.', 1)[-1] for n in kept}))})" if kept else "",
    )
    return chosen


def float8_modules(model: nn.Module) -> list[nn.Module]:
    """The modules float8_linears_ swapped in (empty when torchao is absent or nothing was swapped)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, Float8Linear)]
