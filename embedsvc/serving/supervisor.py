"""``embedsvc serve --workers N``: one engine process, N fronts, each its own listening socket.

The supervisor binds the port (and HEALTH_PORT's), makes a private directory for the engine's
socket, and starts the engine and the fronts as new programs (never by forking a process
that holds a model, a device or an ONNX Runtime session). It replaces any child that dies:
the fronts reconnect to a new engine by themselves, and the requests that were in the old
one get 503 with ``Retry-After``. SIGHUP goes to every child (each reloads the keys file).
On SIGTERM or SIGINT it drains as one process
does: the fronts stop accepting and finish what they admitted, then the engine finishes what
is left and exits, then the supervisor. A second signal ends every child at once.

On Linux, each front accepts on a listening socket of its own, all bound to the one port
in one ``SO_REUSEPORT`` group: the kernel spreads new connections over them evenly by their
addresses (macOS and the BSDs take the option but do not spread: one socket of the group
would get every connection). On one shared socket the
front that happened to wake first took a burst of connections, and a keep-alive client
stays where it landed (27 of 32 clients on one of two fronts was seen). The supervisor
keeps every front's socket, so a front's replacement inherits it with the connections that
queued there meanwhile (they wait for it, and are not reset). Elsewhere the fronts share
one socket, as gunicorn's workers do.

Example::

    Supervisor(Settings(port=0, workers=2)).run()
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..catalog import catalog, pinned
from ..remote.place import fresh_dir, model_dir
from ..settings import Settings
from .children import child_command
from .lifeline import ENGINE_BOOT_ERROR, FAILED_STARTS, came_up, exit_status, is_up

log = logging.getLogger(__name__)

# Linux spreads a port's new connections over the sockets of one SO_REUSEPORT group; macOS
# and the BSDs accept the option, but one socket of the group gets them all
_SPREADS = sys.platform.startswith("linux")

_POLL_S = 0.1
# A child that dies before it came up (the engine serving its socket, a front accepting)
# is started again after a wait that doubles each time, from the first to the longest; the
# supervisor stops after this many such starts in a row of one role. One that came up is
# replaced at once, however short its life: it was killed, not unable to start.
_FIRST_BACKOFF_S = 0.5
_LONGEST_BACKOFF_S = 30.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class Child:
    role: str  # "engine" or "front"
    proc: subprocess.Popen
    listener: socket.socket | None = None  # a front's, kept for its replacement
    index: int = 0  # an engine's: which of the models (catalog.py) it holds
    started: float = field(default_factory=time.monotonic)
    restart_at: float | None = None  # it exited: its replacement starts then


class Supervisor:
    """Starts, watches and stops the engine and the fronts of ``embedsvc serve --workers N``."""

    def __init__(self, settings: Settings) -> None:
        self.directory = fresh_dir()
        self.settings = settings = pinned(settings, self.directory)  # edits: at a restart
        self.listeners = _listeners(settings.host, settings.port, settings.workers)
        self.probes = (_listen(settings.host, settings.health_port)
                       if settings.health_port is not None else None)
        self.models = len(catalog(settings))  # one engine process each
        self.engines: list[Child] = []
        self.fronts: list[Child] = []
        self._signals = 0
        self._draining = False
        self._failed_starts: dict[str, int] = {}  # in a row, by role (and engine)
        # children a SIGHUP came for before they were up, to pass it on to once they are
        self._hangup_owed: set[int] = set()

    @property
    def port(self) -> int:
        return int(self.listeners[0].getsockname()[1])

    def run(self) -> int:
        for signum in _SIGNALS:
            signal.signal(signum, self._on_signal)
        signal.signal(signal.SIGHUP, self._pass_on)
        try:
            self.engines = [self._start("engine", index=i) for i in range(self.models)]
            self.fronts = [self._start("front", self.listeners[i % len(self.listeners)])
                           for i in range(self.settings.workers)]
            log.info("serving on http://%s:%d (supervisor pid %d; engine pid%s %s; %d fronts, "
                     "pids %s)", self.settings.host, self.port, os.getpid(),
                     "s" if len(self.engines) > 1 else "",
                     ", ".join(str(e.proc.pid) for e in self.engines), len(self.fronts),
                     ", ".join(str(f.proc.pid) for f in self.fronts))
            if self.probes is not None:
                log.info("probes on http://%s:%d (/health, /info, /metrics)",
                         self.settings.host, self.probes.getsockname()[1])
            return self._watch()
        finally:
            # the fronts stop accepting as they drain; these copies of the listening sockets
            # must close first, or the kernel would queue new connections and reset them at
            # the exit
            self._close_listeners()
            self._stop_all()
            if self.probes is not None:
                self.probes.close()
            shutil.rmtree(self.directory, ignore_errors=True)

    # -- children -----------------------------------------------------------------------------

    def _start(self, role: str, listener: socket.socket | None = None, index: int = 0
               ) -> Child:
        directory = model_dir(self.directory, index) if role == "engine" else self.directory
        args = ["--runtime-dir", str(directory), "--watch-pid", str(os.getpid())]
        if role == "engine" and self.models > 1:
            args += ["--model-index", str(index)]
        fds = []
        if listener is not None:
            fds.append(listener.fileno())
            args += ["--fd", str(listener.fileno())]
            if self.probes is not None:
                fds.append(self.probes.fileno())
                args += ["--probe-fd", str(self.probes.fileno())]
        env = {**os.environ, **self.settings.to_env()}
        # a session of its own: a terminal's Ctrl-C or a signal to the process group reaches
        # the supervisor alone, which stops the children in order
        proc = subprocess.Popen(child_command(role, *args), env=env, pass_fds=fds,
                                start_new_session=True)
        return Child(role, proc, listener, index)

    def _watch(self) -> int:
        """Replace children that die, until a signal has drained them all; the exit code."""
        while not self._draining:
            time.sleep(_POLL_S)
            if self._hangup_owed:
                self._pass_on_owed()
            for child in [*self.engines, *self.fronts]:
                if self._draining:
                    break
                if child.restart_at is not None:
                    if time.monotonic() >= child.restart_at:
                        self._restart(child)
                    continue
                code = child.proc.poll()
                if code is None:
                    continue
                if child.role == "engine" and code == ENGINE_BOOT_ERROR:
                    log.error("the engine could not load %s (its log says why); stopping",
                              "the model" if self.models == 1 else f"model {child.index + 1}")
                    return 1
                if not self._judge(child, code):
                    return 1
        return 0

    def _judge(self, child: Child, code: int) -> bool:
        """When to replace ``child``, which exited: at once if it came up, else after a
        backoff; False (stop) after ``FAILED_STARTS`` in a row that never came up."""
        role = f"{child.role}-{child.index}" if child.role == "engine" else child.role
        self._hangup_owed.discard(child.proc.pid)
        if came_up(self._directory_of(child), child.proc.pid):
            self._failed_starts[role] = 0
            delay = 0.0
        else:
            failed = self._failed_starts[role] = self._failed_starts.get(role, 0) + 1
            if failed >= FAILED_STARTS:
                log.error("the %s process exited before it came up %d times in a row (last: "
                          "%s); stopping", child.role, failed, exit_status(code))
                return False
            delay = min(_LONGEST_BACKOFF_S, _FIRST_BACKOFF_S * 2 ** (failed - 1))
        log.warning("the %s process (pid %d) exited with %s %s; a new one starts in %.1fs",
                    child.role, child.proc.pid, exit_status(code),
                    "after it came up" if delay == 0 else "before it came up", delay)
        child.restart_at = time.monotonic() + delay
        return True

    def _restart(self, child: Child) -> None:
        new = self._start(child.role, child.listener, child.index)
        log.info("started %s pid %d in place of pid %d", child.role, new.proc.pid,
                 child.proc.pid)
        if child.role == "engine":
            self.engines[self.engines.index(child)] = new
        else:
            self.fronts[self.fronts.index(child)] = new

    # -- stopping -----------------------------------------------------------------------------

    def _pass_on(self, signum: int, frame: object) -> None:
        """SIGHUP: every child reloads the keys file (the fronts check keys, the engine
        enforces their quotas). A child still starting gets it once it is up: before it
        sets its handler, SIGHUP would end it (as it imports, before its first line runs),
        and it reads the keys file as it starts anyway."""
        self._hangup_owed.update(child.proc.pid for child in [*self.engines, *self.fronts])
        self._pass_on_owed()

    def _pass_on_owed(self) -> None:
        """SIGHUP to each child it is owed to that is up now; a child gone owes nothing."""
        for child in [*self.engines, *self.fronts]:
            pid = child.proc.pid
            if pid not in self._hangup_owed:
                continue
            if child.proc.poll() is not None:
                self._hangup_owed.discard(pid)
            elif is_up(self._directory_of(child), pid):
                self._hangup_owed.discard(pid)
                child.proc.send_signal(signal.SIGHUP)

    def _directory_of(self, child: Child) -> Path:
        return model_dir(self.directory, child.index) if child.role == "engine" \
            else self.directory

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("signal %d again: ending every process at once", signum)
            for child in [*self.engines, *self.fronts]:
                if child.proc.poll() is None:
                    child.proc.kill()
            os._exit(128 + signum)
        log.info("signal %d: draining the fronts, then the engine (up to %.0fs)", signum,
                 self.settings.drain_timeout_s)
        # the watch ends within _POLL_S, and the listeners close then (``run``): closed here,
        # a front started meanwhile (at start, or a replacement) was handed a closed one
        self._draining = True

    def _close_listeners(self) -> None:
        for listener in self.listeners:
            listener.close()

    def _stop_all(self) -> None:
        """The fronts first (they finish what they admitted, which needs the engine), then
        the engine."""
        deadline = time.monotonic() + self.settings.drain_timeout_s + 5
        _stop([f.proc for f in self.fronts], deadline, signal.SIGUSR1)  # a front's "drain"
        _stop([engine.proc for engine in self.engines], deadline + 5, signal.SIGTERM)


def _stop(procs: list[subprocess.Popen], deadline: float, signum: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signum)
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop in time; killing it", proc.pid)
            proc.kill()
            proc.wait()


def _listeners(host: str, port: int, count: int) -> list[socket.socket]:
    """One listening socket per front on ``port`` (its first one chooses a port 0), all in
    one ``SO_REUSEPORT`` group; one shared socket where the platform does not spread a
    group's connections."""
    first = _listen(host, port, reuse_port=count > 1 and _SPREADS)
    if count == 1 or not _reuses_port(first):
        return [first]
    port = first.getsockname()[1]
    return [first, *(_listen(host, port, reuse_port=True) for _ in range(count - 1))]


def _listen(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening socket the fronts accept on (inherited by them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port and hasattr(socket, "SO_REUSEPORT"):
        with contextlib.suppress(OSError):  # a kernel without it: one shared socket
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _reuses_port(sock: socket.socket) -> bool:
    if not hasattr(socket, "SO_REUSEPORT"):
        return False
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT))


