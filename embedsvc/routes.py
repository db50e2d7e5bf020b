"""The route handlers and the route table: a ``Call`` in, a ``Reply`` out.

The request pipeline (``app.Pipeline``) does everything every route shares: API key,
method, body limit, errors, metrics and the access log. A handler parses its body,
asks the engine and shapes the answer.

>>> from embedsvc.encoder import FakeEncoder
>>> from embedsvc.service import Service
>>> import time
>>> from embedsvc.settings import Settings
>>> service = Service(Settings(), encoder=FakeEncoder(dimension=4))
>>> service.start(background=False)
>>> reply = embed(Call(service, b'{"inputs": "hi"}', time.monotonic()))
>>> reply.status, reply.inputs
(200, 1)
>>> service.drain(timeout=1.0).failed
0
"""

from __future__ import annotations

import base64
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from . import __version__, kind_routes, rules, schemas
from .engine import Embedded
from .errors import InvalidRequest, Unavailable
from .kinds import tei_model_type
from .openai_tokens import decode_ids
from .openapi import openapi_document
from .schemas import (
    DecodeRequest,
    EmbedAllRequest,
    EmbeddingsRequest,
    EmbedRequest,
    Request,
    TokenizeRequest,
)
from .web import Call, Reply, Route, json_reply

_INPUT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"
_TEXT_SHAPES = "a string or a list of strings"
_openapi_body: bytes | None = None
_HEALTH_REASONS = {
    "loading": "the model is loading",
    "draining": "the server is shutting down",
    "unhealthy": "the model failed to load or the batcher is not running; see the log",
}


# -- embedding routes -------------------------------------------------------------------------


def embeddings(call: Call) -> Reply:
    """POST /v1/embeddings and /embeddings: the OpenAI shape."""
    req = parse(EmbeddingsRequest, call.body)
    inputs = as_list(req.input)
    engine = call.engine()
    if inputs and isinstance(inputs[0], list) and engine.settings.token_ids == "openai":
        # OpenAI clients send ids of the tiktoken encoding of the model they name. The
        # rules run on the ids as sent (count, empty lists) before they become texts.
        s = engine.settings
        rules.check_inputs(inputs, max_inputs=s.max_inputs_per_request,
                           max_chars=s.max_input_chars)
        inputs = decode_ids(inputs, req.model)
    out = engine.embed(inputs, normalize=True, dimensions=req.dimensions,
                       deadline=call.deadline, disconnected=call.disconnected)
    if req.encoding_format == "base64":
        encoded: list[Any] = [base64.b64encode(r.astype("<f4").tobytes()).decode()
                              for r in out.vectors]
    else:
        encoded = list(out.vectors)
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e}
                 for i, e in enumerate(encoded)],
        "model": engine.info.name,
        "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens},
    }
    return embedded_reply(body, out, len(inputs))


def embed(call: Call) -> Reply:
    """POST /embed: the TEI shape, one vector per input (texts or the model's token ids)."""
    req = parse(EmbedRequest, call.body)
    engine = call.engine()
    inputs = prompted(engine.info.prompts, req.prompt_name, as_list(req.inputs))
    out = engine.embed(inputs, normalize=req.normalize, dimensions=req.dimensions,
                       truncate=req.truncate, direction=req.truncation_direction,
                       deadline=call.deadline, disconnected=call.disconnected)
    return embedded_reply(out.vectors, out, len(inputs))


def embed_all(call: Call) -> Reply:
    """POST /embed_all: the TEI shape, per input one raw vector per token."""
    req = parse(EmbedAllRequest, call.body)
    engine = call.engine()
    inputs = prompted(engine.info.prompts, req.prompt_name, as_list(req.inputs))
    rows, tokens = engine.embed_all(inputs, truncate=req.truncate,
                                    direction=req.truncation_direction, deadline=call.deadline,
                                    disconnected=call.disconnected)
    reply = json_reply(rows, headers=[("x-compute-tokens", str(tokens))])
    reply.inputs, reply.tokens = len(inputs), tokens
    return reply


def decode(call: Call) -> Reply:
    """POST /decode: the TEI shape, the served model's token ids back to text."""
    req = parse(DecodeRequest, call.body)
    batch = as_list(req.ids)
    reply = json_reply(call.engine().decode(batch, req.skip_special_tokens))
    reply.inputs = len(batch)
    return reply


