"""The server of ``embedsvc serve`` and its fronts: waitress around a service, draining on
SIGTERM or SIGINT, the keys file reloaded on SIGHUP (start.py loads the model and runs it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from ..api.wsgi import serving_app
from ..service import Service
from ..settings import Settings
from ..work import ShutdownReport
from . import drain, waitress_adapter
from .probe import ProbeListener
from .process import ensure_open_files

log = logging.getLogger(__name__)
access_log = logging.getLogger("embedsvc.access")
_POLL_S = 0.05
# After the drain, connections still open are closed once none has been active for this long
# (gunicorn's worker lingers as long, STOP_KEEPALIVE_LINGER): a client whose last answer was
# kept alive before the signal, and whose next request is on its way, gets a 503 with
# "Connection: close" instead of a connection closed under its request.
_LINGER_S = 2.0
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Server:
    """One waitress server around one service, with connection bounds and a graceful stop.

    ``stop()``, or the first SIGTERM or SIGINT, stops listening (new connections are
    refused), lets every request already arriving or running at that moment (an upload in
    progress included) finish, then makes /health answer 503 ``draining`` and new embedding
    requests 503, lets every admitted request finish and its response leave, waits until no
    request has arrived for a moment, and makes ``run`` return; all within DRAIN_TIMEOUT_S.
    A second signal exits the process at once with status 128 + the signal's number.

    Example::

        server = Server(Settings(port=0), service)
        threading.Thread(target=server.run, args=(False,)).start()
    """

    def __init__(self, settings: Settings, service: Service,
                 sock: socket.socket | None = None, probe_sock: socket.socket | None = None
                 ) -> None:
        self.settings = settings
        self.service = service
        self.app = serving_app(service)
        metrics = service.metrics
        self.open_files = ensure_open_files(settings.max_connections,
                                            waitress_adapter.DESCRIPTORS_PER_CONNECTION)
        bounds = waitress_adapter.Bounds(
            header_timeout_s=settings.header_timeout_s, body_timeout_s=settings.body_timeout_s,
            idle_timeout_s=settings.idle_timeout_s, send_timeout_s=settings.send_timeout_s,
            max_connections=self.open_files.connections,
            max_body_bytes=settings.max_body_bytes,
        )
        self.waitress: Any = waitress_adapter.create(
            self.app, host=settings.host, port=settings.port, threads=settings.threads,
            bounds=bounds, ident="embedsvc",
            on_close=lambda reason: metrics.connections_closed.labels(reason=reason).inc(),
            on_error=self._record_server_error, sock=sock,
        )
        metrics.open_connections.set_function(
            lambda: waitress_adapter.open_connections(self.waitress))
        self.probes = (ProbeListener(self.app, settings, probe_sock)
                       if settings.health_port is not None else None)
        self._signals = 0
        self._drain_lock = threading.Lock()
        self._drain_started = False
        self.drain_report: ShutdownReport | None = None

    @property
    def port(self) -> int:
        return int(self.waitress.effective_port)

    def run(self, install_signals: bool = True) -> None:
        """Serve until ``stop()`` or a signal has drained the server."""
        if install_signals:
            for signum in DRAIN_SIGNALS:
                signal.signal(signum, self._on_signal)
            signal.signal(signal.SIGHUP, lambda signum, frame: self.service.keyring.reload())
            # the supervisor's word to drain (embedsvc serve --workers N): a front that got a
            # SIGTERM of its own as well drains once, rather than exiting at the second
            signal.signal(signal.SIGUSR1, lambda signum, frame: threading.Thread(
                target=self._drain, name="embedsvc-drain", daemon=True).start())
        if self.probes is not None:
            self.probes.start()
        log.info("serving on http://%s:%d (pid %d, %d threads, %s)", self.settings.host,
                 self.port, os.getpid(), self.settings.threads, self.open_files)
        try:
            self.waitress.run()  # returns when the drain has closed every channel
        finally:
            waitress_adapter.stop_threads(self.waitress, 5)
            if self.probes is not None:
                self.probes.stop()

    def stop(self) -> None:
        """Drain and make ``run`` return; safe to call from any thread."""
        self._drain()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals += 1
        if self._signals > 1:
            # Exit now, from the main thread, without unwinding: the interpreter's exit would
            # wait for request threads, and torch's native threads abort (SIGABRT) if they
            # are torn down mid-batch.
            log.warning("signal %d again: exiting at once", signum)
            flush_logs()
            os._exit(128 + signum)
        log.info("signal %d: draining (up to %.0fs)", signum, self.settings.drain_timeout_s)
        threading.Thread(target=self._drain, name="embedsvc-drain", daemon=True).start()

    def _drain(self) -> None:
        with self._drain_lock:  # once, whoever asks first (a signal, stop(), the supervisor)
            if self._drain_started:
                return
            self._drain_started = True
        started = time.monotonic()
        deadline = started + self.settings.drain_timeout_s
        computed_before = drain.inputs_computed(self.service)
        server = self.waitress
        # The loop takes the connections queued in the kernel, then closes the listener; the
        # drain looks at the connections only once it has (else it could find none yet,
        # stop at once, and the queued ones were reset: a CI run's drain test)
        began = threading.Event()

        def begin() -> None:
            try:
                waitress_adapter.start_draining(server)
            finally:
                began.set()

        waitress_adapter.in_loop(server, begin)
        began.wait(max(0.0, deadline - time.monotonic()))
        arriving = waitress_adapter.requests_in_progress(server)
        report = self.drain_report = drain.drain_service(
            self.service, lambda: waitress_adapter.still_in_progress(arriving), deadline)
        quiet_since = None
        while time.monotonic() < deadline and waitress_adapter.open_connections(server):
            if waitress_adapter.any_busy(server):
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= _LINGER_S:
                break
            time.sleep(_POLL_S)
        log.info("%s", drain.summary(time.monotonic() - started,
                                     drain.inputs_computed(self.service) - computed_before,
                                     report))
        waitress_adapter.close_soon(server)

    def _record_server_error(self, request: Any, status: int) -> None:
        """Count and log an answer waitress wrote itself (a malformed or oversized request)."""
        self.service.metrics.count_request("unmatched", status, 0.0)
        if access_log.isEnabledFor(logging.INFO):
            access_log.info("%s %s %d (answered by the HTTP server)",
                            getattr(request, "command", "-") or "-",
                            (getattr(request, "path", "-") or "-")[:200], status)


def flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):  # exiting anyway
            handler.flush()
    sys.stderr.flush()
