"""The Flask app: the GET routes, errors for unknown routes, and the WSGI front for the rest.

The POST routes (embeddings, /embed, /tokenize) are served by ``wsgi.Front`` before Flask
sees the request; this module wires it in.

>>> from embedsvc.encoder import FakeEncoder
>>> app = create_app(Settings(), encoder=FakeEncoder(dimension=4))
>>> app.extensions["embedsvc"].start(background=False)
>>> app.test_client().post("/embed", json={"inputs": "hi"}).status_code
200
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flask import Blueprint, Flask, Response, current_app, g, request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from werkzeug.exceptions import HTTPException

from .encoder import Encoder
from .engine import Engine
from .errors import (
    ApiError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    Unavailable,
    internal_error,
)
from .metrics import Metrics
from .openapi import openapi_document
from .routes import Reply, check_api_key, error_reply, json_reply, record, too_large
from .settings import Settings
from .wsgi import Front

log = logging.getLogger(__name__)

bp = Blueprint("embedsvc", __name__)


# -- routes (the POST routes are in routes.py) ------------------------------------------------


@bp.get("/info")
def info() -> Response:
    return _json(_engine().info())


@bp.get("/health")
def health() -> Response:
    state = _engine().state
    if state != "ready":
        reasons = {
            "loading": "the model is loading",
            "draining": "the server is shutting down",
            "unhealthy": "the model failed to load or the batcher is not running; see the log",
        }
        raise Unavailable(reasons.get(state, state), code=state)
    return _json({"status": "ok"})


@bp.get("/metrics")
def metrics() -> Response:
    registry = _engine().metrics.registry
    return Response(generate_latest(registry), mimetype=None, content_type=CONTENT_TYPE_LATEST)


@bp.get("/openapi.json")
def openapi() -> Response:
    return _json(openapi_document())


# -- helpers ----------------------------------------------------------------------------------


def _engine() -> Engine:
    return current_app.extensions["embedsvc"]


def _json(body: Any, status: int = 200, headers: list[tuple[str, str]] | None = None
          ) -> Response:
    return _response(json_reply(body, status, headers))


def _response(reply: Reply) -> Response:
    return Response(reply.body, status=reply.status, headers=reply.headers,
                    content_type="application/json")


# -- hooks and errors -------------------------------------------------------------------------


@bp.before_app_request
def _before() -> None:
    g.started = time.monotonic()
    check_api_key(_engine().settings, request.path, request.headers.get("Authorization"))


@bp.after_app_request
def _after(response: Response) -> Response:
    route = request.url_rule.rule if request.url_rule is not None else "unmatched"
    seconds = time.monotonic() - g.get("started", time.monotonic())
    record(_engine(), request.method, route, response.status_code, seconds)
    return response


def _api_error(exc: ApiError) -> Response:
    return _response(error_reply(_engine(), exc))


def _http_error(exc: HTTPException) -> Response:
    code = exc.code or 500
    if code == 404:
        err: ApiError = NotFound(f"no route {request.path}; see /openapi.json", code="not_found")
    elif code == 405:
        err = MethodNotAllowed(
            f"{request.method} is not allowed on {request.path}", code="method_not_allowed"
        )
    elif code == 413:
        limit = _engine().settings.max_body_bytes
        err = too_large(request.content_length or limit + 1, limit)
    elif code < 500:
        err = InvalidRequest(exc.description or exc.name, code=exc.name.lower().replace(" ", "_"))
    else:
        err = internal_error()
    return _api_error(err)


def _unexpected(exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.path)
    return _api_error(internal_error())


def create_app(
    settings: Settings | None = None,
    *,
    engine: Engine | None = None,
    encoder: Encoder | None = None,
    registry: CollectorRegistry | None = None,
) -> Flask:
    """The Flask app around an engine; the caller starts the engine (``engine.start()``).

    >>> app = create_app(Settings(max_batch_size=64))   # the real model, loaded on start
    """
    settings = settings or Settings()
    if engine is None:
        engine = Engine(settings, encoder=encoder, metrics=Metrics(registry))
    app = Flask("embedsvc")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions["embedsvc"] = engine
    app.register_blueprint(bp)
    app.register_error_handler(ApiError, _api_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _unexpected)
    app.wsgi_app = Front(engine, app.wsgi_app)  # type: ignore[method-assign]
    return app
