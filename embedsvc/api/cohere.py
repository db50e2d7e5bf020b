"""The Cohere shapes: rerank (``/v1/rerank``, ``/v2/rerank``, and TEI's ``/rerank`` given
``documents``), as the Cohere and Jina clients and the RAG frameworks call them."""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from .bodies import parse
from .schemas import CohereRerankRequest
from .web import Call, Reply, embedded_reply


def cohere_rerank(call: Call) -> Reply:
    """POST /v1/rerank, /v2/rerank: the Cohere (and Jina) shape."""
    req = parse(CohereRerankRequest, call)
    docs = req.documents  # strings: the shape reads {"text": ...} objects
    out = call.engine().rerank(req.query, docs, param="documents", **call.waits)
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
        "model": call.engine().info.name,
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
