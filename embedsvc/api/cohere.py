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
from ..work import EMBED, IMAGE, SCORE, Embedded, ImageRef
from . import typed
from .bodies import parse
from .schemas import CohereEmbedRequest, CohereRerankRequest
from .shapes import content_item
from .web import Call, Reply, embedded_reply

_ROLES = {"search_query": "query", "search_document": "document",
          "classification": "classification", "clustering": "clustering"}
# Cohere's truncate: which end of an over-long text goes, or a 400 (NONE); null: AUTO_TRUNCATE.
_TRUNCATE: dict[str | None, tuple[bool | None, str]] = {
    None: (None, "right"), "END": (True, "right"), "START": (True, "left"),
    "NONE": (False, "right"),
}
_REFUSED = {
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
    param, inputs = _sent(req)
    truncate, direction = _TRUNCATE[req.truncate]
    types = dict.fromkeys(req.embedding_types or ["float"])  # in order, once each
    codes = tuple(t for t in types if t not in ("float", "base64"))
    if param == "texts":
        texts = typed.with_role(call.info, inputs, req.input_type, _ROLES, "input_type")
        work = call.work(EMBED, texts, normalize=True, dimensions=req.output_dimension,
                         dimensions_param="output_dimension", truncate=truncate,
                         direction=direction, codes=codes, param="texts")
    else:
        if codes:
            raise InvalidRequest(f"{', '.join(codes)} embeddings of images are not served; "
                                 "ask for float or base64", param="embedding_types",
                                 code="not_supported")
        role = None if req.input_type == "image" else req.input_type
        typed.with_role(call.info, [], role, _ROLES, "input_type")  # an unknown role: 400
        inputs = [typed.with_role(call.info, [item], role, _ROLES, "input_type")[0]
                  if type(item) is str else item for item in inputs]
        work = call.work(IMAGE, inputs, normalize=True, dimensions=req.output_dimension,
                         dimensions_param="output_dimension", truncate=truncate,
                         direction=direction, param=param)
    out = call.run(work)
    body: dict[str, Any] = {"id": str(uuid.uuid4())}
    if v1 and req.embedding_types is None:
        body.update(response_type="embeddings_floats", embeddings=out.vectors)
    else:
        by_type = {t: _as_type(out, t) for t in types}
        body.update(response_type="embeddings_by_type", embeddings=by_type)
    body["texts"] = req.texts or []
    body["meta"] = {"api_version": {"version": "1" if v1 else "2"},
                    "billed_units": {"input_tokens": out.tokens}}
    return embedded_reply(body, out, len(inputs))


def _sent(req: CohereEmbedRequest) -> tuple[str, list[Any]]:
    """Which of ``texts``, ``images`` and ``inputs`` the request sent (exactly one), and
    its inputs: texts, or texts and ``ImageRef``s."""
    sent = [name for name in ("texts", "images", "inputs") if getattr(req, name) is not None]
    if len(sent) != 1:
        raise InvalidRequest("send one of 'texts', 'images' and 'inputs'" if sent else
                             "'texts' is required (or 'images', or 'inputs')",
                             param=sent[-1] if sent else "texts", code="invalid_texts")
    param = sent[0]
    rules.check_listed(getattr(req, param), param)
    if param == "texts":
        return param, req.texts  # type: ignore[return-value]
    if param == "images":
        return param, [ImageRef(source, "images", f"images[{i}]")
                       for i, source in enumerate(req.images or [])]
    return param, [_content(item, i) for i, item in enumerate(req.inputs or [])]


def _content(item: Any, i: int) -> str | ImageRef:
    """One of v2's ``inputs``: ``{"content": [part]}``, one text or image_url part."""
    parts = item.get("content") if type(item) is dict else None
    if type(parts) is not list or len(parts) != 1:
        raise InvalidRequest(f"'inputs[{i}]' must be {{\"content\": [part]}} with one text or "
                             "image_url part: this model embeds texts and images each alone, "
                             "not fused", param="inputs", code="invalid_inputs")
    return content_item(parts[0], f"inputs[{i}].content[0]")


def _as_type(out: Embedded, dtype: str) -> Any:
    if dtype == "base64":
        return typed.base64_rows(out.vectors.astype(np.float32))
    return out.codes.get(dtype, out.vectors)