def tokenize(call: Call) -> Reply:
    """POST /tokenize: the TEI shape, token id, text and offsets per token."""
    req = parse(TokenizeRequest, call.body)
    texts = as_list(req.inputs)
    pieces = call.engine().pieces(texts, deadline=call.deadline, disconnected=call.disconnected)
    reply = json_reply([[vars(p) for p in row] for row in pieces])
    reply.inputs = len(texts)
    return reply


# -- service routes ---------------------------------------------------------------------------


def info(call: Call) -> Reply:
    """GET /info: the model, the limits and this process; TEI's fields among them."""
    service = call.service
    s, model = service.settings, service.model
    return json_reply({
        "model_id": model.name if model else None,
        "model_sha": None,
        "model_dtype": model.dtype if model else None,
        "served_model_name": model.name if model else None,
        "model_type": tei_model_type(model) if model else None,
        "kind": model.kind if model else None,
        "labels": list(model.labels) if model else None,
        "dimension": model.dimension if model else None,
        "max_input_length": model.max_input_tokens if model else None,
        "device": model.device if model else None,
        "dtype": model.dtype if model else None,
        "backend": model.backend if model else None,
        "parameters": model.parameters if model else None,
        "max_concurrent_requests": service.queue_limit,  # TEI's: inputs admitted at once
        "max_batch_tokens": s.max_batch_tokens,
        "max_batch_requests": s.max_batch_size,
        "max_batch_size": s.max_batch_size,
        "max_wait_ms": s.max_wait_ms,
        "max_queue": service.queue_limit,
        "max_client_batch_size": s.max_inputs_per_request,
        "auto_truncate": s.auto_truncate,
        "tokenization_workers": s.threads,  # request threads tokenize their own inputs
        "version": __version__,
        "sha": None,
        "docker_label": None,
        "pid": service.pid,
        "state": service.state,
    })


def health(call: Call) -> Reply:
    """GET /health: 200 once the model is loaded and the batcher runs, else 503 and why."""
    state = call.service.state
    if state != "ready":
        raise Unavailable(_HEALTH_REASONS.get(state, state), code=state)
    return json_reply({"status": "ok"})


def metrics(call: Call) -> Reply:
    """GET /metrics: the Prometheus text exposition."""
    return Reply(200, generate_latest(call.service.metrics.registry),
                 content_type=CONTENT_TYPE_LATEST)


def openapi(call: Call) -> Reply:
    """GET /openapi.json: this table, as OpenAPI 3.1."""
    global _openapi_body
    if _openapi_body is None:
        _openapi_body = orjson.dumps(openapi_document(ROUTES))
    return Reply(200, _openapi_body)


# -- the route table --------------------------------------------------------------------------

_EMBEDDING = frozenset({"embedding"})
_MAIN_ROUTE = ("The served model's main route, by its kind, as TEI's: /embed (embedding), "
               "/rerank (reranker), /predict (classifier), /embed_sparse (sparse)")
_RERANKER = frozenset({"reranker"})
_COHERE = ("Cohere/Jina rerank: the best documents for a query, with relevance scores "
           "(a reranker model)")

_HEALTH_SUMMARY = ("200 once the model is loaded and the batcher runs; 503 with code loading, "
                   "unhealthy or draining")
_EMBEDDINGS = Route("/v1/embeddings", "POST", embeddings, "OpenAI-compatible embeddings",
                    EmbeddingsRequest, schemas.EMBEDDINGS_RESPONSE, kinds=_EMBEDDING)

