"""Identity of a run's settings: what a resumed run must find unchanged, compared in one place.

Extraction compares the identity its cache recorded with this run's; training compares the identity its
checkpoint recorded with the run's resolved settings and its cache. Both record JSON dicts (nested where
a setting has parts, as the dataset does); `differences` walks two of them and returns one `Difference`
per leaf that differs, under its dotted key, so each refusal can name the flag that sets it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Difference:
    key: str  # dotted path of the leaf ("dataset.fingerprint")
    recorded: object  # what the cache or checkpoint recorded (None: absent)
    now: object  # what this run has (None: absent)

    def describe(self, recorded_as: str, now_as: str, name: Callable[[str], str] = str, show=repr) -> str:
        """One line of a refusal: `name(key): <recorded_as> <recorded>, <now_as> <now>`."""
        return f"{name(self.key)}: {recorded_as} {show(self.recorded)}, {now_as} {show(self.now)}"


def differences(recorded: Mapping, now: Mapping, prefix: str = "") -> list[Difference]:
    """Every leaf of `recorded` and `now` whose values differ, in key order; dicts on both sides are walked."""
    found = []
    for key in sorted(set(recorded) | set(now)):
        a, b = recorded.get(key), now.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            found += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append(Difference(f"{prefix}{key}", a, b))
    return found
