"""The WSGI front: the POST routes served straight from the WSGI call, the rest by Flask.

>>> from embedsvc.api import create_app
>>> from embedsvc.encoder import FakeEncoder
>>> app = create_app(Settings(), encoder=FakeEncoder(dimension=4))
>>> isinstance(app.wsgi_app, Front)
True
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any

from .engine import Engine
from .errors import ApiError, InvalidRequest, MethodNotAllowed, internal_error
from .routes import POST_ROUTES, Reply, check_api_key, error_reply, record, too_large
from .settings import Settings

log = logging.getLogger(__name__)

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
_STATUS_LINES = {s.value: f"{s.value} {s.phrase}" for s in HTTPStatus}
_STATUS_LINES[499] = "499 Client Closed Request"


class Front:
    """Serves ``routes.POST_ROUTES`` itself and passes every other path to ``fallback``.

    The same checks as the Flask routes (API key, body limit, one JSON error shape, metrics
    and the access log), without a request context.
    """

    def __init__(self, engine: Engine, fallback: WSGIApp) -> None:
        self.engine = engine
        self.fallback = fallback

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]
                 ) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        route = POST_ROUTES.get(path)
        if route is None:
            return self.fallback(environ, start_response)
        started = time.monotonic()
        method = environ.get("REQUEST_METHOD", "")
        engine = self.engine
        try:
            if method != "POST":
                raise MethodNotAllowed(f"{method} is not allowed on {path}; use POST",
                                       code="method_not_allowed", headers={"Allow": "POST"})
            check_api_key(engine.settings, path, environ.get("HTTP_AUTHORIZATION"))
            raw = read_body(environ, engine.settings)
            reply = route(engine, raw, environ.get("waitress.client_disconnected"))
        except ApiError as exc:
            reply = error_reply(engine, exc)
        except Exception:
            log.exception("unexpected error on %s %s", method, path)
            reply = error_reply(engine, internal_error())
        record(engine, method, path, reply.status, time.monotonic() - started,
               reply.inputs, reply.tokens)
        return respond(start_response, reply)


def read_body(environ: dict[str, Any], settings: Settings) -> bytes:
    """The request body, refused with 413 past MAX_BODY_BYTES before it is read when possible."""
    limit = settings.max_body_bytes
    stream = environ["wsgi.input"]
    length = environ.get("CONTENT_LENGTH")
    if length:
        size = int(length) if length.isdigit() else -1
        if size < 0:
            raise InvalidRequest(f"Content-Length {length!r} is not a number of bytes",
                                 code="invalid_content_length")
        if size > limit:
            raise too_large(size, limit)
        return stream.read(size)
    raw = stream.read(limit + 1)  # chunked: the server ends the stream with the body
    if len(raw) > limit:
        raise too_large(len(raw), limit)
    return raw


def respond(start_response: Callable[..., Any], reply: Reply) -> list[bytes]:
    status = _STATUS_LINES.get(reply.status) or f"{reply.status} Unknown"
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(reply.body)))]
    headers.extend(reply.headers)
    start_response(status, headers)
    return [reply.body]