ROUTES: tuple[Route, ...] = (
    _EMBEDDINGS,
    Route("/embeddings", "POST", embeddings, _EMBEDDINGS.summary, EmbeddingsRequest,
          schemas.EMBEDDINGS_RESPONSE, kinds=_EMBEDDING),
    Route("/embed", "POST", embed, "TEI-compatible embeddings, one vector per input",
          EmbedRequest, schemas.VECTORS, kinds=_EMBEDDING),
    Route("/similarity", "POST", kind_routes.similarity, "TEI's sentence similarity: the "
          "cosine of each sentence to the source sentence (an embedding model)",
          schemas.SimilarityRequest, {"type": "array", "items": {"type": "number"}},
          kinds=_EMBEDDING),
    Route("/rerank", "POST", kind_routes.rerank, "TEI's rerank: texts scored against a query, "
          "best first (a reranker model); a body with 'documents' instead of 'texts' is read "
          "and answered in the Cohere/Jina shape of /v1/rerank", schemas.RerankRequest,
          schemas.RANKS, kinds=_RERANKER),
    Route("/v1/rerank", "POST", kind_routes.cohere_rerank, _COHERE,
          schemas.CohereRerankRequest, schemas.COHERE_RERANK_RESPONSE, kinds=_RERANKER),
    Route("/v2/rerank", "POST", kind_routes.cohere_rerank, _COHERE + "; Cohere's v2 path",
          schemas.CohereRerankRequest, schemas.COHERE_RERANK_RESPONSE, kinds=_RERANKER),
    Route("/predict", "POST", kind_routes.predict, "TEI's predict: every label's score for a "
          "text, a pair or a list of them (a classifier or reranker model)",
          schemas.PredictRequest, schemas.PREDICTIONS,
          kinds=frozenset({"classifier", "reranker"})),
    Route("/embed_sparse", "POST", kind_routes.embed_sparse, "TEI's sparse embeddings: the "
          "non-zero vocabulary entries of each input (a sparse model such as SPLADE)",
          schemas.EmbedSparseRequest, schemas.SPARSE_VECTORS, kinds=frozenset({"sparse"})),
    Route("/", "POST", kind_routes.main_route, _MAIN_ROUTE, response=schemas.OBJECT),
    Route("/invocations", "POST", kind_routes.main_route, _MAIN_ROUTE + " (SageMaker's path)",
          response=schemas.OBJECT),
    Route("/tokenize", "POST", tokenize, "The tokens the model sees for each input",
          TokenizeRequest, schemas.TOKENS),
    Route("/embed_all", "POST", embed_all, "TEI-compatible per-token vectors: per input, one "
          "raw vector per token", EmbedAllRequest, schemas.TOKEN_VECTORS,
          kinds=frozenset({"embedding"})),
    Route("/decode", "POST", decode, "TEI-compatible: the served model's token ids back to text",
          DecodeRequest, schemas.TEXTS),
    Route("/info", "GET", info, "Model, device, limits, version and pid, with TEI's fields",
          response=schemas.INFO),
    Route("/health", "GET", health, _HEALTH_SUMMARY, response=schemas.HEALTH, open=True),
    Route("/", "GET", health, "TEI's health alias: as /health", response=schemas.HEALTH,
          open=True),
    Route("/ping", "GET", health, "SageMaker's health alias: as /health",
          response=schemas.HEALTH, open=True),
    Route("/metrics", "GET", metrics, "Prometheus text exposition", open=True),
    Route("/openapi.json", "GET", openapi, "This document", response=schemas.OBJECT),
)


# -- helpers ----------------------------------------------------------------------------------


def parse(model: type[Request], raw: bytes) -> Any:
    """The validated request, or a 400 that names the field and what it must be."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest(
            "the body is not valid JSON; send a JSON object such as {\"input\": \"some text\"}",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequest(
            f"the body must be a JSON object, not {type(body).__name__}", code="invalid_json"
        )
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc, model) from None


def as_list(value: Any) -> list[Any]:
    """One input or a list of them, as a list (a flat list of ids is one input)."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [value]
    return value


def prompted(prompts: dict[str, str], name: str | None, inputs: list[Any]) -> list[Any]:
    """Texts with the named prompt put before each; token ids cannot take one."""
    if name is None:
        return inputs
    prefix = prompt(prompts, name)
    if inputs and not isinstance(inputs[0], str):
        raise InvalidRequest("'prompt_name' applies to text inputs; with token ids, put the "
                             "prompt's ids first", param="prompt_name", code="invalid_prompt_name")
    return [prefix + t for t in inputs]


def prompt(prompts: dict[str, str], name: str) -> str:
    if name not in prompts:
        known = ", ".join(sorted(prompts)) or "none"
        raise InvalidRequest(
            f"'prompt_name' {name!r} is not one of this model's prompts ({known})",
            param="prompt_name", code="invalid_prompt_name",
        )
    return prompts[name]


def embedded_reply(body: Any, out: Embedded, inputs: int) -> Reply:
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


def _invalid(exc: ValidationError, model: type[Request]) -> InvalidRequest:
    first = exc.errors(include_url=False)[0]
    loc = [str(x) for x in first["loc"]]
    param = loc[0] if loc else None
    if param in ("input", "inputs") and first["type"] != "missing":
        texts_only = model is TokenizeRequest
        message = f"'{param}' must be {_TEXT_SHAPES if texts_only else _INPUT_SHAPES}"
    elif first["type"] == "missing":
        message = f"'{param}' is required"
    else:
        message = f"'{param}': {first['msg']}"
    return InvalidRequest(message, param=param, code="invalid_" + (param or "body"))
