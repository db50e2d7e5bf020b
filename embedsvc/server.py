"""``embedsvc serve``: load the model, then serve it with waitress; drain on SIGTERM or SIGINT.

Example (loads the model and blocks)::

    serve(Settings(port=0))
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from waitress import create_server
from waitress.channel import HTTPChannel
from waitress.wasyncore import close_all, dispatcher

from .logs import configure_logging
from .service import Service
from .settings import Settings
from .wsgi import create_app

log = logging.getLogger(__name__)
_POLL_S = 0.05
_QUIET_S = 0.2


class Server:
    """One waitress server around one engine, with a graceful stop.

    ``stop()``, or the first SIGTERM or SIGINT, stops listening (new connections are
    refused), makes /health answer 503 ``draining`` and new embedding requests 503, lets
    every admitted request finish and its response leave (up to DRAIN_TIMEOUT_S), waits
    until no request has arrived for a moment, then makes ``run`` return. A second signal
    stops at once.

    Example::

        server = Server(Settings(port=0), service)
        threading.Thread(target=server.run, args=(False,)).start()
    """

    def __init__(self, settings: Settings, service: Service) -> None:
        self.settings = settings
        self.service = service
        self.app = create_app(settings, service=service)
        self.waitress: Any = create_server(
            self.app,
            host=settings.host,
            port=settings.port,
            threads=settings.threads,
            ident="embedsvc",
            clear_untrusted_proxy_headers=True,
            # read ahead on each connection, so that a client that hangs up is noticed
            # (waitress.client_disconnected) and its queued inputs are dropped
            channel_request_lookahead=4,
        )
        self._signals = 0

    @property
    def port(self) -> int:
        return int(self.waitress.effective_port)

    def run(self, install_signals: bool = True) -> None:
        """Serve until ``stop()`` or a signal has drained the server."""
        if install_signals:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        log.info("serving on http://%s:%d (pid %d, %d threads)", self.settings.host, self.port,
                 os.getpid(), self.settings.threads)
        try:
            self.waitress.run()  # returns when the drain has closed every channel
        finally:
            self.waitress.task_dispatcher.shutdown(timeout=5)

    def stop(self) -> None:
        """Drain and make ``run`` return; safe to call from any thread."""
        self._drain()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals += 1
        if self._signals > 1:
            raise KeyboardInterrupt  # waitress's loop stops on it at once
        log.info("signal %d: draining (up to %.0fs)", signum, self.settings.drain_timeout_s)
        threading.Thread(target=self._drain, name="embedsvc-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.settings.drain_timeout_s
        self.waitress.trigger.pull_trigger(self._stop_listening)
        report = self.service.drain(self.settings.drain_timeout_s)
        quiet_since = None  # a request still in transit on a kept-alive connection gets a 503
        while time.monotonic() < deadline:
            if self._responses_pending():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= _QUIET_S:
                break
            time.sleep(_POLL_S)
        log.info("drained: %d inputs finished, %d failed; stopping",
                 report.completed, report.failed)
        self.waitress.trigger.pull_trigger(lambda: close_all(self.waitress._map))

    def _stop_listening(self) -> None:
        self.waitress.accepting = False
        dispatcher.close(self.waitress)  # the listening socket only; open channels stay

    def _responses_pending(self) -> bool:
        tasks = self.waitress.task_dispatcher
        if tasks.queue or tasks.active_count > 0:
            return True
        return any(
            isinstance(ch, HTTPChannel) and (ch.requests or ch.total_outbufs_len)
            for ch in list(self.waitress._map.values())
        )


def serve(settings: Settings) -> int:
    """Load the model, then serve until a signal; the exit code."""
    configure_logging(settings.log_level, settings.log_format)
    service = Service(settings)
    try:
        service.start(background=False)
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    Server(settings, service).run()
    return 0
