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

from .. import rules
from ..errors import InvalidRequest
from ..work import EMBED, SCORE, SPARSE, TOKENS, elements
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
from .web import Call, Reply, embedded_reply, json_reply


def embed(call: Call) -> Reply:
    """POST /embed: the TEI shape, one vector per input (texts or the model's token ids)."""
    req = parse(EmbedRequest, call)
    inputs = rules.prompted(call.info.prompts, req.prompt_name, as_list(req.inputs))
    out = call.run(call.work(EMBED, inputs, normalize=req.normalize, dimensions=req.dimensions,
                             param="inputs",
                             truncate=req.truncate, direction=req.truncation_direction))
    return embedded_reply(out.vectors, out, len(inputs))


def embed_all(call: Call) -> Reply:
    """POST /embed_all: the TEI shape, per input one raw vector per token."""
    req = parse(EmbedAllRequest, call)
    inputs = rules.prompted(call.info.prompts, req.prompt_name, as_list(req.inputs))
    out = call.run(call.work(TOKENS, inputs, truncate=req.truncate, param="inputs",
                             direction=req.truncation_direction))
    reply = json_reply(out.token_vectors, headers=[("x-compute-tokens", str(out.tokens))])
    reply.inputs, reply.tokens = len(inputs), out.tokens
    return reply


def decode(call: Call) -> Reply:
    """POST /decode: the TEI shape, the served model's token ids back to text."""
    req = parse(DecodeRequest, call)
    batch = as_list(req.ids)
    texts = call.engine_client().decode(batch, req.skip_special_tokens, deadline=call.deadline,
                                 disconnected=call.disconnected)  # the host: no device turn
    reply = json_reply(texts)
    reply.inputs = len(batch)
    return reply


def tokenize(call: Call) -> Reply:
    """POST /tokenize: the TEI shape, token id, text and offsets per token."""
    req = parse(TokenizeRequest, call)
    texts = rules.prompted(call.info.prompts, req.prompt_name, as_list(req.inputs))
    pieces = call.engine_client().pieces(  # on the host's budget: no turn of the device
        texts, special=req.add_special_tokens, deadline=call.deadline,
        disconnected=call.disconnected)
    reply = json_reply([[vars(p) for p in row] for row in pieces])
    reply.inputs = len(texts)
    return reply


def rerank(call: Call) -> Reply:
    """POST /rerank: TEI's shape; a Cohere/Jina body (``documents``) gets Cohere's answer."""
    if cohere.is_cohere_body(call.body):
        return cohere.cohere_rerank(call)
    req = parse(RerankRequest, call)
    out = call.run(call.work(SCORE, req.texts, query=req.query, param="texts",
                             raw=req.raw_scores, truncate=req.truncate,
                             direction=req.truncation_direction))
    ranks = [{"index": i, "score": float(s)} for i, s in enumerate(out.vectors[:, 0])]
    ranks.sort(key=lambda r: -r["score"])
    if req.return_text:
        for r in ranks:
            r["text"] = req.texts[r["index"]]
    return embedded_reply(ranks, out, len(req.texts))


def predict(call: Call) -> Reply:
    """POST /predict: a text, a pair, or a batch of them; every label's score, best first."""
    req = parse(PredictRequest, call)
    single, inputs = _predict_inputs(req.inputs)
    out = call.run(call.work(SCORE, inputs, raw=req.raw_scores, truncate=req.truncate,
                             param="inputs",
                             direction=req.truncation_direction))
    labels = call.info.labels
    predictions = [
        [{"score": float(s), "label": labels[j]}
         for s, j in sorted(((float(s), j) for j, s in enumerate(row)), key=lambda sj: -sj[0])]
        for row in out.vectors
    ]
    return embedded_reply(predictions[0] if single else predictions, out, len(inputs))


def embed_sparse(call: Call) -> Reply:
    """POST /embed_sparse: the non-zero (index, value) pairs of each input's sparse vector."""
    req = parse(EmbedSparseRequest, call)
    texts = rules.prompted(call.info.prompts, req.prompt_name, as_list(req.inputs))
    out = call.run(call.work(SPARSE, texts, normalize=False, truncate=req.truncate,
                             param="inputs",
                             direction=req.truncation_direction))
    body = [elements(idx, val) for idx, val in out.sparse or ()]
    return embedded_reply(body, out, len(texts))


def similarity(call: Call) -> Reply:
    """POST /similarity: TEI's sentence similarity, the cosine of each sentence to the source."""
    req = parse(SimilarityRequest, call)
    params = req.parameters
    truncate, direction, name = None, "right", None
    if params is not None:
        truncate, direction, name = params.truncate, params.truncation_direction, params.prompt_name
    source, *sentences = rules.prompted(call.info.prompts, name,
                                        [req.inputs.source_sentence, *req.inputs.sentences])
    rules.check_listed(sentences, "inputs.sentences")
    out = call.run(call.work(EMBED, [source, *sentences], normalize=True, truncate=truncate,
                             param="inputs",
                             direction=direction))
    cosines = out.vectors[1:] @ out.vectors[0]
    return embedded_reply([float(c) for c in cosines], out, len(sentences) + 1)


_MAIN = {"reranker": rerank, "classifier": predict, "sparse": embed_sparse}


def main_route(call: Call) -> Reply:
    """POST / and /invocations: the served kind's main route, as TEI's (SageMaker) do."""
    return _MAIN.get(call.info.kind, embed)(call)


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
