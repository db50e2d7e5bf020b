"""Ctrl-C and SIGTERM during ``embedsvc embed``: keep the rows computed, and go at once.

The first SIGINT or SIGTERM stops the job. Inside ``interruptible`` (the checks, loading the
model, counting the input, joining the parts: work that keeps nothing when cut short)
``Interrupted`` is raised at once. While rows are computed and written the signal is noted,
and the job stops at its next safe point (``check``; it polls every ``POLL_S``), so that it
can commit the rows computed without a half-written chunk in the part. Anywhere else, as
from the moment the joined output is renamed into place, it is only noted: the job ends as
it would have, its output whole, and its last line says the signal came (``signum``), never
that nothing was kept. After the first signal both signals are back to the system's
default, so a second one ends the process at once, whatever it is doing: nothing is
corrupted, since parts, manifest and output are only ever replaced whole (written aside,
then renamed).
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

        with StopSignals() as stop:
            with stop.interruptible():
                ...  # load, count: stopped at once
            ...  # write rows; stop.check() at each safe point
            if stop.signum is not None:
                ...  # it came once nothing could be stopped any more
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.raised = False  # an ``Interrupted`` was raised: the job did not finish
        self._interruptible = False
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
        if self._interruptible:
            self.check()

    @contextmanager
    def interruptible(self) -> Iterator[StopSignals]:
        """Within: a signal raises ``Interrupted`` at once (one noted before, on entry)."""
        self._interruptible = True
        try:
            self.check()
            yield self
        finally:
            self._interruptible = False

    def check(self) -> None:
        if self.signum is not None:
            self.raised = True
            raise Interrupted(self.signum)
