"""Ctrl-C and SIGTERM during ``embedsvc embed``: keep the rows computed, and go at once.

The first SIGINT or SIGTERM stops the job. While rows are being written (inside
``deferred``) the signal is only noted and the job stops at its next safe point (it polls
every ``POLL_S``), so that it can commit the rows computed without a half-written chunk in
the part; elsewhere (checks, loading the model, joining the parts) ``Interrupted`` is raised
at once. After the first signal both signals are back to the system's default, so a second
one ends the process at once, whatever it is doing: nothing is corrupted, since parts and
manifest are only ever replaced whole (written aside, then renamed).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any

POLL_S = 0.05  # how long a signal may wait for the job's next safe point
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The job was stopped by ``signum``; ``saved`` says what was kept, once known."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.saved: str | None = None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # as a shell reports a process ended by the signal


class StopSignals:
    """SIGINT and SIGTERM for one job, as a context manager (main thread only; elsewhere,
    where signals cannot be caught, it does nothing)::

        with StopSignals() as stop, stop.deferred():
            ...  # write rows; stop.check() at each safe point
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._deferred = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in _SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.signum is None:  # after a signal the defaults stay: a second one ends it
            for s, handler in self._previous.items():
                signal.signal(s, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        for s in _SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        if not self._deferred:
            raise Interrupted(signum)

    @contextmanager
    def deferred(self) -> Iterator[StopSignals]:
        """Within: a signal is noted, and raised by the next ``check``."""
        self._deferred = True
        try:
            self.check()
            yield self
        finally:
            self._deferred = False

    def check(self) -> None:
        if self.signum is not None:
            raise Interrupted(self.signum)
