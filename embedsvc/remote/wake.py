"""A loop's wake-up from other threads: the engine's loop (finished jobs, /embed_all's
answers) and a front's link (frames to send, a reader that leaves).

One byte in a pipe the loop polls, written only while no wake-up is pending (``pending``),
so that a burst of wake-ups costs one write and one read. The loop drains the pipe, then
clears the flag (``woken``): a thread that wakes it while the pipe drains finds the flag
set and writes nothing, and what it asked for is seen by the loop's turn, which looks after
the drain; one after writes a byte the next poll sees. Cleared before the drain, a byte
written in between was drained with the flag left set, no later wake-up wrote again, and
the loop waited for its tick. Writing, draining and closing happen under one lock: a thread
that wakes a closed loop (work finished after it ended, a reader leaving a closed link)
writes into no descriptor at all, and a loop still turning after its close reads none,
not whatever took the pipe's number since.
"""

from __future__ import annotations

import contextlib
import os
import threading


class WakePipe:
    """The pipe, its pending flag, and its close; ``fileno`` is the end the loop polls."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        for fd in (self._r, self._w):
            os.set_blocking(fd, False)
        self.pending = False
        self._lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        return self._r

    def wake(self) -> None:
        """The loop's next poll returns (from any thread)."""
        if not self.pending:
            self.pending = True
            with self._lock, contextlib.suppress(OSError):  # a byte is there already
                if not self._closed:
                    os.write(self._w, b"\0")

    def woken(self) -> None:
        """Drained, then cleared (in the loop's thread, as its poll saw the pipe). Not
        once closed: a link closed while its thread still ran (its join timed out) read
        whatever had taken the pipe's number since."""
        with self._lock:
            if self._closed:
                return
            drain(self._r)
        self.pending = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for fd in (self._r, self._w):
                with contextlib.suppress(OSError):
                    os.close(fd)


def drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):  # a wake-up writes only while none is pending
        while os.read(fd, 4096):
            pass
