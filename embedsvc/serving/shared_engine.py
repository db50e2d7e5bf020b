"""One engine process for all the workers of one gunicorn master (``gunicorn -w N``).

Who starts it: the first worker that needs it (its first request, or ``warm`` in
``post_worker_init``), with or without ``--preload``: under a lock in the master's private
directory, it starts ``python -m embedsvc engine`` as a new program, in a session of its
own, watching the master's pid. Every other worker finds it there and connects. When a
worker finds it gone (killed, crashed), the first to take the lock starts another one; the
requests that were in the old one get 503 with ``Retry-After``.

Who stops it: the master's death, whatever its cause. The engine watches the master's pid
and drains when it is gone, so a SIGTERM (graceful: the workers finish their requests, then
the master exits), a SIGINT, or a SIGKILL of the master leaves no engine behind; the workers
themselves notice their master's death and exit, as gunicorn's workers do.

An engine that cannot load the model stops gunicorn: the worker that learns it (the one
that started it, or the next to look) exits with gunicorn's WORKER_BOOT_ERROR after one line
naming the cause, and the master halts on that exit, as `embedsvc serve --workers` stops.
Several models that do not fit their devices (serving/memory.py) stop it the same way,
before any engine starts: the first worker to build its app weighs them, once a master.

The master never loads the model, touches a device or opens an ONNX Runtime session, so no
worker is ever forked from a process that holds one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ..remote.place import model_dir, owner_dir
from ..settings import Settings
from .lifeline import (
    BOOT_FAILURE,
    ENGINE_BOOT_ERROR,
    FAILED_STARTS,
    alive,
    came_up,
    exit_status,
)

log = logging.getLogger(__name__)

WORKER_BOOT_ERROR = 3  # gunicorn's arbiter halts, exiting with it, when a worker exits so

# locked (flock) by the engine process for its whole life: taken by the worker that starts
# it and handed over as an inherited descriptor, so there is no moment between the start
# and the engine's own first line where another worker could find it free
_ALIVE_FILE = "engine.alive"
_FAILED_STARTS_FILE = "engine.failed-starts"  # starts in a row that never came up
_STARTED_FILE = "engine.started"  # the pid of the last engine started
_EXIT_PREFIX = "engine.exit-"  # and its pid: how it ended, written by its reaper
# a start that fails with one of these will fail the same way each time: the program is not
# there, or cannot be run
_CANNOT_RUN = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOEXEC,
                         errno.ENOTDIR})
_LOCK_FILE = "engine.lock"
_WEIGHED = "memory.checked"  # the models' memory was weighed for this master
# How long a worker that stands down leaves its master to reap the worker that gave up
_STAND_DOWN_S = 2.0


def gunicorn_workers() -> int | None:
    """How many workers the gunicorn that runs this code was told to run (None: not in a
    gunicorn master or worker). Found on the stack: gunicorn calls the app, and loads it,
    from methods of its worker (or, with --preload, its arbiter), which hold its config."""
    try:
        from gunicorn.arbiter import Arbiter
        from gunicorn.workers.base import Worker
    except ImportError:
        return None
    if "gunicorn.arbiter" not in sys.modules:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Worker | Arbiter):
            return int(owner.cfg.workers)
        frame = frame.f_back  # type: ignore[assignment]
    return None


def engine_owner(settings: Settings, workers: int | None) -> int | None:
    """The pid whose life the engine process follows, when the model goes in one: gunicorn's
    master when its workers share one (ENGINE=auto and more than one worker, or
    ENGINE=process), this process for ENGINE=process under another server (waitress-serve);
    None when the model is in the serving process itself."""
    if settings.engine == "inline":
        return None
    if workers is not None and (workers > 1 or settings.engine == "process"):
        return os.getppid()
    return os.getpid() if settings.engine == "process" else None


class SharedEngine:
    """The engine process that serves while ``master_pid`` lives, started on demand."""

    def __init__(self, settings: Settings, master_pid: int, index: int = 0) -> None:
        self.settings = settings
        self.master_pid = master_pid
        self.root = owner_dir(master_pid)
        self.index = index  # which of several models (catalog.py): one engine each
        self.directory = model_dir(self.root, index)

    def ensure(self) -> str | None:
        """Start the engine unless one is running (any worker may call it, at any time);
        why not, when the last one could not load the model (it is not started again).
        Under gunicorn that ends this worker with gunicorn's WORKER_BOOT_ERROR, on which
        its master stops the other workers and exits non-zero, as `embedsvc serve
        --workers` does: requests would only wait for an engine that cannot come."""
        if not alive(self.master_pid):  # its master is gone: this worker is about to go too
            return None
        try:
            with _locked(self.directory):
                failed = self.directory / BOOT_FAILURE
                if not failed.exists():
                    self._start()
                if failed.exists():
                    why = failed.read_text()
                    _give_up(self.root, self.master_pid, "the engine process could not "
                             f"start: {why.strip()}; fix it, then start gunicorn again")
                    return "the engine process could not start: " + why
                return None
        except FileNotFoundError:  # another worker gave up: its master is stopping
            _stand_down(self.master_pid)
            return "the engine process could not start; the server log says why"

    def _start(self) -> None:
        """The engine process, unless one is running; under the lock. Whether one runs is
        its life lock's to say, not a pid file's: a worker that died between the start and
        the pid file's write left a running engine unlisted (and the next worker started a
        second one, a second copy of the model), and a pid taken over by another engine
        process read as this one running."""
        alive = os.open(self.directory / _ALIVE_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(alive, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # an engine holds it: running (or starting)
                return
            why = self._count_exit()
            if why is not None:
                (self.directory / BOOT_FAILURE).write_text(why)
                return
            cmd = [sys.executable, "-m", "embedsvc", "engine", "--runtime-dir",
                   str(self.directory), "--watch-pid", str(self.master_pid)]
            if self.index:
                cmd += ["--model-index", str(self.index)]
            env = {**os.environ, **self.settings.to_env()}
            try:  # the lock goes with the descriptor: the engine holds it until it exits
                proc = subprocess.Popen(cmd, env=env, start_new_session=True, pass_fds=[alive])
            except OSError as exc:
                if exc.errno in _CANNOT_RUN:  # the interpreter gone (a venv replaced by a deploy)
                    (self.directory / BOOT_FAILURE).write_text(
                        f"{cmd[0]} could not be run: {exc}")
                else:  # out of processes, memory or descriptors for now: the next look retries
                    log.warning("the engine process could not be started (%s); trying again",
                                exc)
                return
            # reap it when it exits (its parent is this process), so that it leaves no zombie
            threading.Thread(target=self._reap, args=(proc,), name="embedsvc-engine-reaper",
                             daemon=True).start()
            try:
                (self.directory / _STARTED_FILE).write_text(str(proc.pid))
            except OSError as exc:  # a full disk: it serves all the same
                log.warning("the engine process's start could not be noted (%s): its exit "
                            "will not be counted", exc)
        finally:
            os.close(alive)  # this worker's copy; an engine started holds its own
        log.info("process %d started the engine process (pid %d), shared while process "
                 "%d lives", os.getpid(), proc.pid, self.master_pid)

    def _reap(self, proc: subprocess.Popen) -> None:
        """Wait for the engine this worker started (its parent), so that it leaves no
        zombie, and say how it ended: in the log, and to whichever worker starts the next
        one (``_count_exit``). One that could not load the model stops gunicorn now."""
        code = proc.wait()
        with contextlib.suppress(OSError):  # its master is stopping (the directory gone)
            # whole or not at all: a worker that counts it meanwhile read an empty status
            aside = self.directory / f".{_EXIT_PREFIX}{proc.pid}.tmp"
            aside.write_text(exit_status(code))
            os.replace(aside, self.directory / f"{_EXIT_PREFIX}{proc.pid}")
        if code != ENGINE_BOOT_ERROR:
            log.log(logging.WARNING if code else logging.INFO,
                    "the engine process (pid %d) exited with %s", proc.pid, exit_status(code))
            return
        failed = self.directory / BOOT_FAILURE  # the model did not load: it wrote why, if it could
        with contextlib.suppress(OSError):
            if not failed.exists():
                failed.write_text("the engine process could not load the model (the server "
                                  "log says why)")
        self.ensure()  # gives up now, rather than at a keeper's next look

    def _count_exit(self) -> str | None:
        """The last engine started, which no longer runs (its life lock is free), counted,
        under the lock: why to start none again, after ``FAILED_STARTS`` in a row that
        exited before they came up (killed as they loaded, a native library's crash), as
        `embedsvc serve --workers` stops; else None. Counted here, as the next starts, not
        by the worker that started it: that worker may have gone (recycled by
        ``max_requests``, killed), and then the exit of an engine that had come up never
        started the count anew, nor was a failure counted, and the bound did not hold."""
        started = self.directory / _STARTED_FILE
        try:
            pid = int(started.read_text())
        except (OSError, ValueError):  # none started yet
            return None
        started.unlink()
        try:
            status = (self.directory / f"{_EXIT_PREFIX}{pid}").read_text()
        except OSError:  # the worker that started it went first: nobody saw its status
            status = "its exit status unseen"
        for said in self.directory.glob(f"{_EXIT_PREFIX}*"):  # its, and any a late reaper
            said.unlink(missing_ok=True)  # wrote after its engine was counted
        counter = self.directory / _FAILED_STARTS_FILE
        if came_up(self.directory, pid):
            counter.write_text("0")
            return None
        try:
            count = int(counter.read_text() or 0) + 1
        except (OSError, ValueError):
            count = 1
        counter.write_text(str(count))
        log.warning("the engine process (pid %d) exited before it came up (%s; %d of %d in "
                    "a row)", pid, status, count, FAILED_STARTS)
        if count < FAILED_STARTS:
            return None
        return (f"it exited before it came up {count} times in a row (last: {status}); the "
                "server log says why")


def check_memory_once(settings: Settings, master_pid: int) -> None:
    """Several models under gunicorn: their memory weighed once a master, by the first
    worker to build its app, before any engine starts (a later worker, or one that
    replaces another, would count the engines' own memory as taken). Models that do not
    fit stop gunicorn as an engine that cannot load its model does."""
    from .memory import check_apart

    root = owner_dir(master_pid)
    try:
        with _locked(root):
            weighed = root / _WEIGHED
            if weighed.exists():
                return
            refusal = check_apart(settings)
            if refusal is not None:
                _give_up(root, master_pid, f"{refusal}; then start gunicorn again")
            weighed.write_text("")
    except FileNotFoundError:  # another worker gave up: its master is stopping
        _stand_down(master_pid)


def _give_up(root: Path, master_pid: int, line: str) -> None:
    """Where gunicorn's master is the owner: ``line``, the directory removed (no engine
    will use it), and the exit gunicorn halts on. Under the lock, so that one worker does
    it: a second exit with WORKER_BOOT_ERROR while the master halts makes it raise again (a
    traceback, exit 1)."""
    if master_pid == os.getpid():  # waitress-serve with ENGINE=process: unhealthy
        return
    log.error("%s", line)
    shutil.rmtree(root, ignore_errors=True)
    flush_logs()
    os._exit(WORKER_BOOT_ERROR)


def _stand_down(master_pid: int) -> None:
    """Under gunicorn, after another worker gave up: exit, and not as a failed boot (see
    ``_give_up``), once the master has had time to reap that worker and halt. Exiting at
    once, this worker could be reaped first and replaced, and its replacement made the
    engine's directory anew and started another engine (a CI run). The master's SIGTERM
    usually ends the wait: a worker warming in post_worker_init exits on it at once
    (gunicorn_worker.py), a serving one stops as gunicorn stops it."""
    if master_pid == os.getpid():
        return
    log.info("worker %d stops with its master: the service could not start", os.getpid())
    flush_logs()
    until = time.monotonic() + _STAND_DOWN_S
    while time.monotonic() < until and alive(master_pid):
        time.sleep(0.05)
    os._exit(0)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    with open(directory / _LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not directory.is_dir():  # removed while this process waited
                raise FileNotFoundError(directory)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):  # exiting anyway
            handler.flush()
