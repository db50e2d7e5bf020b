"""Every list field of a request model, read from its published JSON schema (what clients
see, not how the server checks it), and large invalid lists for each: the attacker's bodies
of issue 41's invalid-list freeze, for any route, present or future.

>>> from embedsvc.api.schemas import RerankRequest
>>> list_fields(RerankRequest)
[('texts',)]
>>> sorted(valid_body(RerankRequest))
['query', 'texts']
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

MB = 1 << 20


def list_fields(model: Any) -> list[tuple[str, ...]]:
    """The path of every property that may be an array, nested objects included."""
    schema = model.model_json_schema()
    return list(_arrays(schema, schema.get("$defs", {}), ()))


def _arrays(schema: dict, defs: dict, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    for name, prop in schema.get("properties", {}).items():
        branches = [_resolve(b, defs) for b in prop.get("anyOf", [prop])]
        if any(b.get("type") == "array" for b in branches):
            yield (*path, name)
        for branch in branches:
            if branch.get("type") == "object":
                yield from _arrays(branch, defs, (*path, name))


def _resolve(schema: dict, defs: dict) -> dict:
    return defs[schema["$ref"].rsplit("/", 1)[1]] if "$ref" in schema else schema


def valid_body(model: Any) -> dict:
    """The model's required fields, each with a small valid value."""
    schema = model.model_json_schema()
    return _value(schema, schema.get("$defs", {}))


def _value(schema: dict, defs: dict) -> Any:
    schema = _resolve(schema.get("anyOf", [schema])[0], defs)
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        return {name: _value(prop, defs) for name, prop in schema.get("properties", {}).items()
                if name in schema.get("required", [])}
    if kind == "array":
        return [_value(schema["items"], defs)] if schema.get("items") else [1]
    return {"string": "a", "integer": 1, "number": 1.0, "boolean": True}.get(kind, 1)


def invalid_lists(model: Any, path: tuple[str, ...], size: int = 2 * MB
                  ) -> Iterator[tuple[str, bytes]]:
    """Bodies of about ``size`` bytes whose field ``path`` is a list that is valid but for its
    last item (a number no list field takes), each named: a million ids (the finding's), and,
    per array type the field takes, its own items (inside one list, for lists of lists)."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    prop = schema
    for name in path:
        prop = _resolve(prop, defs)["properties"][name]
    lists = {"ids": _filled(1, size)}
    for branch in (_resolve(b, defs) for b in prop.get("anyOf", [prop])):
        if branch.get("type") != "array" or not branch.get("items"):
            continue
        item = _resolve(branch["items"].get("anyOf", [branch["items"]])[0], defs)
        lists[f"{item.get('type', 'enum')} items"] = _filled(_value(item, defs), size)
        if item.get("type") == "array":
            lists["one long inner list"] = [_filled(_value(item["items"], defs), size)]
    sent = set()
    for label, value in lists.items():
        body = valid_body(model)
        _put(body, path, value)
        raw = orjson.dumps(body)
        if raw not in sent:  # integer items are the ids again
            sent.add(raw)
            yield label, raw


def _filled(item: Any, size: int) -> list[Any]:
    return [item] * (size // (len(orjson.dumps(item)) + 1)) + [1.5]


def _put(body: dict, path: tuple[str, ...], value: Any) -> None:
    for name in path[:-1]:
        body = body.setdefault(name, {})
    body[path[-1]] = value
