"""The OpenAPI 3.1 document served at /openapi.json, built from the request schemas."""

from __future__ import annotations

from functools import cache
from typing import Any

from . import __version__
from .schemas import EmbeddingsRequest, EmbedRequest, TokenizeRequest

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "description": "What was wrong and how to fix it."},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_VECTOR = {"type": "array", "items": {"type": "number"}}
_EMBEDDINGS_RESPONSE = {
    "type": "object",
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "object": {"const": "embedding"},
                    "index": {"type": "integer", "description": "Position in 'input'."},
                    "embedding": {
                        "oneOf": [_VECTOR, {"type": "string", "contentEncoding": "base64"}]
                    },
                },
            },
        },
        "model": {"type": "string"},
        "usage": {
            "type": "object",
            "properties": {
                "prompt_tokens": {"type": "integer"},
                "total_tokens": {"type": "integer"},
            },
        },
    },
}
_PIECE = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "text": {"type": "string"},
        "special": {"type": "boolean"},
        "start": {"type": ["integer", "null"], "description": "Character offset."},
        "stop": {"type": ["integer", "null"]},
    },
}
_POST_ERRORS = {"400", "401", "413", "429", "500", "503", "504"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _responses(ok: dict[str, Any], description: str, errors: set[str]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "200": {"description": description, "content": {"application/json": {"schema": ok}}}
    }
    for status in sorted(errors):
        out[status] = {
            "description": "Error",
            "content": {"application/json": {"schema": _ref("Error")}},
        }
    return out


def _post(model: str, ok: dict[str, Any], summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(model)}},
            },
            "responses": _responses(ok, summary, _POST_ERRORS),
        }
    }


def _get(ok: dict[str, Any], summary: str, errors: set[str]) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": _responses(ok, summary, errors)}}


@cache
def openapi_document() -> dict[str, Any]:
    embeddings = _post("EmbeddingsRequest", _EMBEDDINGS_RESPONSE, "OpenAI-compatible embeddings")
    schemas: dict[str, Any] = {"Error": _ERROR}
    for model in (EmbeddingsRequest, EmbedRequest, TokenizeRequest):
        schemas[model.__name__] = model.model_json_schema()
    return {
        "openapi": "3.1.0",
        "info": {"title": "embedsvc", "version": __version__},
        "paths": {
            "/v1/embeddings": embeddings,
            "/embeddings": embeddings,
            "/embed": _post("EmbedRequest", {"type": "array", "items": _VECTOR},
                            "TEI-compatible embeddings, one vector per input"),
            "/tokenize": _post("TokenizeRequest", {"type": "array", "items": {
                "type": "array", "items": _PIECE}}, "The tokens the model sees for each input"),
            "/info": _get({"type": "object"}, "Model, device, limits, version and pid", {"401"}),
            "/health": _get({"type": "object"}, "200 once the model is loaded and the batcher "
                            "runs; 503 with code loading, unhealthy or draining", {"503"}),
            "/metrics": {"get": {"summary": "Prometheus text exposition", "responses": {
                "200": {"description": "metrics", "content": {"text/plain": {}}}}}},
            "/openapi.json": _get({"type": "object"}, "This document", {"401"}),
        },
        "components": {"schemas": schemas},
    }
