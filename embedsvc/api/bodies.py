"""Request bodies in: JSON parsed and validated against a route's pydantic model, with a 400
that names the field and what it must be."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import ValidationError

from ..errors import InvalidRequest
from .schemas import Request, TokenizeRequest

_INPUT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"

_TEXT_SHAPES = "a string or a list of strings"


def parse(model: type[Request], raw: bytes) -> Any:
    """The validated request, or a 400 that names the field and what it must be."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest(
            "the body is not valid JSON; send a JSON object such as {\"input\": \"some text\"}",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequest(
            f"the body must be a JSON object, not {type(body).__name__}", code="invalid_json"
        )
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc, model) from None


def as_list(value: Any) -> list[Any]:
    """One input or a list of them, as a list (a flat list of ids is one input)."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [value]
    return value


def _invalid(exc: ValidationError, model: type[Request]) -> InvalidRequest:
    first = exc.errors(include_url=False)[0]
    loc = [str(x) for x in first["loc"]]
    param = loc[0] if loc else None
    if param in ("input", "inputs") and first["type"] != "missing":
        texts_only = model is TokenizeRequest
        message = f"'{param}' must be {_TEXT_SHAPES if texts_only else _INPUT_SHAPES}"
    elif first["type"] == "missing":
        message = f"'{param}' is required"
    else:
        message = f"'{param}': {first['msg']}"
    return InvalidRequest(message, param=param, code="invalid_" + (param or "body"))
