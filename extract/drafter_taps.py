"""The target layers a drafter reads (`dflash-extract --taps-from DRAFTER`): a cache extracted with them
fits the drafter, so it can be fine-tuned (`dflash-train --init-from DRAFTER`) or evaluated on it.

A drafter directory's config.json (ours, z-lab's, SpecForge's: the DFlashDraftModel layout) names them
in dflash_config.target_layer_ids, in the "output of layer j" convention our --taps uses (vLLM and
SGLang add 1 when they index hidden_states; the file does not). Some writers put target_layer_ids at the
top level; that is read when dflash_config has none. The file is untrusted input: read bounded
(shards/common/json_input) and every field type-checked (shards/common/schema), refusals naming it.
"""

from __future__ import annotations

from pathlib import Path

from shards.common.json_input import InputFileError, read_json_object
from shards.common.schema import read_field

DRAFTER_CONFIG_FILE = "config.json"


def read_drafter_taps(drafter_dir: str | Path) -> list[int]:
    """dflash_config.target_layer_ids (else target_layer_ids) of `drafter_dir`/config.json."""
    path = Path(drafter_dir) / DRAFTER_CONFIG_FILE
    if not path.is_file():
        raise InputFileError(f"--taps-from {drafter_dir}: no {DRAFTER_CONFIG_FILE}; pass an exported drafter directory")
    config = read_json_object(path)
    dflash = read_field(config, "dflash_config", dict, str(path), {})
    taps = read_field(dflash, "target_layer_ids", list[int], str(path), None, "dflash_config.")
    if taps is None:
        taps = read_field(config, "target_layer_ids", list[int], str(path), None)
    if taps is None:
        raise InputFileError(
            f"{path}: neither dflash_config.target_layer_ids nor target_layer_ids names the drafter's target "
            "layers; pass them with --taps instead of --taps-from"
        )
    if not taps or any(t < 0 for t in taps) or sorted(set(taps)) != taps:
        raise InputFileError(
            f"{path}: target_layer_ids {taps} must be strictly increasing layer numbers >= 0; pass --taps instead"
        )
    return taps
