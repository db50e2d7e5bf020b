"""Processes that must not outlive others, how the engine process says it cannot start, and
how a child of the supervisor says it came up (``mark_up``: its exit is judged by it).

The engine process and the fronts watch the processes they serve (their supervisor,
gunicorn's master) and drain when those are gone, whatever ended them, SIGKILL included.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ENGINE_BOOT_ERROR = 3  # the model did not load: restarting the engine would fail the same way
BOOT_FAILURE = "engine.failed"  # in the engine's directory: why it could not start, one line
# starts in a row that exited before they came up, after which a child is not started again
FAILED_STARTS = 5
_WATCH_S = 0.5


def watch(pids: Iterable[int], on_gone: Callable[[int], None]) -> threading.Thread | None:
    """Call ``on_gone(pid)`` when any of ``pids`` has exited (a pidfd where the system has
    them, so that a reused pid is never mistaken for the process), from a daemon thread."""
    watched = [pid for pid in pids if pid > 1]
    if not watched:
        return None
    handles = {pid: _pidfd(pid) for pid in watched}

    def run() -> None:
        while True:
            for pid, fd in handles.items():
                if not alive(pid, fd):
                    on_gone(pid)
                    return
            time.sleep(_WATCH_S)

    thread = threading.Thread(target=run, name="embedsvc-lifeline", daemon=True)
    thread.start()
    return thread


def _pidfd(pid: int) -> int | None:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except OSError:  # already gone, or not allowed: the pid itself is watched
        return None


def alive(pid: int, fd: int | None = None) -> bool:
    """Whether ``pid`` runs (through its pidfd ``fd``, when there is one)."""
    if fd is not None:
        readable, _, _ = select.select([fd], [], [], 0)
        return not readable  # a pidfd turns readable when its process exits
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs as another user: gunicorn's master under --user
        return True
    return True


def mark_up(directory: Path) -> None:
    """Say that this process came up (the supervisor judges its exit by it: ``came_up``)."""
    with contextlib.suppress(OSError):  # its supervisor is gone with the directory
        (directory / f"up-{os.getpid()}").touch()


def exit_status(code: int) -> str:
    """A child's exit, as a log line says it (``Popen.returncode``)."""
    return f"signal {-code}" if code < 0 else f"code {code}"


def is_up(directory: Path, pid: int) -> bool:
    """Whether the child ``pid``, which runs, has come up (its mark stays)."""
    return (directory / f"up-{pid}").exists()


def came_up(directory: Path, pid: int) -> bool:
    """Whether the child ``pid``, which exited, had come up; its mark goes."""
    try:
        (directory / f"up-{pid}").unlink()
    except OSError:
        return False
    return True
