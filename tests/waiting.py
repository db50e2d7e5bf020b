"""Waiting in tests for what another thread or process does, without a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable


def soon(condition: Callable[[], object], timeout: float = 10.0) -> bool:
    """Whether ``condition()`` holds within ``timeout`` seconds (looked at every 10 ms)."""
    until = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > until:
            return False
        time.sleep(0.01)
    return True
