"""The one route table: every route's path, method, handler, body and answer schemas, and
the model kinds it serves. The pipeline (wsgi.py) and ``/openapi.json`` are built from it.
"""

from __future__ import annotations

from typing import Any

import orjson

from ..errors import OLLAMA
from . import cohere, docs_page, ollama, openai, ops, schemas, tei
from .openapi import openapi_document
from .schemas import (
    DecodeRequest,
    EmbedAllRequest,
    EmbedRequest,
    TokenizeRequest,
    TypedEmbeddingsRequest,
)
from .web import Call, Reply, Route

_openapi_document: dict[str, Any] | None = None
_openapi_bodies: dict[tuple[Any, ...], bytes] = {}  # by the served models


def openapi(call: Call) -> Reply:
    """GET /openapi.json: this table, as OpenAPI 3.1, and the served models in
    ``info.x-embedsvc-models``: each one's name, kind and the modalities it takes."""
    global _openapi_document
    if _openapi_document is None:
        _openapi_document = openapi_document(ROUTES)
    models = tuple((m.name, m.kind, m.modalities) for m in
                   (service.model for service in call.service.models) if m is not None)
    body = _openapi_bodies.get(models)
    if body is None:
        served = [{"name": name, "kind": kind, "modalities": list(modalities)}
                  for name, kind, modalities in models]
        info = {**_openapi_document["info"], "x-embedsvc-models": served}
        document = {**_openapi_document, "info": info}
        body = _openapi_bodies[models] = orjson.dumps(document)
    return Reply(200, body)


# image-text models embed texts with their text tower on every embedding route, and images
# on the routes whose APIs carry them (/v1/embeddings, /embeddings, /v1/embed, /v2/embed)
_EMBEDDING = frozenset({"embedding", "image-text"})
_MAIN_ROUTE = ("The served model's main route, by its kind, as TEI's: /embed (embedding), "
               "/rerank (reranker), /predict (classifier), /embed_sparse (sparse)")
_RERANKER = frozenset({"reranker"})
_COHERE = ("Cohere/Jina rerank: the best documents for a query, with relevance scores "
           "(a reranker model)")

_HEALTH_SUMMARY = ("200 once the model is loaded and the batcher runs; 503 with code loading, "
                   "unhealthy or draining")
_EMBEDDINGS = Route("/v1/embeddings", "POST", openai.embeddings, "OpenAI-compatible "
                    "embeddings; also Voyage's and Jina's fields (input_type/task, "
                    "output_dimension, output_dtype/embedding_type: int8, uint8, binary, "
                    "ubinary)", TypedEmbeddingsRequest, schemas.EMBEDDINGS_RESPONSE,
                    kinds=_EMBEDDING)
_COHERE_EMBED = ("Cohere's embed API: every type of embedding_types (float, int8, uint8, "
                 "binary, ubinary, base64) from one pass (an embedding model)")
_OLLAMA_ONLY = "Ollama's; answers 501 in Ollama's error shape: this server embeds only"
_OLLAMA_ROUTES = tuple(
    Route(path, method, ollama.embeds_only, _OLLAMA_ONLY, response=schemas.OLLAMA_ERROR,
          errors=OLLAMA)
    for path, method in (("/api/generate", "POST"), ("/api/chat", "POST"),
                         ("/api/pull", "POST"), ("/api/push", "POST"), ("/api/create", "POST"),
                         ("/api/copy", "POST"), ("/api/delete", "DELETE"))
)
_DOCS_ASSETS = tuple(
    Route(f"/docs/{name}", "GET", docs_page.asset(name), f"The /docs page's {name}",
          open=True, listed=False)
    for name in docs_page.ASSETS
)

