"""Request bodies in: JSON parsed and validated against a route's pydantic model, with a 400
that names the field and what it must be."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from pydantic import ValidationError

from ..errors import InvalidRequest
from .lane import LARGE_BODY_BYTES
from .schemas import Request
from .shapes import check_lists, listed_fields

if TYPE_CHECKING:
    from .web import Call


def parse(model: type[Request], call: Call) -> Any:
    """The validated request, or a 400 that names the field and what it must be.

    Every list of the body is checked by its field's shape before pydantic sees it, against
    MAX_INPUTS_PER_REQUEST before its items (shapes.py), so that validation costs what the
    body costs, whatever it holds and whichever route it came to; a large body waits for its
    turn in the pipeline's lane (lane.py), since parsing it stops every other thread.
    """
    if call.lane is not None and len(call.body) >= LARGE_BODY_BYTES:
        return call.lane.run(lambda: _parse(model, call), call.deadline)
    return _parse(model, call)


def _parse(model: type[Request], call: Call) -> Any:
    try:
        body = orjson.loads(call.body)
    except orjson.JSONDecodeError:
        raise InvalidRequest(f"the body is not valid JSON; send {_expected(model)}",
                             code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest(
            f"the body must be a JSON object, not {type(body).__name__}", code="invalid_json"
        )
    settings = call.service.settings
    max_inputs, max_ids = settings.max_inputs_per_request, settings.max_queue_tokens
    check_lists(listed_fields(model), body, max_inputs, max_ids)
    try:
        parsed = model.model_validate(body, context={"max_inputs": max_inputs,
                                                     "max_ids": max_ids})
    except ValidationError as exc:
        raise _invalid(exc) from None
    if call.service.others:  # several models: the body's ``model`` chooses one (Call)
        call.model = getattr(parsed, "model", None) or None
    return parsed


def _expected(model: type[Request]) -> str:
    """What this route's body holds, for the 400 of a body that is not JSON."""
    required = [f"'{field.alias or name}'" for name, field in model.model_fields.items()
                if field.is_required() or _main(field.json_schema_extra)]
    return "a JSON object" + (f" with {' and '.join(required)}" if required else "")


def _main(extra: Any) -> bool:
    """A field the route's body needs unless another one stands in for it (``main``)."""
    return isinstance(extra, dict) and bool(extra.get("main"))


def as_list(value: Any) -> list[Any]:
    """One input or a list of them, as a list (a flat list of ids is one input)."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [value]
    return value


def _path(loc: tuple[int | str, ...]) -> str:
    """A field's place as a client writes it: 'inputs.sentences', 'embedding_types[0]';
    the names pydantic gives the members of a union ('str', 'list[int]') left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _UNION_MEMBERS:
            out += f".{part}" if out else part
    return out


# what pydantic's error locations name a union's members by, among the fields' names
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _invalid(exc: ValidationError) -> InvalidRequest:
    # the fields that can be long are checked by their shapes, so the errors here are few
    first = exc.errors(include_url=False)[0]
    loc = [str(x) for x in first["loc"]]
    param = loc[0] if loc else None
    where = _path(first["loc"]) or None  # a nested field by its whole path
    if first["type"] == "missing":
        message = f"'{where}' is required"
    else:
        message = f"'{where}': {first['msg']}"
    return InvalidRequest(message, param=param, code="invalid_" + (param or "body"))
