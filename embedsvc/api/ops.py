"""The service's own routes: ``/info``, ``/health`` (and TEI's aliases) and ``/metrics``."""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from ..errors import Unavailable
from ..work import ModelInfo
from .web import Call, Reply, json_reply

_HEALTH_REASONS = {
    "loading": "the model is loading",
    "draining": "the server is shutting down",
    "unhealthy": "the model failed to load or the batcher is not running; see the log",
}


def tei_model_type(info: ModelInfo) -> dict[str, Any]:
    """``model_type`` of TEI's /info, which clients read to tell the kind."""
    if info.kind in ("reranker", "classifier"):
        id2label = {str(i): name for i, name in enumerate(info.labels)}
        return {info.kind: {"id2label": id2label,
                            "label2id": {name: i for i, name in enumerate(info.labels)}}}
    pooling = "splade" if info.kind == "sparse" else info.pooling
    return {"embedding": {"pooling": pooling} if pooling else {}}


def info(call: Call) -> Reply:
    """GET /info: the model, the limits and this process; TEI's fields among them."""
    service = call.service
    service.settle()
    s, model = service.settings, service.model
    return json_reply({
        "model_id": model.name if model else None,
        "model_sha": None,
        "model_dtype": model.dtype if model else None,
        "served_model_name": model.name if model else None,
        "model_type": tei_model_type(model) if model else None,
        "kind": model.kind if model else None,
        "labels": list(model.labels) if model else None,
        "dimension": model.dimension if model else None,
        "modalities": list(model.modalities) if model else None,
        "max_images_per_request": s.max_images_per_request if model and
        "image" in model.modalities else None,
        "max_input_length": model.max_input_tokens if model else None,
        "device": model.device if model else None,
        "dtype": model.dtype if model else None,
        "backend": model.backend if model else None,
        "parameters": model.parameters if model else None,
        "max_concurrent_requests": service.queue_limit,  # TEI's: inputs admitted at once
        "max_batch_tokens": s.max_batch_tokens,
        "max_batch_requests": s.max_batch_size,
        "max_batch_size": s.max_batch_size,
        "max_wait_ms": s.max_wait_ms,
        "max_queue": service.queue_limit,
        "max_client_batch_size": s.max_inputs_per_request,
        "auto_truncate": s.auto_truncate,
        "tokenization_workers": s.threads,  # request threads tokenize their own inputs
        "version": __version__,
        "sha": None,
        "docker_label": None,
        "pid": service.pid,
        "engine_pid": service.engine_pid,  # the process that holds the model
        "front_pids": service.front_pids,  # the HTTP processes in front of it
        "state": service.state,
        **({"models": [_about(m) for m in service.models]} if service.others else {}),
    })


def _about(service: Any) -> dict[str, Any]:
    """One of several models in /info: its name, kind, dimension, engine and state."""
    model = service.model
    return {"name": service.name, "model_id": model.name if model else None,
            "kind": model.kind if model else None,
            "dimension": model.dimension if model else None,
            "modalities": list(model.modalities) if model else None,
            "device": model.device if model else None,
            "size_bytes": model.size_bytes if model else None,
            "engine_pid": service.engine_pid, "state": service.state}


def health(call: Call) -> Reply:
    """GET /health: 200 once the model is loaded and the batcher runs, else 503 and why."""
    call.service.settle()
    if call.service.others:  # several models: ready when every one is, and says which are
        states = call.service.states()
        if any(state != "ready" for state in states.values()):
            waiting = ", ".join(f"{name}: {state}" for name, state in states.items()
                                if state != "ready")
            raise Unavailable(f"not every model is ready ({waiting})", code="loading")
        return json_reply({"status": "ok", "models": states})
    state = call.service.state
    if state != "ready":
        raise Unavailable(_HEALTH_REASONS.get(state, state), code=state)
    return json_reply({"status": "ok"})


def metrics(call: Call) -> Reply:
    """GET /metrics: the Prometheus text exposition."""
    call.service.settle()
    return Reply(200, call.service.exposition(), content_type=CONTENT_TYPE_LATEST)
