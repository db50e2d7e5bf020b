"""The OpenAPI 3.1 document served at /openapi.json, built from the route table.

>>> from embedsvc.api.routes import ROUTES
>>> doc = openapi_document(ROUTES)
>>> sorted(doc["paths"]["/embed"])
['post']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .. import __version__
from ..errors import OLLAMA
from .schemas import ERROR, OLLAMA_ERROR
from .web import Route

# Every route may answer these; POST routes also the ones about their body and the model.
_ANY_ERRORS = ("401", "404", "405", "413", "500")
_POST_ERRORS = ("400", "429", "503", "504")


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _operation(route: Route) -> dict[str, Any]:
    if route.response is None:
        ok: dict[str, Any] = {"description": route.summary, "content": {"text/plain": {}}}
    else:
        ok = {"description": route.summary,
              "content": {"application/json": {"schema": route.response}}}
    errors = _ANY_ERRORS + (_POST_ERRORS if route.method == "POST" else ("503",))
    responses = {"200": ok}
    shape = _ref("OllamaError" if route.errors == OLLAMA else "Error")
    for status in sorted(set(errors)):
        responses[status] = {"description": "Error",
                             "content": {"application/json": {"schema": shape}}}
    op: dict[str, Any] = {"summary": route.summary, "responses": responses}
    if route.request is not None:
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": _ref(route.request.__name__)}}}
    if route.parameter is not None:
        op["parameters"] = [{"name": route.parameter, "in": "path", "required": True,
                             "schema": {"type": "string"}}]
    if route.open:
        op["security"] = []
    return op


def openapi_document(routes: Iterable[Route]) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    schemas: dict[str, Any] = {"Error": ERROR, "OllamaError": OLLAMA_ERROR}
    for route in (r for r in routes if r.listed):
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route)
        if route.request is not None:
            schemas[route.request.__name__] = route.request.model_json_schema()
    return {
        "openapi": "3.1.0",
        "info": {"title": "embedsvc", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
