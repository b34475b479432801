"""z-lab's own DFlash code (the `dflash` package, dflash/model.py) as the tests' independent reference
(no tests here). It is imported only by tests, never copied into the project; `.ci/run` and the README's
test command install it without its pinned dependencies, which would downgrade tqdm and pull datasets."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

INSTALL = "pip install --no-deps dflash==0.1.0"


def zlab_reference() -> ModuleType:
    """dflash.model, or a skip naming the install command; under CI (CI=true) a failure instead, so CI can
    never pass by silently skipping the comparisons against the reference."""
    try:
        return importlib.import_module("dflash.model")
    except ImportError as e:
        reason = f"z-lab's reference implementation is not installed ({e}): {INSTALL}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason + " (CI=true: CI must run these tests, not skip them)")
        pytest.skip(reason)
