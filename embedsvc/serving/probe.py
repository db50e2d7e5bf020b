"""The probe listener: /health, /metrics and /info on a port of their own (HEALTH_PORT).

A flood of connections on the serving port, or every request thread busy with long
requests, must not make a liveness probe fail and get a healthy process restarted. TEI
serves its metrics on a separate port for the same reason. The probe listener has its own
socket, event loop, two request threads and connection limit, and serves the same app (so
the same API key rules and JSON errors), but only these read-only routes.

Example::

    probes = ProbeListener(app, Settings(health_port=0))
    probes.start()
    ...
    probes.stop()
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ..api.wsgi import error_reply, respond
from ..errors import NotFound
from ..settings import Settings
from . import waitress_adapter

log = logging.getLogger(__name__)

PROBE_PATHS = frozenset({"/health", "/metrics", "/info"})
_THREADS = 2
_CONNECTIONS = 32  # probes are few; a flood here cannot reach the serving port's


def probe_only(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """``app`` restricted to ``PROBE_PATHS``; any other path is a JSON 404."""

    def filtered(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") in PROBE_PATHS:
            return app(environ, start_response)
        err = NotFound(f"the probe port serves only {', '.join(sorted(PROBE_PATHS))}",
                       code="not_found")
        return respond(start_response, error_reply(err),
                       head=environ.get("REQUEST_METHOD") == "HEAD")

    return filtered


class ProbeListener:
    """A small waitress server in a thread of its own, for the probe routes of ``app``."""

    def __init__(self, app: Callable[..., Iterable[bytes]], settings: Settings,
                 sock: socket.socket | None = None) -> None:
        assert settings.health_port is not None, "HEALTH_PORT is off"
        self.settings = settings
        bounds = waitress_adapter.Bounds(
            header_timeout_s=settings.header_timeout_s, body_timeout_s=settings.body_timeout_s,
            idle_timeout_s=settings.idle_timeout_s, send_timeout_s=settings.send_timeout_s,
            max_connections=_CONNECTIONS,
            max_body_bytes=64 * 1024,
        )
        self.server = waitress_adapter.create(
            probe_only(app), host=settings.host, port=settings.health_port, threads=_THREADS,
            bounds=bounds, ident="embedsvc-probes", sock=sock,
        )
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server.effective_port)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="embedsvc-probes", daemon=True)
        self._thread.start()
        log.info("probes on http://%s:%d (%s)", self.settings.host, self.port,
                 ", ".join(sorted(PROBE_PATHS)))

    def _run(self) -> None:
        try:
            self.server.run()
        finally:
            waitress_adapter.stop_threads(self.server, 2)

    def stop(self, timeout: float = 5) -> None:
        """Close the listener and its connections; safe from any thread."""
        if self._thread is None:
            return
        server = self.server
        def close() -> None:
            # the probe socket may be shared (the fronts of `embedsvc serve --workers N`): its
            # queue is left open for the fronts that go on
            waitress_adapter.start_draining(server, shut_queue=False)
            waitress_adapter.close(server)

        waitress_adapter.in_loop(server, close)
        self._thread.join(timeout)
        self._thread = None
