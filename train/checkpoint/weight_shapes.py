"""A drafter's weight files against the shape its config describes, from the files' headers alone.

A config (train_state.json's drafter, an export's config.json) is compared with the tensors its
weights hold before any model is built or tensor read: a config inflated past its weights once had
the model allocated (80 GB asked for) before the shapes were compared. Refusals name the tensor, the
file, and the shapes found and expected.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from shards.container import read_header
from shards.format import CacheFormatError
from train.drafter.config import DrafterConfig
from train.drafter.model import DFlashDrafter

_NAMES_SHOWN = 5  # extra or missing tensor names listed in a refusal
_LAYER = re.compile(r"^layers\.(\d+)\.")  # z-lab's per-layer names: layers.{i}.<...>


def drafter_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name (z-lab's, and a projected drafter's context_projection) -> shape of the drafter `cfg`
    describes; built on the meta device, so nothing is allocated whatever the sizes."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in DFlashDrafter(cfg).state_dict().items()}


def header_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Tensor name -> (shape, file) over safetensors files, from their headers (bounded, checked)."""
    found = {}
    for f in files:
        try:
            entries = read_header(f).entries
        except CacheFormatError as e:
            raise ValueError(
                f"{f}: unreadable ({str(e).removeprefix(f'{f}: ')}): damaged or partial; export (or download) "
                "the drafter again"
            ) from e
        found.update({name: (entry.shape, f) for name, entry in entries.items()})
    return found


def check_weight_shapes(files: list[Path], cfg: DrafterConfig, where: Path | str, described_by: str) -> None:
    """Refuse (ValueError) weight files whose tensor names or shapes differ from the drafter `cfg`
    (read from `described_by`) describes; `where` is what lists the files, for the names' refusal."""
    found = header_shapes(files)
    layers = {int(m.group(1)) for name in found if (m := _LAYER.match(name))}
    if layers != set(range(cfg.num_layers)):  # before the shapes: a model of 10**6 layers is slow even on meta
        raise ValueError(
            f"{where}: the weights hold layers {_span(layers)}, {described_by} describes {cfg.num_layers} "
            f"(layers {_span(set(range(cfg.num_layers)))}); the weights and {described_by} are not of one drafter"
        )
    expected = drafter_shapes(cfg)
    extra, missing = sorted(set(found) - set(expected)), sorted(set(expected) - set(found))
    if extra or missing:
        raise ValueError(
            f"{where}: tensor names differ from DFlashDraftModel: extra {extra[:_NAMES_SHOWN]}, "
            f"missing {missing[:_NAMES_SHOWN]}"
            + (
                f" ({len(extra)} extra and {len(missing)} missing in all)"
                if max(len(extra), len(missing)) > _NAMES_SHOWN
                else ""
            )
        )
    for name, want in expected.items():
        shape, f = found[name]
        if shape != want:
            raise ValueError(
                f"{f}: tensor {name} has shape {list(shape)}, {described_by} describes {list(want)}; the "
                f"weights and {described_by} are not of one drafter"
            )


def _span(layers: set[int]) -> str:
    """0-4 for a run of layers, else the sorted list (cut short)."""
    ordered = sorted(layers)
    if not ordered:
        return "none"
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return f"{ordered[:_NAMES_SHOWN]}{'...' if len(ordered) > _NAMES_SHOWN else ''}"