ROUTES: tuple[Route, ...] = (
    _EMBEDDINGS,
    Route("/embeddings", "POST", openai.embeddings, _EMBEDDINGS.summary, TypedEmbeddingsRequest,
          schemas.EMBEDDINGS_RESPONSE, kinds=_EMBEDDING),
    Route("/v1/models", "GET", openai.models, "OpenAI's model list: the served model",
          response=schemas.OPENAI_MODELS),
    Route("/v1/models/{model}", "GET", openai.model, "OpenAI's model by its id: the served "
          "model, or 404 model_not_found", response=schemas.OPENAI_MODEL),
    Route("/embed", "POST", tei.embed, "TEI-compatible embeddings, one vector per input",
          EmbedRequest, schemas.VECTORS, kinds=_EMBEDDING),
    Route("/similarity", "POST", tei.similarity, "TEI's sentence similarity: the "
          "cosine of each sentence to the source sentence (an embedding model)",
          schemas.SimilarityRequest, {"type": "array", "items": {"type": "number"}},
          kinds=_EMBEDDING),
    Route("/rerank", "POST", tei.rerank, "TEI's rerank: texts scored against a query, "
          "best first (a reranker model); a body with 'documents' instead of 'texts' is read "
          "and answered in the Cohere/Jina shape of /v1/rerank", schemas.RerankRequest,
          schemas.RANKS, kinds=_RERANKER),
    Route("/v2/embed", "POST", cohere.cohere_embed_v2, _COHERE_EMBED + "; v2's shape",
          schemas.CohereEmbedRequest, schemas.COHERE_EMBED_V2_RESPONSE, kinds=_EMBEDDING),
    Route("/v1/embed", "POST", cohere.cohere_embed_v1, _COHERE_EMBED + "; v1's shape "
          "(embeddings_floats unless embedding_types is given)", schemas.CohereEmbedRequest,
          schemas.COHERE_EMBED_V1_RESPONSE, kinds=_EMBEDDING),
    Route("/api/embed", "POST", ollama.embed, "Ollama's embeddings: normalised vectors, one "
          "per input", schemas.OllamaEmbedRequest, schemas.OLLAMA_EMBED_RESPONSE,
          kinds=_EMBEDDING, errors=OLLAMA),
    Route("/api/embeddings", "POST", ollama.embeddings, "Ollama's legacy embeddings: one "
          "prompt, the model's raw vector", schemas.OllamaEmbeddingsRequest,
          schemas.OLLAMA_EMBEDDING_RESPONSE, kinds=_EMBEDDING, errors=OLLAMA),
    Route("/api/tags", "GET", ollama.tags, "Ollama's model list: the served model, by the "
          "name:tag its clients check", response=schemas.OLLAMA_TAGS, errors=OLLAMA),
    Route("/api/ps", "GET", ollama.ps, "Ollama's running models: the served models that are "
          "ready, each held while the service runs", response=schemas.OLLAMA_PS, errors=OLLAMA),
    Route("/api/show", "POST", ollama.show, "Ollama's model details, by the name /api/tags "
          "lists", schemas.OllamaShowRequest, schemas.OLLAMA_SHOW, errors=OLLAMA),
    Route("/api/version", "GET", ollama.version, "Ollama's version route: embedsvc's version",
          response=schemas.OLLAMA_VERSION, errors=OLLAMA),
    *_OLLAMA_ROUTES,
    Route("/v1/rerank", "POST", cohere.cohere_rerank, _COHERE,
          schemas.CohereRerankRequest, schemas.COHERE_RERANK_RESPONSE, kinds=_RERANKER),
    Route("/v2/rerank", "POST", cohere.cohere_rerank, _COHERE + "; Cohere's v2 path",
          schemas.CohereRerankRequest, schemas.COHERE_RERANK_RESPONSE, kinds=_RERANKER),
    Route("/predict", "POST", tei.predict, "TEI's predict: every label's score for a "
          "text, a pair or a list of them (a classifier or reranker model)",
          schemas.PredictRequest, schemas.PREDICTIONS,
          kinds=frozenset({"classifier", "reranker"})),
    Route("/embed_sparse", "POST", tei.embed_sparse, "TEI's sparse embeddings: the "
          "non-zero vocabulary entries of each input (a sparse model such as SPLADE)",
          schemas.EmbedSparseRequest, schemas.SPARSE_VECTORS, kinds=frozenset({"sparse"})),
    Route("/", "POST", tei.main_route, _MAIN_ROUTE, response=schemas.MAIN_ROUTE),
    Route("/invocations", "POST", tei.main_route, _MAIN_ROUTE + " (SageMaker's path)",
          response=schemas.MAIN_ROUTE),
    Route("/tokenize", "POST", tei.tokenize, "The tokens the model sees for each input",
          TokenizeRequest, schemas.TOKENS),
    Route("/embed_all", "POST", tei.embed_all, "TEI-compatible per-token vectors: per input, one "
          "raw vector per token", EmbedAllRequest, schemas.TOKEN_VECTORS,
          kinds=frozenset({"embedding"})),
    Route("/decode", "POST", tei.decode, "TEI-compatible: the served model's token ids back to "
          "text", DecodeRequest, schemas.TEXTS),
    Route("/info", "GET", ops.info, "Model, device, limits, version and pid, with TEI's fields",
          response=schemas.INFO),
    Route("/health", "GET", ops.health, _HEALTH_SUMMARY, response=schemas.HEALTH, open=True),
    Route("/", "GET", ops.health, "TEI's health alias: as /health", response=schemas.HEALTH,
          open=True),
    Route("/ping", "GET", ops.health, "SageMaker's health alias: as /health",
          response=schemas.HEALTH, open=True),
    Route("/metrics", "GET", ops.metrics, "Prometheus text exposition", open=True),
    Route("/openapi.json", "GET", openapi, "This document", response=schemas.OBJECT),
    Route("/docs", "GET", docs_page.page, "This document as a page (Swagger UI, served "
          "locally)", open=True),
    Route("/docs/", "GET", docs_page.to_page, "Redirects to /docs", open=True, listed=False),
    *_DOCS_ASSETS,
)
