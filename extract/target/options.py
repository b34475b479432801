"""ForwardOptions: the switches of the target forward's memory-traffic cuts, kept apart from the model so
that the layers and the FP8 linear code (extract/target/fp8/linear.py) both read them without importing
each other. One instance is shared by TargetModel, its layers and its Pointwise table."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(kw_only=True)
class ForwardOptions:
    """Switches for the forward's memory-traffic cuts. All on by default; off runs the earlier code
    path, so that tools/bench/extract.py can time each in one run (TargetModel.set_forward_options).
    On or off, the results agree: exactly in eager mode, to rounding under torch.compile and the
    Triton feed kernels (same roundings, another summation order)."""

    # The MLP's residual add runs inside the next layer's input norm (and its FP8 quantisation): one
    # pass less over the [T, H] residual per layer; the sum is materialised only at taps and the end.
    fuse_residual: bool = True
    # The GatedDeltaNet conv runs once per q / k / v channel group: each output is contiguous, so
    # fla's chunk_gated_delta_rule (which makes its inputs contiguous) no longer copies [T, E].
    split_conv: bool = True
    # FP8 compute: each LINEAR_GROUPS entry (linear layers reading one input) is one matmul over the
    # concatenated weights; its outputs are column slices (views). GatedDeltaNet's dense a|b too.
    concat_linears: bool = True
    # FP8 compute: the pointwise ops feeding FP8 matmuls (norms, gated norm, silu-mul, each with its
    # quantisation) run as the Triton kernels of extract/target/fp8/kernels.py, one read of each row, where
    # the kernel choice has them (CUDA with triton); off: the torch.compile'd functions.
    feed_kernels: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, bool):
                raise ValueError(f"ForwardOptions.{field.name} must be True or False, found {value!r}")
