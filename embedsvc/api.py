"""Flask routes: parse and validate, hand inputs to the engine, shape the response.

>>> from embedsvc.encoder import FakeEncoder
>>> app = create_app(Settings(), encoder=FakeEncoder(dimension=4))
>>> app.extensions["embedsvc"].start(background=False)
>>> app.test_client().post("/embed", json={"inputs": "hi"}).status_code
200
"""

from __future__ import annotations

import base64
import hmac
import logging
import time
from typing import Any

import orjson
from flask import Blueprint, Flask, Response, current_app, g, request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

from .encoder import Encoder
from .engine import Embedded, Engine
from .errors import (
    ApiError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
    internal_error,
)
from .metrics import Metrics
from .openapi import openapi_document
from .schemas import EmbeddingsRequest, EmbedRequest, Request, TokenizeRequest
from .settings import Settings

log = logging.getLogger(__name__)
access_log = logging.getLogger("embedsvc.access")

bp = Blueprint("embedsvc", __name__)
_OPEN_ROUTES = {"/health", "/metrics"}
_INPUT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


# -- routes -----------------------------------------------------------------------------------


@bp.post("/v1/embeddings")
@bp.post("/embeddings")
def embeddings() -> Response:
    req = _parse(EmbeddingsRequest)
    inputs = _as_list(req.input)
    if inputs and isinstance(inputs[0], list):
        _check_nonempty(inputs, "token list")
    out = _embed(inputs, normalize=True, dimensions=req.dimensions)
    rows = out.vectors
    if req.encoding_format == "base64":
        data = [_embedding(i, base64.b64encode(r.astype("<f4").tobytes()).decode()) for i, r in
                enumerate(rows)]
    else:
        data = [_embedding(i, r) for i, r in enumerate(rows)]
    body = {
        "object": "list",
        "data": data,
        "model": _engine().encoder.info.name,  # type: ignore[union-attr]
        "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens},
    }
    return _json(body, headers=_timing_headers(out))


@bp.post("/embed")
def embed() -> Response:
    req = _parse(EmbedRequest)
    texts = _as_list(req.inputs)
    if req.prompt_name is not None:
        texts = [_prompt(req.prompt_name) + t for t in texts]
    out = _embed(
        texts,
        normalize=req.normalize,
        dimensions=req.dimensions,
        truncate=req.truncate,
        direction=req.truncation_direction,
    )
    return _json(out.vectors, headers=_timing_headers(out))


@bp.post("/tokenize")
def tokenize() -> Response:
    req = _parse(TokenizeRequest)
    texts = _as_list(req.inputs)
    _check_count(texts)
    _check_nonempty(texts, "string")
    encoder = _ready_encoder()
    _engine().check_chars(texts)
    g.inputs = len(texts)
    return _json([[vars(p) for p in pieces] for pieces in encoder.pieces(texts)])


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


def _ready_encoder() -> Encoder:
    """The encoder, waiting for the model to load up to the request's deadline."""
    engine = _engine()
    return engine.wait_ready(time.monotonic() + engine.settings.request_timeout_s)


def _parse(model: type[Request]) -> Any:
    body = _json_body()
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _json_body() -> dict[str, Any]:
    limit = _engine().settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(request.content_length, limit)
    raw = request.get_data(cache=False)
    if len(raw) > limit:
        raise _too_large(len(raw), limit)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(
            f"the body is not valid JSON ({exc}); send a JSON object", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequest(
            f"the body must be a JSON object, not {type(body).__name__}", code="invalid_json"
        )
    return body


def _too_large(size: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the body has {size} bytes, more than MAX_BODY_BYTES ({limit}); split the request",
        code="body_too_large",
    )


def _invalid(exc: ValidationError) -> InvalidRequest:
    first = exc.errors(include_url=False)[0]
    loc = [str(x) for x in first["loc"]]
    param = loc[0] if loc else None
    if param in ("input", "inputs") and first["type"] != "missing":
        kinds = _INPUT_SHAPES if param == "input" else "a string or a list of strings"
        message = f"'{param}' must be {kinds}"
    elif first["type"] == "missing":
        message = f"'{param}' is required"
    else:
        message = f"'{param}': {first['msg']}"
    return InvalidRequest(message, param=param, code="invalid_" + (param or "body"))


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, str):
        value = [value]
    elif value and isinstance(value[0], int):
        value = [value]  # one list of token ids
    if not value:
        raise InvalidRequest("'input' must not be empty", param="input", code="empty_input")
    return value


def _check_nonempty(items: list[Any], kind: str) -> None:
    for i, item in enumerate(items):
        if not item:
            raise InvalidRequest(
                f"input {i} is an empty {kind}; every input needs at least one character or id",
                param="input", code="empty_input",
            )


def _check_count(inputs: list[Any]) -> None:
    limit = _engine().settings.max_inputs_per_request
    if len(inputs) > limit:
        raise InvalidRequest(
            f"the request has {len(inputs)} inputs, more than MAX_INPUTS_PER_REQUEST ({limit}); "
            "split it into several requests",
            param="input", code="too_many_inputs",
        )


def _embed(inputs: list[Any], **options: Any) -> Embedded:
    _check_count(inputs)
    if isinstance(inputs[0], str):
        _check_nonempty(inputs, "string")
    g.inputs = len(inputs)
    disconnected = request.environ.get("waitress.client_disconnected")
    out = _engine().embed(inputs, disconnected=disconnected, **options)
    g.tokens = out.tokens
    return out


def _prompt(name: str) -> str:
    encoder = _ready_encoder()
    prompts = encoder.info.prompts
    if name not in prompts:
        known = ", ".join(sorted(prompts)) or "none"
        raise InvalidRequest(
            f"'prompt_name' {name!r} is not one of this model's prompts ({known})",
            param="prompt_name", code="invalid_prompt_name",
        )
    return prompts[name]


def _embedding(index: int, value: Any) -> dict[str, Any]:
    return {"object": "embedding", "index": index, "embedding": value}


def _timing_headers(out: Embedded) -> dict[str, str]:
    return {
        "x-queue-time": f"{out.queue_s * 1000:.3f}",
        "x-tokenization-time": f"{out.tokenize_s * 1000:.3f}",
        "x-inference-time": f"{out.inference_s * 1000:.3f}",
        "x-total-time": f"{out.total_s * 1000:.3f}",
        "x-compute-tokens": str(out.tokens),
    }


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    payload = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(payload, status=status, headers=headers, content_type="application/json")


# -- hooks and errors -------------------------------------------------------------------------


@bp.before_app_request
def _before() -> None:
    g.started = time.monotonic()
    key = _engine().settings.api_key
    if key and request.path not in _OPEN_ROUTES:
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
            raise Unauthorized(
                "missing or wrong API key; send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )


@bp.after_app_request
def _after(response: Response) -> Response:
    route = request.url_rule.rule if request.url_rule is not None else "unmatched"
    seconds = time.monotonic() - g.get("started", time.monotonic())
    _engine().metrics.count_request(route, response.status_code, seconds)
    access_log.info(
        "%s %s %d inputs=%d tokens=%d ms=%.1f",
        request.method, route, response.status_code, g.get("inputs", 0), g.get("tokens", 0),
        seconds * 1000,
    )
    return response


def _api_error(exc: ApiError) -> Response:
    _engine().metrics.count_rejection(exc.reason)
    return _json(exc.body(), status=exc.status, headers=exc.headers)


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
        err = _too_large(request.content_length or limit + 1, limit)
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
    return app
