"""The POST routes, free of any web framework: the raw body in, a ``Reply`` out.

They are served by ``wsgi.Front`` in front of Flask: on the hot path Flask's request
context, proxies and response objects cost more CPU per request than everything else the
server does outside the model (bench/RESULTS.md has the profile).

>>> from embedsvc.encoder import FakeEncoder
>>> engine = Engine(Settings(), encoder=FakeEncoder(dimension=4))
>>> engine.start(background=False)
>>> reply = embed(engine, b'{"inputs": "hi"}')
>>> reply.status, reply.inputs
(200, 1)
"""

from __future__ import annotations

import base64
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import ValidationError

from .engine import Embedded, Engine
from .errors import ApiError, InvalidRequest, PayloadTooLarge, Unauthorized
from .openai_tokens import decode_ids
from .schemas import EmbeddingsRequest, EmbedRequest, Request, TokenizeRequest
from .settings import Settings

access_log = logging.getLogger("embedsvc.access")

OPEN_ROUTES = frozenset({"/health", "/metrics"})
_INPUT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


@dataclass(slots=True)
class Reply:
    """A response: status, JSON body, extra headers, and what the access log reports."""

    status: int
    body: bytes
    headers: list[tuple[str, str]] = field(default_factory=list)
    inputs: int = 0
    tokens: int = 0


Disconnected = Callable[[], bool] | None


# -- routes -----------------------------------------------------------------------------------


def embeddings(engine: Engine, raw: bytes, disconnected: Disconnected = None) -> Reply:
    """POST /v1/embeddings and /embeddings: the OpenAI shape."""
    req = parse(EmbeddingsRequest, raw)
    inputs = _as_list(req.input)
    if isinstance(inputs[0], list):
        _check_nonempty(inputs, "token list")
        if engine.settings.token_ids == "openai":
            inputs = decode_ids(inputs, req.model)  # OpenAI clients send tiktoken ids
    out = _embed(engine, inputs, disconnected, normalize=True, dimensions=req.dimensions)
    rows = out.vectors
    if req.encoding_format == "base64":
        encoded: list[Any] = [base64.b64encode(r.astype("<f4").tobytes()).decode() for r in rows]
    else:
        encoded = list(rows)
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e}
                 for i, e in enumerate(encoded)],
        "model": engine.encoder.info.name,  # type: ignore[union-attr]
        "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens},
    }
    return _embedded_reply(body, out, len(inputs))


def embed(engine: Engine, raw: bytes, disconnected: Disconnected = None) -> Reply:
    """POST /embed: the TEI shape, one vector per input."""
    req = parse(EmbedRequest, raw)
    texts = _as_list(req.inputs)
    if req.prompt_name is not None:
        prefix = _prompt(engine, req.prompt_name)
        texts = [prefix + t for t in texts]
    out = _embed(
        engine, texts, disconnected,
        normalize=req.normalize,
        dimensions=req.dimensions,
        truncate=req.truncate,
        direction=req.truncation_direction,
    )
    return _embedded_reply(out.vectors, out, len(texts))


def tokenize(engine: Engine, raw: bytes, disconnected: Disconnected = None) -> Reply:
    """POST /tokenize: the TEI shape, token id, text and offsets per token."""
    req = parse(TokenizeRequest, raw)
    texts = _as_list(req.inputs)
    _check_count(engine.settings, texts)
    _check_nonempty(texts, "string")
    encoder = engine.wait_ready(engine.deadline())
    engine.check_chars(texts)
    reply = json_reply([[vars(p) for p in pieces] for pieces in encoder.pieces(texts)])
    reply.inputs = len(texts)
    return reply


POST_ROUTES: dict[str, Callable[[Engine, bytes, Disconnected], Reply]] = {
    "/v1/embeddings": embeddings,
    "/embeddings": embeddings,
    "/embed": embed,
    "/tokenize": tokenize,
}


# -- shared by the WSGI front and the Flask app -----------------------------------------------


def json_reply(body: Any, status: int = 200, headers: list[tuple[str, str]] | None = None
               ) -> Reply:
    return Reply(status, orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), headers or [])


def error_reply(engine: Engine, exc: ApiError) -> Reply:
    engine.metrics.count_rejection(exc.reason)
    return json_reply(exc.body(), exc.status, list(exc.headers.items()))


def check_api_key(settings: Settings, path: str, authorization: str | None) -> None:
    """401 unless the route is open or ``Authorization: Bearer <API_KEY>`` matches."""
    key = settings.api_key
    if not key or path in OPEN_ROUTES:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
        raise Unauthorized(
            "missing or wrong API key; send 'Authorization: Bearer <key>'", code="invalid_api_key"
        )


def record(engine: Engine, method: str, route: str, reply_status: int, seconds: float,
           inputs: int = 0, tokens: int = 0) -> None:
    """Count one answered request and write its access-log line."""
    engine.metrics.count_request(route, reply_status, seconds)
    if access_log.isEnabledFor(logging.INFO):
        access_log.info("%s %s %d inputs=%d tokens=%d ms=%.1f", method, route, reply_status,
                        inputs, tokens, seconds * 1000)


def too_large(size: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the body has {size} bytes, more than MAX_BODY_BYTES ({limit}); split the request",
        code="body_too_large",
    )


def parse(model: type[Request], raw: bytes) -> Any:
    """The validated request, or a 400 that names the field and what it must be."""
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
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None


# -- helpers ----------------------------------------------------------------------------------


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
    if all(items):
        return
    i = next(i for i, item in enumerate(items) if not item)
    raise InvalidRequest(
        f"input {i} is an empty {kind}; every input needs at least one character or id",
        param="input", code="empty_input",
    )


def _check_count(settings: Settings, inputs: list[Any]) -> None:
    limit = settings.max_inputs_per_request
    if len(inputs) > limit:
        raise InvalidRequest(
            f"the request has {len(inputs)} inputs, more than MAX_INPUTS_PER_REQUEST ({limit}); "
            "split it into several requests",
            param="input", code="too_many_inputs",
        )


def _embed(engine: Engine, inputs: list[Any], disconnected: Disconnected, **options: Any
           ) -> Embedded:
    _check_count(engine.settings, inputs)
    if isinstance(inputs[0], str):
        _check_nonempty(inputs, "string")
    return engine.embed(inputs, disconnected=disconnected, **options)


def _prompt(engine: Engine, name: str) -> str:
    prompts = engine.wait_ready(engine.deadline()).info.prompts
    if name not in prompts:
        known = ", ".join(sorted(prompts)) or "none"
        raise InvalidRequest(
            f"'prompt_name' {name!r} is not one of this model's prompts ({known})",
            param="prompt_name", code="invalid_prompt_name",
        )
    return prompts[name]


def _embedded_reply(body: Any, out: Embedded, inputs: int) -> Reply:
    reply = json_reply(body, headers=[
        ("x-queue-time", f"{out.queue_s * 1000:.3f}"),
        ("x-tokenization-time", f"{out.tokenize_s * 1000:.3f}"),
        ("x-inference-time", f"{out.inference_s * 1000:.3f}"),
        ("x-total-time", f"{out.total_s * 1000:.3f}"),
        ("x-compute-tokens", str(out.tokens)),
    ])
    reply.inputs = inputs
    reply.tokens = out.tokens
    return reply
