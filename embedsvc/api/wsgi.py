"""The WSGI application: one route table, one request pipeline; Flask hosts it.

Every embedsvc route (``routes.ROUTES``) goes through ``Pipeline`` in this order: API key,
route and method (404, 405 with ``Allow``), body limit (413), the model-kind check, the
handler, error mapping, metrics and the access log, the response. Paths the table does not
hold go to Flask with the same key, body limit, metrics and log, so that users can add their
own Flask routes. Every error, whichever step raised it, Flask's included, is written here
once, in the error shape of the path's API family (``ErrorShapes``).

Why not Flask for everything: on the hot path its request context, proxies and response
objects cost more CPU per request than the rest of the server outside the model
(bench/RESULTS.md). embedsvc's own servers serve ``serving_app``, the same pipeline with its
Flask built on the first path outside the table, so that a start does not import the web
framework before its first answer.

>>> from embedsvc.model.fake import FakeEncoder
>>> app = create_app(Settings(), encoder=FakeEncoder(dimension=4))
>>> app.extensions["embedsvc"].start(background=False)
>>> app.test_client().post("/embed", json={"inputs": "hi"}).status_code
200
>>> app.extensions["embedsvc"].drain(timeout=1.0).failed
0
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from ..errors import (
    OPENAI,
    ApiError,
    ErrorShape,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    body_too_large,
    internal_error,
)
from ..metrics import Metrics
from ..service import Service, serve_models
from ..settings import Settings
from .lane import BodyLane
from .routes import ROUTES
from .tracing import tracing_for
from .web import Call, Reply, Route, check_kind, json_reply

if TYPE_CHECKING:  # an encoder given by a test or a library user; the app never loads one
    from flask import Flask, Response

    from ..model.encoder import Encoder

log = logging.getLogger(__name__)
access_log = logging.getLogger("embedsvc.access")

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
_STATUS_LINES = {s.value: f"{s.value} {s.phrase}" for s in HTTPStatus}
_STATUS_LINES[499] = "499 Client Closed Request"
OTHER_ROUTE = "other"  # the metrics label of paths outside the table (Flask's)


class ErrorShapes:
    """The error shape of any path: its routes' own; for a path the table lacks, the one that
    every route under its first segment shares (``/api/...``: Ollama's), else OpenAI's.

    >>> ERROR_SHAPES("/api/nothing"), ERROR_SHAPES("/v1/nothing"), ERROR_SHAPES("/embed")
    ('ollama', 'openai', 'openai')
    """

    def __init__(self, routes: Iterable[Route]) -> None:
        self.paths: dict[str, ErrorShape] = {}
        under: dict[str, set[ErrorShape]] = {}
        for route in routes:
            self.paths[route.path] = route.errors
            under.setdefault(_first_segment(route.path), set()).add(route.errors)
        self.prefixes = {prefix: shapes.pop() for prefix, shapes in under.items()
                         if len(shapes) == 1}

    def __call__(self, path: str | None) -> ErrorShape:
        if not path:  # the HTTP server could not read the request line
            return OPENAI
        return self.paths.get(path) or self.prefixes.get(_first_segment(path), OPENAI)


def _first_segment(path: str) -> str:
    """``/api/`` for ``/api/embed``; ``/`` for a path of one segment (``/embed``)."""
    head, slash, _ = path[1:].partition("/")
    return f"/{head}/" if slash else "/"


ERROR_SHAPES = ErrorShapes(ROUTES)  # the served table's, for the HTTP server's own answers


class Pipeline:
    """The one request pipeline, in front of ``fallback`` (Flask) for paths not in the table."""

    def __init__(self, service: Service, fallback: WSGIApp,
                 routes: Iterable[Route] = ROUTES) -> None:
        self.service = service
        self.fallback = fallback
        self.table: dict[str, dict[str, Route]] = {}
        routes = tuple(routes)
        # the path before a route's parameter -> its path in the table and the name
        self.ending: dict[str, tuple[str, str]] = {}
        for route in routes:
            self.table.setdefault(route.path, {})[route.method] = route
            if route.parameter is not None:
                self.ending[route.path[:route.path.rindex("{")]] = (route.path, route.parameter)
        self.error_shape = ErrorShapes(routes)
        self.lane = BodyLane()  # large bodies' parsing, one at a time (lane.py)
        # this process's (tracing.py); its last spans flushed within the drain's time
        self.tracing = tracing_for(service.settings.otlp_endpoint,
                                   service.settings.drain_timeout_s)

    def _match(self, path: str) -> tuple[str, dict[str, str]]:
        """The table's path for ``path``, and the value of its parameter if it ends in one."""
        if path not in self.table:
            for stem, (pattern, name) in self.ending.items():
                if path.startswith(stem) and len(path) > len(stem):
                    return pattern, {name: path[len(stem):]}
        return path, {}

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]
                 ) -> Iterable[bytes]:
        started = time.monotonic()
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "")
        pattern, params = self._match(path)
        methods = self.table.get(pattern)
        label = pattern if methods is not None else OTHER_ROUTE
        tenant: str | None = None
        call: Call | None = None
        try:
            route, tenant = self._route(environ, path, method, methods)
            body = read_body(environ, self.service.settings.max_body_bytes)
            if route is None:
                environ["wsgi.input"] = io.BytesIO(body)
                return self._to_flask(environ, start_response, started)
            call = Call(self.service, body, started, environ.get("waitress.client_disconnected"),
                        _flow(environ), params, self.lane, tenant, route.kinds, route.path)
            if route.kinds is not None and not self.service.others:  # else: as it is chosen
                check_kind(route.kinds, call.engine_client().info.kind, route.path)
            if self.tracing is None:  # no OTLP_ENDPOINT: this look is all tracing costs
                reply = route.handler(call)
            else:
                reply = self.tracing.handle(route, call, environ)
        except ApiError as exc:
            reply = self.error(exc, path)
        except Exception:
            log.exception("unexpected error on %s %s", method, path)
            reply = self.error(internal_error(), path)
        seconds = self.record(method, label, reply.status, started, reply.inputs, reply.tokens,
                              tenant)
        if call is not None and call.chosen is not None:  # several models: by model too
            call.chosen.metrics.count_model_request(label, reply.status, seconds)
        return respond(start_response, reply, head=method == "HEAD")

    def _route(self, environ: dict[str, Any], path: str, method: str,
               methods: dict[str, Route] | None) -> tuple[Route | None, str | None]:
        """The table's route for this request (None: Flask's), after the key and method, and
        the tenant whose key it presented (None: no key is needed)."""
        route = methods.get("GET" if method == "HEAD" else method) if methods else None
        # A path may be open for one method only (GET / is TEI's health check, POST / is not).
        is_open = route.open if route is not None else (
            methods is not None and all(r.open for r in methods.values()))
        tenant = None
        if not is_open:
            found = self.service.keyring.authenticate(environ.get("HTTP_AUTHORIZATION"))
            tenant = found.name if found is not None else None
        if methods is None:
            return None, tenant
        if route is None:
            allow = ", ".join(sorted(methods))
            raise MethodNotAllowed(f"{method} is not allowed on {path}; use {allow}",
                                   code="method_not_allowed", headers={"Allow": allow})
        return route, tenant

    def _to_flask(self, environ: dict[str, Any], start_response: Callable[..., Any],
                  started: float) -> Iterable[bytes]:
        status: list[int] = []

        def capture(line: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            status.append(int(line.split(" ", 1)[0]))
            return start_response(line, headers, exc_info)

        out = self.fallback(environ, capture)
        self.record(environ.get("REQUEST_METHOD", ""), OTHER_ROUTE,
                    status[0] if status else 500, started)
        return out

    def error(self, exc: ApiError, path: str) -> Reply:
        """The one mapping of an error to its answer: counted, in the path's error shape."""
        self.service.metrics.count_rejection(exc.reason)
        return error_reply(exc, self.error_shape(path))

    def flask_error(self, exc: Exception) -> Response:
        """Flask's error handler: errors of the paths Flask serves (users' own routes)."""
        from flask import Response, request

        reply = self.error(_flask_api_error(exc, request.path), request.path)
        return Response(reply.body, status=reply.status, headers=reply.headers,
                        content_type=reply.content_type)

    def record(self, method: str, route: str, status: int, started: float,
               inputs: int = 0, tokens: int = 0, tenant: str | None = None) -> float:
        """Count one answered request and write its access-log line (the tenant's name,
        never its key); the seconds it took."""
        seconds = time.monotonic() - started
        metrics = self.service.metrics
        metrics.count_request(route, status, seconds)
        if tenant is not None:
            metrics.count_tenant(tenant, status, inputs, tokens)
        if access_log.isEnabledFor(logging.INFO):
            access_log.info("%s %s %d inputs=%d tokens=%d ms=%.1f%s", method, route, status,
                            inputs, tokens, seconds * 1000,
                            "" if tenant is None else f" tenant={tenant}")
        return seconds


def read_body(environ: dict[str, Any], limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` before it is read when possible."""
    stream = environ["wsgi.input"]
    length = environ.get("CONTENT_LENGTH")
    if length:
        size = int(length) if length.isdigit() else -1
        if size < 0:
            raise InvalidRequest(f"Content-Length {length!r} is not a number of bytes",
                                 code="invalid_content_length")
        if size > limit:
            raise body_too_large(limit, size)
        return stream.read(size) if size else b""
    raw = stream.read(limit + 1)  # chunked: the server ends the stream with the body
    if len(raw) > limit:
        raise body_too_large(limit, len(raw))
    return raw


def error_reply(exc: ApiError, shape: ErrorShape = OPENAI) -> Reply:
    return json_reply(exc.body(shape), exc.status, list(exc.headers.items()))


def respond(start_response: Callable[..., Any], reply: Reply, head: bool = False
            ) -> list[bytes]:
    """Start ``reply``; a HEAD request gets the headers a GET would, without the body (RFC
    9110, 9.3.2: a body would be read as the start of the next response)."""
    status = _STATUS_LINES.get(reply.status) or f"{reply.status} Unknown"
    headers = [("Content-Type", reply.content_type), ("Content-Length", str(len(reply.body)))]
    headers.extend(reply.headers)
    start_response(status, headers)
    return [] if head else [reply.body]


def _flask_api_error(exc: Exception, path: str) -> ApiError:
    """What a Flask error (or an exception of a user's route) tells the client."""
    from werkzeug.exceptions import HTTPException

    if isinstance(exc, HTTPException) and exc.code == 404:
        err: ApiError = NotFound(f"no route {path}; see /openapi.json",
                                 code="not_found")
    elif isinstance(exc, HTTPException) and exc.code == 405:
        allow = ", ".join(sorted(getattr(exc, "valid_methods", None) or []))
        err = MethodNotAllowed("method not allowed on this route", code="method_not_allowed",
                               headers={"Allow": allow} if allow else None)
    elif isinstance(exc, HTTPException) and (exc.code or 500) < 500:
        err = InvalidRequest(exc.description or exc.name,
                             code=exc.name.lower().replace(" ", "_"))
    else:
        if not isinstance(exc, HTTPException):
            log.exception("unexpected error in a Flask route", exc_info=exc)
        err = internal_error()
    return err


def _flow(environ: dict[str, Any]) -> tuple[str, str] | None:
    """The client's connection (peer address and port), whose requests take turns with
    other connections' for the device (``Batcher.start_tag``)."""
    port = environ.get("REMOTE_PORT")
    return (environ.get("REMOTE_ADDR", ""), port) if port else None


def create_app(
    settings: Settings | None = None,
    *,
    service: Service | None = None,
    encoder: Encoder | None = None,
    registry: CollectorRegistry | None = None,
) -> Flask:
    """The Flask app around a service; the caller starts it (``service.start()``).

    Add your own routes with Flask as usual; they get the API key and body checks, metrics
    and the access log of the pipeline::

        app = create_app(Settings(max_batch_size=64))
        app.extensions["embedsvc"].start()
    """
    settings = settings or Settings()
    if service is None and encoder is not None:
        service = Service(settings, encoder=encoder, metrics=Metrics(registry))
    elif service is None:  # each model's metrics in a registry of its own (Service.exposition)
        service = serve_models(settings, lambda own, i: Service(
            own, metrics=Metrics(registry if i == 0 else None)))
    app = _flask_host(service)
    pipeline = Pipeline(service, app.wsgi_app)
    app.register_error_handler(Exception, pipeline.flask_error)
    app.wsgi_app = pipeline  # type: ignore[method-assign]
    return app


def serving_app(service: Service) -> Pipeline:
    """The app that embedsvc's own servers serve (``embedsvc serve``, its fronts,
    ``embedsvc:app``): the pipeline of ``create_app``, whose Flask host, for the paths outside
    the table, is built on its first use (``flask_host``) rather than before the first answer
    (Flask's imports are a tenth of a second of the start)."""
    host = _LazyHost(service)
    pipeline = host.pipeline = Pipeline(service, host)
    return pipeline


def flask_host(app: Pipeline) -> Flask:
    """The Flask app of a ``serving_app`` (built now if it was not), which serves the same
    pipeline: users' routes added to it are served by ``app`` too."""
    host = app.fallback
    if not isinstance(host, _LazyHost):
        raise TypeError("flask_host takes the app of serving_app(); create_app() returns "
                        "its Flask app itself")
    return host.flask()


def _flask_host(service: Service) -> Flask:
    from flask import Flask

    app = Flask("embedsvc")
    app.extensions["embedsvc"] = service
    return app


class _LazyHost:
    """A pipeline's Flask host, built on first use, once, whichever thread asks: the
    pipeline's fallback for the paths outside the table."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.pipeline: Pipeline | None = None  # the pipeline it hosts (set by serving_app)
        self._flask: Flask | None = None
        self._paths: WSGIApp | None = None  # Flask's own WSGI app: its routes, its 404s
        self._lock = threading.Lock()

    def flask(self) -> Flask:
        with self._lock:
            if self._flask is None:
                assert self.pipeline is not None
                app = _flask_host(self.service)
                app.register_error_handler(Exception, self.pipeline.flask_error)
                self._paths = app.wsgi_app
                app.wsgi_app = self.pipeline  # type: ignore[method-assign]
                self._flask = app
            return self._flask

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]
                 ) -> Iterable[bytes]:
        if self._paths is None:
            self.flask()
        assert self._paths is not None
        return self._paths(environ, start_response)
