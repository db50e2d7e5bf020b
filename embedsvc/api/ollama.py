"""Ollama's embedding API: ``/api/embed``, the legacy ``/api/embeddings``, and the model
listing its clients check first (``/api/tags``, ``/api/show``, ``/api/version``).

Errors on these routes come in Ollama's shape, ``{"error": "..."}``, which its clients read
(their rows in routes.py say so; the pipeline writes every error); Ollama's other routes
(generate, chat, pull...) answer 501 saying this server embeds only::

    POST /api/embed {"model": "any", "input": ["a", "b"]}
      ->  {"model": "<served>", "embeddings": [[...], [...]], "prompt_eval_count": 6, ...}
"""

from __future__ import annotations

import functools
import hashlib
import time
from datetime import datetime, timezone
from typing import Any

from .. import __version__, rules
from ..errors import ApiError, InvalidRequest, NotFound, Unavailable
from ..work import EMBED, ModelInfo
from .bodies import as_list, parse
from .schemas import OllamaEmbeddingsRequest, OllamaEmbedRequest, OllamaShowRequest
from .web import Call, Reply, embedded_reply, json_reply

# /api/ps's expires_at: a model stays loaded while the service runs (Ollama's keep_alive -1,
# which it reports as a date centuries ahead)
_HELD_UNTIL = "9999-12-31T23:59:59Z"
_QUANTIZATION = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int8": "Q8_0"}


class EmbedsOnly(ApiError):
    status = 501
    type = "not_supported"
    reason = "not_supported"


def embed(call: Call) -> Reply:
    """POST /api/embed: L2-normalised vectors, as Ollama gives them."""
    req = parse(OllamaEmbedRequest, call)
    inputs = as_list(req.input)
    if not inputs:  # Ollama answers an empty list with no vectors, once its options hold
        rules.check_dimensions(req.dimensions, call.info.dimension)
        return json_reply(_embed_body(call.info, [], call, 0))
    out = call.run(call.work(EMBED, inputs, normalize=True, dimensions=req.dimensions,
                             truncate=req.truncate))
    return embedded_reply(_embed_body(call.info, out.vectors, call, out.tokens), out,
                          len(inputs))


def _embed_body(info: ModelInfo, vectors: Any, call: Call, tokens: int) -> dict[str, Any]:
    return {
        "model": ollama_name(info),
        "embeddings": vectors,
        "total_duration": int((time.monotonic() - call.arrived) * 1e9),
        "load_duration": 0,  # the model is loaded before the first request
        "prompt_eval_count": tokens,
    }


def embeddings(call: Call) -> Reply:
    """POST /api/embeddings (legacy): one prompt, the model's raw vector, as Ollama gives it."""
    req = parse(OllamaEmbeddingsRequest, call)
    out = call.run(call.work(EMBED, [req.prompt], normalize=False, param="prompt"))
    return embedded_reply({"embedding": out.vectors[0]}, out, 1)


def tags(call: Call) -> Reply:
    """GET /api/tags: the served models, as ``ollama list`` shows models."""
    if not call.service.others:
        infos = [call.info]
    else:  # those that can answer, as /v1/models lists them: one engine being replaced
        infos = []  # leaves the others listed
        for service in call.service.models:
            try:
                infos.append(service.ready(max(0.0, call.deadline - time.monotonic())).info)
            except Unavailable:
                continue
    return json_reply({"models": [{
        **_listed(info), "modified_at": _listed_at()} for info in infos]})


def ps(call: Call) -> Reply:
    """GET /api/ps: the models loaded now, as ``ollama ps`` shows them: those ready (a model
    whose engine is being replaced is not), each held until the service stops."""
    infos = [service.model for service in call.service.models if service.state == "ready"]
    return json_reply({"models": [{
        **_listed(info), "expires_at": _HELD_UNTIL,
        "size_vram": info.size_bytes if info.device.startswith("cuda") else 0,
        "context_length": info.max_input_tokens,
    } for info in infos if info is not None]})


def _listed(info: ModelInfo) -> dict[str, Any]:
    """What /api/tags and /api/ps both say of a model."""
    return {"name": ollama_name(info), "model": ollama_name(info), "size": info.size_bytes,
            "digest": _digest(info), "details": _details(info)}


def show(call: Call) -> Reply:
    """POST /api/show: the served model's details, by the name /api/tags lists."""
    req = parse(OllamaShowRequest, call)
    asked = req.model or req.name
    if asked is None:
        raise InvalidRequest("'model' is required", param="model", code="invalid_model")
    call.model = asked  # with several models, the one it names or aliases (404 for others)
    info = call.info
    if not call.service.others and not named(info, asked):
        raise NotFound(f"model '{asked}' not found; this server serves '{ollama_name(info)}' "
                       "(see /api/tags)", param="model", code="model_not_found")
    return json_reply({
        "modelfile": "", "parameters": "", "template": "", "license": "",
        "details": _details(info),
        "model_info": {"general.architecture": info.kind,
                       "general.parameter_count": info.parameters,
                       f"{info.kind}.embedding_length": info.dimension,
                       f"{info.kind}.context_length": info.max_input_tokens},
        "capabilities": ["embedding"],
        "modified_at": _listed_at(),
    })


def version(call: Call) -> Reply:
    """GET /api/version: embedsvc's version."""
    return json_reply({"version": __version__})


def embeds_only(call: Call) -> Reply:
    """Ollama's generation and model-management routes: a 501 in Ollama's shape."""
    raise EmbedsOnly("this server is embedsvc, which embeds only: it serves the models /api/tags "
                     "lists through /api/embed and /api/embeddings; generate, chat and model "
                     "management are not offered", code="not_supported")


def ollama_name(info: ModelInfo) -> str:
    """The served model's name with a tag, as Ollama lists models (``name:latest``)."""
    return info.name if ":" in info.name.rsplit("/", 1)[-1] else info.name + ":latest"


def named(info: ModelInfo, asked: str) -> bool:
    """``asked`` names the served model (with or without its tag)."""
    return asked in (info.name, ollama_name(info))


def _details(info: ModelInfo) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": info.backend,
        "family": info.kind,
        "families": [info.kind],
        "parameter_size": f"{info.parameters / 1e6:.1f}M",
        "quantization_level": _QUANTIZATION.get(info.dtype, info.dtype.upper()),
    }


def _digest(info: ModelInfo) -> str:
    """A stable id of what is served (Ollama's is its manifest's sha256)."""
    served = f"{info.name}|{info.dimension}|{info.parameters}|{info.backend}|{info.dtype}"
    return hashlib.sha256(served.encode()).hexdigest()


@functools.cache
def _listed_at() -> str:
    """When this process first listed the model: the closest it has to Ollama's pull time."""
    return datetime.now(timezone.utc).isoformat()
