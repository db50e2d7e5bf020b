"""The OpenAI embeddings route: ``POST /v1/embeddings`` (and ``/embeddings``), with the fields
Voyage's and Jina's clients add: an input role (``input_type``, ``task``), an output width
(``output_dimension``) and type (``output_dtype``, ``embedding_type``). Each is honoured or
refused: a client that asked for int8 and read float32 bytes as codes would compute garbage.
"""

from __future__ import annotations

from typing import Any

from .. import rules
from ..errors import InvalidRequest
from . import typed
from .bodies import as_list, parse
from .openai_tokens import decode_ids
from .schemas import TypedEmbeddingsRequest
from .web import Call, Reply, embedded_reply

_VOYAGE_ROLES = {"query": "query", "document": "document"}
_JINA_ROLES = {"retrieval.query": "query", "retrieval.passage": "document",
               "text-matching": "similarity", "classification": "classification",
               "separation": "clustering"}


def embeddings(call: Call) -> Reply:
    """POST /v1/embeddings and /embeddings: the OpenAI shape."""
    req = parse(TypedEmbeddingsRequest, call.body)
    inputs = as_list(req.input)
    engine = call.engine()
    dimensions = _agreed(req, "dimensions", "output_dimension")
    dtype = _agreed(req, "output_dtype", "embedding_type") or "float"
    encoding = "base64" if dtype == "base64" else req.encoding_format
    dtype = "float" if dtype == "base64" else dtype
    normalize = req.normalized is not False
    if inputs and isinstance(inputs[0], list) and engine.settings.token_ids == "openai":
        # OpenAI clients send ids of the tiktoken encoding of the model they name. The
        # rules run on the ids as sent (count, empty lists) before they become texts.
        s = engine.settings
        rules.check_inputs(inputs, max_inputs=s.max_inputs_per_request,
                           max_chars=s.max_input_chars)
        inputs = decode_ids(inputs, req.model)
    inputs = _with_role(engine, inputs, req)
    out = engine.embed(inputs, normalize=normalize, dimensions=dimensions,
                       truncate=req.truncation, deadline=call.deadline,
                       disconnected=call.disconnected)
    rows = typed.encoded(engine, out.vectors, dtype, normalize=normalize, dimensions=dimensions)
    encoded: list[Any] = typed.base64_rows(rows) if encoding == "base64" else list(rows)
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e}
                 for i, e in enumerate(encoded)],
        "model": engine.info.name,
        "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens},
    }
    return embedded_reply(body, out, len(inputs))


def _agreed(req: TypedEmbeddingsRequest, name: str, alias: str) -> Any:
    """The value of a field two APIs spell differently; both, if they differ, is a 400."""
    value, other = getattr(req, name), getattr(req, alias)
    if value is not None and other is not None and value != other:
        raise InvalidRequest(f"'{name}' ({value}) and '{alias}' ({other}) disagree; send one",
                             param=alias, code=f"invalid_{alias}")
    return other if value is None else value


def _with_role(engine: Any, inputs: list[Any], req: TypedEmbeddingsRequest) -> list[Any]:
    """Texts with the prompt of Voyage's input_type or Jina's task, where the model has one."""
    if req.input_type is not None and req.task is not None:
        raise InvalidRequest("send 'input_type' (Voyage) or 'task' (Jina), not both",
                             param="task", code="invalid_task")
    sent, roles, param = ((req.task, _JINA_ROLES, "task") if req.task is not None
                          else (req.input_type, _VOYAGE_ROLES, "input_type"))
    if sent is None or not inputs or isinstance(inputs[0], str):
        return typed.with_role(engine, inputs, sent, roles, param)
    if typed.with_role(engine, ["x"], sent, roles, param) != ["x"]:  # it needs a prompt
        raise InvalidRequest(f"'{param}' puts a prompt before text inputs; with token ids, put "
                             "the prompt's ids first and leave it out", param=param,
                             code=f"invalid_{param}")
    return inputs
