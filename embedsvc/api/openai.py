"""The OpenAI routes: ``POST /v1/embeddings`` (and ``/embeddings``), with the fields Voyage's
and Jina's clients add: an input role (``input_type``, ``task``), an output width
(``output_dimension``) and type (``output_dtype``, ``embedding_type``). Each is honoured or
refused: a client that asked for int8 and read float32 bytes as codes would compute garbage.
And ``GET /v1/models`` and ``/v1/models/{model}``, which many OpenAI-compatible tools call
first: the served model, in OpenAI's shape.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

from ..errors import InvalidRequest, NotFound, Unavailable
from ..work import EMBED, IMAGE, Embedded, ImageRef, ModelInfo
from . import typed
from .bodies import as_list, parse
from .openai_tokens import decode_ids
from .schemas import TypedEmbeddingsRequest
from .shapes import content_item
from .web import Call, Reply, embedded_reply, json_reply

_VOYAGE_ROLES = {"query": "query", "document": "document"}
_JINA_ROLES = {"retrieval.query": "query", "retrieval.passage": "document",
               "text-matching": "similarity", "classification": "classification",
               "separation": "clustering"}


def embeddings(call: Call) -> Reply:
    """POST /v1/embeddings and /embeddings: the OpenAI shape."""
    req = parse(TypedEmbeddingsRequest, call)
    if req.input is None or req.modality is not None or req.messages is not None:
        inputs = _inputs(req)
    else:  # OpenAI's own shapes: no call an input
        inputs = as_list(req.input)
    if ImageRef in set(map(type, inputs)):
        return _media(call, req, inputs)
    dimensions, dimensions_param = _agreed_named(req, "dimensions", "output_dimension")
    dtype = _agreed(req, "output_dtype", "embedding_type") or "float"
    encoding = "base64" if dtype == "base64" else req.encoding_format
    dtype = "float" if dtype == "base64" else dtype
    normalize = req.normalized is not False
    prefix = _role_prefix(call, req)
    decode = None
    if call.service.settings.token_ids == "openai":
        # OpenAI clients send ids of the tiktoken encoding of the model they name; as text,
        # they take the role's prompt too
        decode = partial(_decoded, model=req.model, prefix=prefix)
    inputs = _prompted(inputs, prefix, req, ids_take_prompts=decode is not None)
    codes = () if dtype == "float" else (dtype,)
    out = call.run(call.work(EMBED, inputs, normalize=normalize, dimensions=dimensions,
                             dimensions_param=dimensions_param, truncate=req.truncation,
                             decode=decode, codes=codes))
    return _answer(call, out, out.codes[dtype] if codes else out.vectors, encoding, len(inputs))


def _answer(call: Call, out: Embedded, rows: Any, encoding: str, count: int) -> Reply:
    """OpenAI's list of embeddings: ``rows`` as floats or base64, and the usage."""
    encoded: list[Any] = typed.base64_rows(rows) if encoding == "base64" else list(rows)
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e}
                 for i, e in enumerate(encoded)],
        "model": call.info.name,
        "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens},
    }
    return embedded_reply(body, out, count)


def _inputs(req: TypedEmbeddingsRequest) -> list[Any]:
    """The request's inputs: ``input`` (Infinity's ``modality: image`` reads its strings as
    images), or vLLM's ``messages``, one input each."""
    if (req.input is None) == (req.messages is None):
        raise InvalidRequest("send 'input'" + (" or 'messages', not both" if req.input
                                               is not None else ""),
                             param="input", code="invalid_input")
    if req.messages is not None:
        if not req.messages:  # named for the field sent, as an empty 'input' is
            raise InvalidRequest("'messages' must not be empty", param="messages",
                                 code="empty_input")
        return [_message(m, i) for i, m in enumerate(req.messages)]
    inputs = as_list(req.input)
    if req.modality == "image":
        return [_image(item, i) for i, item in enumerate(inputs)]
    return inputs


def _image(item: Any, i: int) -> Any:
    """An item of ``input`` under ``modality: image``: a string is an image; token ids are
    refused, not embedded as text the client did not send."""
    if type(item) is str:
        return ImageRef(item, "input", f"input[{i}]")
    if type(item) is list:
        raise InvalidRequest("with 'modality': 'image', 'input' holds images (base64 data "
                             "URIs), not token ids", param="input", code="invalid_input")
    return item


def _message(message: Any, i: int) -> str | ImageRef:
    """One of vLLM's messages as one input: its content, a string or one content part."""
    content = message.get("content") if type(message) is dict else None
    if type(content) is list and len(content) == 1:
        content = content[0]
    if type(content) is str or type(content) is dict:
        return content_item(content, f"messages[{i}].content")
    raise InvalidRequest(f"'messages[{i}]' must be a message whose content is a text or one "
                         "content part (text or image_url); this model embeds each input "
                         "alone", param="messages", code="invalid_messages")


