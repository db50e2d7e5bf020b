"""The Cohere shapes: rerank (``/v1/rerank``, ``/v2/rerank``, and TEI's ``/rerank`` given
``documents``) and embed (``/v1/embed``, ``/v2/embed``), as the Cohere and Jina clients and
the RAG frameworks call them.

Embed answers every type of ``embedding_types`` from one pass through the model::

    POST /v2/embed {"texts": ["a"], "embedding_types": ["float", "int8"]}
      ->  {"id": ..., "embeddings": {"float": [[...]], "int8": [[...]]}, "texts": ["a"], ...}
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import orjson

from .. import rules
from ..errors import InvalidRequest
from ..work import EMBED, SCORE, Embedded
from . import typed
from .bodies import parse
from .schemas import CohereEmbedRequest, CohereRerankRequest
from .web import Call, Reply, embedded_reply

_ROLES = {"search_query": "query", "search_document": "document",
          "classification": "classification", "clustering": "clustering"}
# Cohere's truncate: which end of an over-long text goes, or a 400 (NONE); null: AUTO_TRUNCATE.
_TRUNCATE: dict[str | None, tuple[bool | None, str]] = {
    None: (None, "right"), "END": (True, "right"), "START": (True, "left"),
    "NONE": (False, "right"),
}
_REFUSED = {
    "images": "this server embeds text only; send 'texts'",
    "inputs": "send the texts as 'texts' (a list of strings)",
    "max_tokens": "inputs are cut to the model's own limit; leave 'max_tokens' out and use "
                  "'truncate'",
}


def cohere_rerank(call: Call) -> Reply:
    """POST /v1/rerank, /v2/rerank: the Cohere (and Jina) shape."""
    req = parse(CohereRerankRequest, call)
    docs = req.documents  # strings: the shape reads {"text": ...} objects
    out = call.run(call.work(SCORE, docs, query=req.query, param="documents"))
    order = sorted(range(len(docs)), key=lambda i: -out.vectors[i, 0])[: req.top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": float(out.vectors[i, 0])}
        if req.return_documents:
            result["document"] = {"text": docs[i]}
        results.append(result)
    body = {
        "id": str(uuid.uuid4()),
        "results": results,
        "model": call.info.name,
        "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens},
    }
    return embedded_reply(body, out, len(docs))


def is_cohere_body(raw: bytes) -> bool:
    """A /rerank body in the Cohere/Jina shape: ``documents`` and no ``texts``."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False  # parse() reports it
    return isinstance(body, dict) and "documents" in body and "texts" not in body


def cohere_embed_v2(call: Call) -> Reply:
    """POST /v2/embed: Cohere's v2 shape, embeddings by type (float unless asked)."""
    return _cohere_embed(call, v1=False)


def cohere_embed_v1(call: Call) -> Reply:
    """POST /v1/embed: Cohere's v1 shape, embeddings_floats unless embedding_types is given."""
    return _cohere_embed(call, v1=True)


def _cohere_embed(call: Call, *, v1: bool) -> Reply:
    req = parse(CohereEmbedRequest, call)
    for field, fix in _REFUSED.items():
        if getattr(req, field) is not None:
            raise InvalidRequest(f"'{field}' is not supported: {fix}", param=field,
                                 code="not_supported")
    rules.check_listed(req.texts, "texts")
    texts = typed.with_role(call.info, req.texts, req.input_type, _ROLES, "input_type")
    truncate, direction = _TRUNCATE[req.truncate]
    types = dict.fromkeys(req.embedding_types or ["float"])  # in order, once each
    codes = tuple(t for t in types if t not in ("float", "base64"))
    out = call.run(call.work(EMBED, texts, normalize=True, dimensions=req.output_dimension,
                             truncate=truncate, direction=direction, codes=codes))
    body: dict[str, Any] = {"id": str(uuid.uuid4())}
    if v1 and req.embedding_types is None:
        body.update(response_type="embeddings_floats", embeddings=out.vectors)
    else:
        by_type = {t: _as_type(out, t) for t in types}
        body.update(response_type="embeddings_by_type", embeddings=by_type)
    body["texts"] = req.texts
    body["meta"] = {"api_version": {"version": "1" if v1 else "2"},
                    "billed_units": {"input_tokens": out.tokens}}
    return embedded_reply(body, out, len(texts))


def _as_type(out: Embedded, dtype: str) -> Any:
    if dtype == "base64":
        return typed.base64_rows(out.vectors.astype(np.float32))
    return out.codes.get(dtype, out.vectors)
