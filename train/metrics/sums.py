"""Named sums: device accumulators kept in one float64 tensor, so one all-reduce and one host copy
serve a whole log interval (training metrics) or a whole evaluation.

    sums = Sums({"steps": 1, "loss/ce": 1, "top1_slot": S, "top1_slot.count": S}, device)
    sums.add("steps", 1.0); sums.add("top1_slot", correct_S); sums.add("top1_slot.count", valid_S)
    host = sums.reduce_to_host()        # SUM across ranks, then the one device -> host copy
    host.mean("top1_slot")              # top1_slot / top1_slot.count per element; None where count is 0

Ratios are kept as (sum, count) pairs and divided only after the SUM all-reduce, so averages are
exact across ranks and over steps of different sizes. `add` is in-place on a fixed slice of one
fixed tensor: no host sync, no allocation that changes shape, so it can sit inside a CUDA graph.
float64 keeps long intervals exact (counts to 2^53).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from train.distributed import all_reduce_sum_

COUNT = ".count"  # suffix of the count that a sum is divided by by default (name + COUNT)


class Sums:
    """Named float64 sums in one flat device tensor; name -> a slice of `flat`."""

    def __init__(self, sizes: Mapping[str, int], device: torch.device | str):
        self.slices: dict[str, slice] = {}
        offset = 0
        for name, size in sizes.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"Sums: field {name!r} needs a size >= 1, got {size!r}")
            self.slices[name] = slice(offset, offset + size)
            offset += size
        self.flat = torch.zeros(offset, dtype=torch.float64, device=device)

    def view(self, name: str) -> torch.Tensor:
        """The live [size] slice of `name` (a view into `flat`)."""
        return self.flat[self.slices[name]]

    def add(self, name: str, value: torch.Tensor | float) -> None:
        """flat[name] += value: a scalar (also broadcast over a vector field) or a [size] tensor."""
        view = self.view(name)
        if isinstance(value, torch.Tensor):
            # Host-side counts (the walk's) join device sums: the copy goes to the sums' device.
            value = value.detach().to(device=view.device, dtype=torch.float64).reshape(-1)
        view += value

    def reset(self) -> None:
        self.flat.zero_()

    def reduce_to_host(self, local: torch.Tensor | None = None) -> HostSums:
        """SUM all-reduce across ranks (in place), then one host copy; `local` (a small rank-local
        tensor, not reduced) rides along in the same copy and comes back as HostSums.local."""
        all_reduce_sum_(self.flat)
        if local is None:
            return HostSums(self.slices, self.flat.cpu().tolist(), [])
        host = torch.cat([self.flat, local.detach().reshape(-1).to(torch.float64)]).cpu().tolist()
        n = self.flat.numel()
        return HostSums(self.slices, host[:n], host[n:])


class HostSums:
    """Reduced sums on the host: `values[name]` is a list of floats (one per element of the field)."""

    def __init__(self, slices: Mapping[str, slice], flat: list[float], local: list[float]):
        self.values = {name: flat[sl] for name, sl in slices.items()}
        self.local = local

    def __getitem__(self, name: str) -> list[float]:
        return self.values[name]

    def scalar(self, name: str) -> float:
        (value,) = self.values[name]
        return value

    def mean(self, name: str, count: str | None = None) -> list[float | None]:
        """values[name] / values[count] element by element (a 1-element count divides every element);
        None where the count is 0. count defaults to name + '.count'."""
        sums, counts = self.values[name], self.values[count or name + COUNT]
        if len(counts) == 1:
            counts = counts * len(sums)
        if len(counts) != len(sums):
            raise ValueError(f"Sums: {name} has {len(sums)} elements, its count {count} has {len(counts)}")
        return [s / c if c else None for s, c in zip(sums, counts)]