def _media(call: Call, req: TypedEmbeddingsRequest, inputs: list[Any]) -> Reply:
    """/v1/embeddings with images among the inputs (an image-text model): floats only."""
    dtype = _agreed(req, "output_dtype", "embedding_type") or "float"
    if dtype not in ("float", "base64"):
        raise InvalidRequest(f"'{dtype}' embeddings of images are not served; ask for float",
                             param="embedding_type", code="not_supported")
    prefix = _role_prefix(call, req)
    inputs = [prefix + item if prefix and type(item) is str else item for item in inputs]
    dimensions, dimensions_param = _agreed_named(req, "dimensions", "output_dimension")
    out = call.run(call.work(IMAGE, inputs, normalize=req.normalized is not False,
                             dimensions=dimensions, dimensions_param=dimensions_param,
                             truncate=req.truncation))
    encoding = "base64" if dtype == "base64" else req.encoding_format
    return _answer(call, out, out.vectors, encoding, len(inputs))


def models(call: Call) -> Reply:
    """GET /v1/models: the served models, as OpenAI lists its models (a model still loading
    is listed once it is up)."""
    if not call.service.others:
        return json_reply({"object": "list", "data": [_model(call.engine_client().info)]})
    listed = []
    for service in call.service.models:
        try:
            listed.append(_model(service.ready(max(0.0, call.deadline - time.monotonic()))
                                 .info))
        except Unavailable:
            continue
    return json_reply({"object": "list", "data": listed})


def model(call: Call) -> Reply:
    """GET /v1/models/{model}: a served model by its name; any other is OpenAI's 404."""
    asked = call.params.get("model", "")
    if call.service.others:
        chosen = call.service.choose(asked, None, 0.0)
        return json_reply(_model(chosen.ready(max(0.0, call.deadline - time.monotonic())).info))
    info = call.engine_client().info
    if asked != info.name:
        raise NotFound(f"The model '{asked}' does not exist; this server serves '{info.name}' "
                       "(see GET /v1/models)", param="model", code="model_not_found")
    return json_reply(_model(info))


def _model(info: ModelInfo) -> dict[str, Any]:
    return {"id": info.name, "object": "model", "created": _listed_at(), "owned_by": "embedsvc",
            "kind": info.kind, "dimensions": info.dimension,
            "modalities": list(info.modalities)}


@functools.cache
def _listed_at() -> int:
    """When this process first listed the model (OpenAI's ``created`` is when it was made)."""
    return int(time.time())


def _agreed(req: TypedEmbeddingsRequest, name: str, alias: str) -> Any:
    """The value of a field two APIs spell differently; both, if they differ, is a 400."""
    return _agreed_named(req, name, alias)[0]


def _agreed_named(req: TypedEmbeddingsRequest, name: str, alias: str) -> tuple[Any, str]:
    """``_agreed``'s value, and the name the request gave it (``name`` when neither)."""
    value, other = getattr(req, name), getattr(req, alias)
    if value is not None and other is not None and value != other:
        raise InvalidRequest(f"'{name}' ({value}) and '{alias}' ({other}) disagree; send one",
                             param=alias, code=f"invalid_{alias}")
    return (other, alias) if value is None and other is not None else (value, name)


def _role_prefix(call: Call, req: TypedEmbeddingsRequest) -> str:
    """The prompt of Voyage's input_type or Jina's task, where the model has one."""
    if req.input_type is None and req.task is None:  # OpenAI's requests: no role
        return ""
    if req.input_type is not None and req.task is not None:
        raise InvalidRequest("send 'input_type' (Voyage) or 'task' (Jina), not both",
                             param="task", code="invalid_task")
    sent, roles, param = ((req.task, _JINA_ROLES, "task") if req.task is not None
                          else (req.input_type, _VOYAGE_ROLES, "input_type"))
    return typed.with_role(call.info, [""], sent, roles, param)[0]


def _prompted(inputs: list[Any], prefix: str, req: TypedEmbeddingsRequest, *,
              ids_take_prompts: bool) -> list[Any]:
    if not prefix or not inputs:
        return inputs
    if isinstance(inputs[0], str):
        return [prefix + t for t in inputs]
    if ids_take_prompts:
        return inputs  # the prompt goes before each decoded text (_decoded)
    param = "task" if req.task is not None else "input_type"
    raise InvalidRequest(f"'{param}' puts a prompt before text inputs; with token ids, put "
                         "the prompt's ids first and leave it out", param=param,
                         code=f"invalid_{param}")


def _decoded(ids: Any, *, model: str | None, prefix: str, **limits: Any) -> Iterator[str]:
    return (prefix + text for text in decode_ids(ids, model, **limits))
