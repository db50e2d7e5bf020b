"""What an adapter needs from a server library's internals: one check for every adapter.

>>> missing_internals("waitress", ((3, 0), (3, 1)), {str: ("join", "no_such")})
['str.no_such']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from importlib.metadata import version
from typing import Any


def missing_internals(package: str, supported: tuple[tuple[int, int], tuple[int, int]],
                      internals: Mapping[Any, Iterable[str]]) -> list[str]:
    """The attributes of ``internals`` that are gone, and ``package``'s version if it is
    outside the ``supported`` [low, high) range; empty when all is there."""
    missing = []
    major_minor = tuple(int(p) for p in version(package).split(".")[:2])
    if not supported[0] <= major_minor < supported[1]:
        missing.append(f"{package} {version(package)} is outside the tested range {supported}")
    for owner, names in internals.items():
        label = getattr(owner, "__name__", str(owner))
        missing += [f"{label}.{n}" for n in names if not hasattr(owner, n)]
    return missing
