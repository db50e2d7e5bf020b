"""The lane for large bodies: their parsing takes turns, and a bounded share of the time.

orjson and pydantic hold the GIL while they build a body's objects: about 14 ms a megabyte
for a body of token ids, so 0.23 s for a 16 MB one, during which no other request thread
parses, tokenizes, answers or hands rows back. A client sending such bodies back to back
would stop every other client most of the time, whatever the device's turns say. A body
of ``LARGE_BODY_BYTES`` or more is therefore parsed in the lane: one at a time, in the order
they arrived (a client sending them back to back queues behind the others' bodies, never
ahead of them), and after a parse of t seconds the lane stays shut for t x (1 / share - 1),
so that large bodies hold the GIL for at most ``share`` of the time. A body that is refused
(not JSON, a wrong item, too many inputs) costs the lane only its own parse: the next body
goes at once, since shutting the lane after it would make the bodies behind it wait (or get
504) for a request that is already answered, and its parse is bounded by its size
(api/shapes.py). Smaller bodies never wait for the lane. At most
``LANE_WAITING`` bodies wait behind the one being parsed: each holds a request thread, and
more would leave none for the small requests (16 threads by default); the next one gets 429
with the time the queue needs in ``Retry-After``.

>>> lane = BodyLane(share=0.5)
>>> lane.run(lambda: "parsed", deadline=time.monotonic() + 1)
'parsed'
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from ..errors import DeadlineExceeded, Overloaded

LARGE_BODY_BYTES = 1 << 20  # a body of ids this large parses in about 15 ms
BODY_SHARE = 0.25  # of the time, at most, spent parsing large bodies
LANE_WAITING = 4  # large bodies that may wait behind the one being parsed

T = TypeVar("T")


class BodyLane:
    """Large bodies' parsing, one at a time in arrival order, and at most ``share`` of the
    time."""

    def __init__(self, share: float = BODY_SHARE, waiting: int = LANE_WAITING) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], not {share}")
        self.share = share
        self.waiting = waiting
        self._cycle = 0.0  # the last parse and the shut time after it, in seconds
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()  # waiting bodies, the one whose turn it is first
        self._open_at = 0.0  # monotonic time at which the next parse may start

    def run(self, parse: Callable[[], T], deadline: float) -> T:
        """``parse()`` in its turn; 504 when its turn would come after ``deadline``."""
        self._wait_turn(ticket := object(), deadline)
        try:
            now = time.monotonic()
            if self._open_at > deadline:
                raise late()
            if self._open_at > now:
                time.sleep(self._open_at - now)
            started = time.monotonic()
            try:
                parsed = parse()
            except BaseException:  # refused: the next body goes at once
                self._cycle = time.monotonic() - started
                self._open_at = started + self._cycle
                raise
            self._cycle = (time.monotonic() - started) / self.share
            self._open_at = started + self._cycle
            return parsed
        finally:
            self._leave(ticket)

    def _wait_turn(self, ticket: object, deadline: float) -> None:
        with self._cond:
            if len(self._queue) > self.waiting:  # one parsing, ``waiting`` behind it
                ahead = max(0.0, self._open_at - time.monotonic()) + self._cycle * self.waiting
                raise Overloaded(
                    f"{len(self._queue)} large bodies ({LARGE_BODY_BYTES >> 20} MiB or more) wait "
                    "to be parsed, one at a time; retry after the time in Retry-After, or send "
                    "smaller requests",
                    retry_after_s=max(1, math.ceil(ahead)))
            self._queue.append(ticket)
            while self._queue[0] is not ticket:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._queue.remove(ticket)
                    raise late()
                self._cond.wait(left)

    def _leave(self, ticket: object) -> None:
        with self._cond:
            self._queue.remove(ticket)
            self._cond.notify_all()


def late() -> DeadlineExceeded:
    return DeadlineExceeded(
        "the request's body waited past its deadline (REQUEST_TIMEOUT_S) for its turn to be "
        f"parsed: bodies of {LARGE_BODY_BYTES >> 20} MiB and more are parsed one at a time; "
        "retry, or send smaller requests",
        code="timeout",
    )
