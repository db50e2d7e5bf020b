"""TEI's routes: ``/embed``, ``/embed_all``, ``/decode``, ``/tokenize``, and the routes of the
other kinds (``/rerank``, ``/predict``, ``/embed_sparse``), ``/similarity`` and the main route
(``POST /``, ``/invocations``). TEI's request and response shapes are the reference.

Example (a reranker served)::

    POST /rerank {"query": "q", "texts": ["a", "b"]}  ->  [{"index": 1, "score": 0.9}, ...]

A handler takes a ``Call`` and returns a ``Reply``; the pipeline (wsgi.py) does what every
route shares:

>>> import time
>>> from embedsvc.model.fake import FakeEncoder
>>> from embedsvc.service import Service
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

from typing import Any

from .. import rules, scoring
from ..errors import InvalidRequest
from ..model.sparse import elements
from . import cohere
from .bodies import as_list, parse
from .schemas import (
    DecodeRequest,
    EmbedAllRequest,
    EmbedRequest,
    EmbedSparseRequest,
    PredictRequest,
    RerankRequest,
    SimilarityRequest,
    TokenizeRequest,
)
from .web import Call, Reply, embedded_reply, json_reply, score


def embed(call: Call) -> Reply:
    """POST /embed: the TEI shape, one vector per input (texts or the model's token ids)."""
    req = parse(EmbedRequest, call.body)
    engine = call.engine()
    inputs = rules.prompted(engine.info.prompts, req.prompt_name, as_list(req.inputs))
    out = engine.embed(inputs, normalize=req.normalize, dimensions=req.dimensions,
                       truncate=req.truncate, direction=req.truncation_direction,
                       deadline=call.deadline, disconnected=call.disconnected)
    return embedded_reply(out.vectors, out, len(inputs))


def embed_all(call: Call) -> Reply:
    """POST /embed_all: the TEI shape, per input one raw vector per token."""
    req = parse(EmbedAllRequest, call.body)
    engine = call.engine()
    inputs = rules.prompted(engine.info.prompts, req.prompt_name, as_list(req.inputs))
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


def rerank(call: Call) -> Reply:
    """POST /rerank: TEI's shape; a Cohere/Jina body (``documents``) gets Cohere's answer."""
    if cohere.is_cohere_body(call.body):
        return cohere.cohere_rerank(call)
    req = parse(RerankRequest, call.body)
    rules.check_query(req.query)
    if not req.texts:
        raise InvalidRequest("'texts' must not be empty", param="texts", code="empty_input")
    out = score(call, [(req.query, text) for text in req.texts], raw=req.raw_scores,
                 truncate=req.truncate, direction=req.truncation_direction)
    ranks = [{"index": i, "score": float(s)} for i, s in enumerate(out.scores[:, 0])]
    ranks.sort(key=lambda r: -r["score"])
    if req.return_text:
        for r in ranks:
            r["text"] = req.texts[r["index"]]
    return embedded_reply(ranks, out, len(req.texts))


def predict(call: Call) -> Reply:
    """POST /predict: a text, a pair, or a batch of them; every label's score, best first."""
    req = parse(PredictRequest, call.body)
    single, inputs = _predict_inputs(req.inputs)
    out = score(call, inputs, raw=req.raw_scores, truncate=req.truncate,
                 direction=req.truncation_direction)
    labels = call.engine().info.labels
    predictions = [
        sorted(({"score": float(s), "label": labels[j]} for j, s in enumerate(row)),
               key=lambda p: -p["score"])
        for row in out.scores
    ]
    return embedded_reply(predictions[0] if single else predictions, out, len(inputs))


def embed_sparse(call: Call) -> Reply:
    """POST /embed_sparse: the non-zero (index, value) pairs of each input's sparse vector."""
    req = parse(EmbedSparseRequest, call.body)
    texts = as_list(req.inputs)
    engine = call.engine()
    if req.prompt_name is not None:
        prefix = rules.prompt(engine.info.prompts, req.prompt_name)
        texts = [prefix + t for t in texts]
    out, vectors = scoring.embed_sparse(
        engine, texts, truncate=req.truncate, direction=req.truncation_direction,
        deadline=call.deadline, disconnected=call.disconnected,
    )
    body = [elements(idx, val) for idx, val in vectors]
    return embedded_reply(body, out, len(texts))


def similarity(call: Call) -> Reply:
    """POST /similarity: TEI's sentence similarity, the cosine of each sentence to the source."""
    req = parse(SimilarityRequest, call.body)
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
            prefix = rules.prompt(engine.info.prompts, params.prompt_name)
            source, sentences = prefix + source, [prefix + s for s in sentences]
    out, cosines = scoring.similarities(engine, source, sentences, truncate=truncate,
                                        direction=direction, deadline=call.deadline,
                                        disconnected=call.disconnected)
    return embedded_reply([float(c) for c in cosines], out, len(sentences) + 1)


_MAIN = {"reranker": rerank, "classifier": predict, "sparse": embed_sparse}


def main_route(call: Call) -> Reply:
    """POST / and /invocations: the served kind's main route, as TEI's (SageMaker) do."""
    return _MAIN.get(call.engine().info.kind, embed)(call)


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
