"""The handlers of rerankers, classifiers and sparse encoders, and of TEI's /similarity.

TEI's shapes: ``/rerank``, ``/predict``, ``/embed_sparse``, ``/similarity``. The Cohere/Jina
shape RAG frameworks call: ``/v1/rerank`` and ``/v2/rerank`` (the Cohere clients' paths),
and ``/rerank`` with a body that has ``documents`` instead of ``texts``. Their rows are in
the route table of routes.py; the pipeline refuses a route of another kind before these run.

Example (a reranker served)::

    POST /rerank {"query": "q", "texts": ["a", "b"]}  ->  [{"index": 1, "score": 0.9}, ...]
    POST /v1/rerank {"query": "q", "documents": ["a", "b"], "top_n": 1}
        ->  {"id": "...", "results": [{"index": 1, "relevance_score": 0.9}], "model": ...,
             "usage": {"prompt_tokens": 20, "total_tokens": 20}}
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from . import scoring
from .errors import InvalidRequest
from .schemas import (
    CohereRerankRequest,
    EmbedSparseRequest,
    PredictRequest,
    RerankRequest,
    SimilarityRequest,
)
from .scoring import Scored
from .sparse import elements
from .web import Call, Reply


def rerank(call: Call) -> Reply:
    """POST /rerank: TEI's shape; a Cohere/Jina body (``documents``) gets Cohere's answer."""
    if _cohere_body(call.body):
        return cohere_rerank(call)
    req = routes.parse(RerankRequest, call.body)
    _check_query(req.query)
    if not req.texts:
        raise InvalidRequest("'texts' must not be empty", param="texts", code="empty_input")
    out = _score(call, [(req.query, text) for text in req.texts], raw=req.raw_scores,
                 truncate=req.truncate, direction=req.truncation_direction)
    ranks = [{"index": i, "score": float(s)} for i, s in enumerate(out.scores[:, 0])]
    ranks.sort(key=lambda r: -r["score"])
    if req.return_text:
        for r in ranks:
            r["text"] = req.texts[r["index"]]
    return routes.embedded_reply(ranks, out, len(req.texts))


def cohere_rerank(call: Call) -> Reply:
    """POST /v1/rerank, /v2/rerank: the Cohere (and Jina) shape."""
    req = routes.parse(CohereRerankRequest, call.body)
    _check_query(req.query)
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    if not docs:
        raise InvalidRequest("'documents' must not be empty", param="documents",
                             code="empty_input")
    out = _score(call, [(req.query, doc) for doc in docs], raw=False)
    order = sorted(range(len(docs)), key=lambda i: -out.scores[i, 0])[: req.top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": float(out.scores[i, 0])}
        if req.return_documents:
            result["document"] = {"text": docs[i]}
        results.append(result)
    body = {
        "id": str(uuid.uuid4()),
        "results": results,
        "model": call.engine().info.name,
        "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens},
    }
    return routes.embedded_reply(body, out, len(docs))


def predict(call: Call) -> Reply:
    """POST /predict: a text, a pair, or a batch of them; every label's score, best first."""
    req = routes.parse(PredictRequest, call.body)
    single, inputs = _predict_inputs(req.inputs)
    out = _score(call, inputs, raw=req.raw_scores, truncate=req.truncate,
                 direction=req.truncation_direction)
    labels = call.engine().info.labels
    predictions = [
        sorted(({"score": float(s), "label": labels[j]} for j, s in enumerate(row)),
               key=lambda p: -p["score"])
        for row in out.scores
    ]
    return routes.embedded_reply(predictions[0] if single else predictions, out, len(inputs))


def embed_sparse(call: Call) -> Reply:
    """POST /embed_sparse: the non-zero (index, value) pairs of each input's sparse vector."""
    req = routes.parse(EmbedSparseRequest, call.body)
    texts = routes.as_list(req.inputs)
    engine = call.engine()
    if req.prompt_name is not None:
        prefix = routes.prompt(engine.info.prompts, req.prompt_name)
        texts = [prefix + t for t in texts]
    out, vectors = scoring.embed_sparse(
        engine, texts, truncate=req.truncate, direction=req.truncation_direction,
        deadline=call.deadline, disconnected=call.disconnected,
    )
    body = [elements(idx, val) for idx, val in vectors]
    return routes.embedded_reply(body, out, len(texts))


def similarity(call: Call) -> Reply:
    """POST /similarity: TEI's sentence similarity, the cosine of each sentence to the source."""
    req = routes.parse(SimilarityRequest, call.body)
    params = req.parameters
    source, sentences = req.inputs.source_sentence, req.inputs.sentences
    if not sentences:
        raise InvalidRequest("'inputs.sentences' must not be empty", param="inputs",
                             code="empty_input")
    engine = call.engine()
    truncate, direction = None, "right"
    if params is not None:
        truncate, direction = params.truncate, params.truncation_direction
        if params.prompt_name is not None:
            prefix = routes.prompt(engine.info.prompts, params.prompt_name)
            source, sentences = prefix + source, [prefix + s for s in sentences]
    out, cosines = scoring.similarities(engine, source, sentences, truncate=truncate,
                                        direction=direction, deadline=call.deadline,
                                        disconnected=call.disconnected)
    return routes.embedded_reply([float(c) for c in cosines], out, len(sentences) + 1)


_MAIN = {"reranker": rerank, "classifier": predict, "sparse": embed_sparse}


def main_route(call: Call) -> Reply:
    """POST / and /invocations: the served kind's main route, as TEI's (SageMaker) do."""
    return _MAIN.get(call.engine().info.kind, routes.embed)(call)


# -- helpers ----------------------------------------------------------------------------------


def _check_query(query: str) -> None:
    if not query:
        raise InvalidRequest("'query' must not be empty", param="query", code="empty_input")


def _cohere_body(raw: bytes) -> bool:
    """A /rerank body in the Cohere/Jina shape: ``documents`` and no ``texts``."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False  # routes.parse() reports it
    return isinstance(body, dict) and "documents" in body and "texts" not in body


def _predict_inputs(value: Any) -> tuple[bool, list[Any]]:
    """TEI's PredictInput: a text, ``[a]`` or ``[a, b]`` (one pair), or a list of those."""
    if isinstance(value, str):
        return True, [value]
    if value and all(isinstance(v, str) for v in value):
        return True, [_sequence(0, value)]
    return False, [_sequence(i, v) for i, v in enumerate(value)]


def _sequence(i: int, texts: list[str]) -> str | tuple[str, str]:
    if len(texts) == 1:
        return texts[0]
    if len(texts) == 2:
        return (texts[0], texts[1])
    raise InvalidRequest(
        f"input {i} has {len(texts)} texts; an input is a text, [text] or a pair [text, text]",
        param="inputs", code="invalid_inputs",
    )


def _score(call: Call, inputs: list[Any], **options: Any) -> Scored:
    return scoring.score(call.engine(), inputs, deadline=call.deadline,
                         disconnected=call.disconnected, **options)


# Last: routes.py imports this module to build its table, and its helpers are used only when
# a request arrives, so either module may be imported first.
from . import routes  # noqa: E402
