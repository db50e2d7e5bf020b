"""A raw connection to an engine's socket, as a front's link makes it, for tests that speak
the engine's frames themselves (remote/stream.py's framing, remote/wire.py's frames)."""

from __future__ import annotations

import select
import time
from collections import deque
from typing import Any

from embedsvc.remote import wire
from embedsvc.remote.stream import connect


def answers_in(frame: Any) -> list[Any]:
    """A frame from the engine as one item a request, as a front routes it: an ``Answers``
    opened, and each row of a ``Rows`` as its ``wire.Row``."""
    out: list[Any] = []
    for item in frame.items if isinstance(frame, wire.Answers) else [frame]:
        if isinstance(item, wire.Rows):
            out += [wire.Row(item, k) for k in range(len(item.ids))]
        else:
            out.append(item)
    return out


class FrameSocket:
    """``send`` a frame's bytes, ``poll`` for the next frame, ``recv`` it (blocking)."""

    def __init__(self, address: str) -> None:
        self.stream = connect(address)
        self._frames: deque[bytes] = deque()

    def send(self, data: bytes) -> None:
        self.stream.send(data)
        while self.stream.pending and not self.stream.closed:
            select.select([], [self.stream], [], 5)
            self.stream.flush()

    def poll(self, timeout_ms: int) -> bool:
        """Whether a frame is there within ``timeout_ms``."""
        deadline = time.monotonic() + timeout_ms / 1000
        while not self._frames and not self.stream.closed:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.stream], [], [], left)[0]:
                return False
            self._frames.extend(bytes(frame) for frame in self.stream.read())
        return bool(self._frames)

    def recv(self) -> bytes:
        assert self.poll(10_000), "no frame from the engine"
        return self._frames.popleft()

    def close(self) -> None:
        self.stream.close()
