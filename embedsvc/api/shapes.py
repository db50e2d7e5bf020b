"""The shape of a body's lists, checked at a cost bounded by the body: what may hold millions.

pydantic validates a union by trying each branch in turn and records an error per item per
branch: a 2 MB list of a million ids ending in one float cost 8 s with the GIL held and
1.8 GB, and froze every thread of the process. A ``Shape`` looks at a list once instead: its
length against MAX_INPUTS_PER_REQUEST first (the validation context's ``max_inputs``), then
the type of every item, in C (``map(type, ...)``) a slice at a time, so that other threads
run between slices, stopping at the first wrong one and naming it by position, in a message
that says what the route takes.

Every list field of every request model is checked so, through the one request path
(bodies.py's ``parse``): a field validated by a ``Shape`` of its own (the ones that take
token ids, pairs or documents) is checked by it; any other field that may hold a list
(``list[StrictStr]``, ``str | list[str]``, ``list[Literal[...]]``...) gets a ``Shape`` derived
from its type (``listed_fields``), counted against MAX_INPUTS_PER_REQUEST like inputs, and
checked before pydantic sees the body. A list field whose items this module cannot describe
fails the model's definition (``schemas.Request``), so a new route cannot go unchecked.

>>> shape = Shape("a string or a list of strings", text=True, items=(str,))
>>> shape.check(["a", "b"], "inputs", 8)
['a', 'b']
>>> try:
...     shape.check(["a", 1.5], "inputs", 8)
... except InvalidRequest as exc:
...     print(exc.message)
'inputs' must be a string or a list of strings; item 1 is a number (1.5)
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from functools import cache, partial
from itertools import compress, count
from operator import is_not
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationInfo

from .. import rules
from ..errors import InvalidRequest
from ..work import ImageRef

_SLICE = 65536  # items whose types are checked in one C pass, holding the GIL

_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
          list: "a list", dict: "an object", type(None): "null"}


class Shape:
    """What one field may be: a lone string (``text``), or a list of items of one of the
    types ``items`` (none: any JSON value, and only the list's length is checked; ``inner``:
    the type inside lists that are items; ``mixed``: items of several of those types in one
    list; ``counted``: item types that make each item an input, so the list's length is a
    count of inputs)."""

    def __init__(self, what: str, *, text: bool = False, items: tuple[type, ...] = (),
                 inner: type | None = None, mixed: bool = False,
                 counted: tuple[type, ...] = (str, list, dict), name: str | None = None,
                 totalled: bool = False, media: bool = False) -> None:
        self.what = what
        self.text, self.items, self.inner, self.mixed = text, items, inner, mixed
        # lists that may also hold content items, texts and images as image-text models'
        # clients send them (``content_item``): a list with an object is read item by item
        self.media = media
        self.counted = counted
        self.name = name  # how messages name the field, when not by its own name
        # lists of ids in lists, all together within the context's ``max_ids`` (/decode's),
        # checked before their items are
        self.totalled = totalled

    def __call__(self, value: Any, info: ValidationInfo) -> Any:
        """The pydantic validator (``PlainValidator``) of the field."""
        context = info.context or {}
        return self.check(value, self.name or info.field_name or "input",
                          context.get("max_inputs"), context.get("max_ids"))

    def check(self, value: Any, param: str, max_inputs: int | None,
              max_ids: int | None = None) -> Any:
        if type(value) is str and self.text:
            return value
        if type(value) is not list:
            raise self._refused(param, None, value)
        if not value:
            return value
        if self.media and dict in set(map(type, value)):
            if max_inputs is not None:
                rules.check_count(len(value), max_inputs, param=param.partition(".")[0])
            return [content_item(item, f"{param}[{i}]", self) for i, item in enumerate(value)]
        first = type(value[0])
        if self.items and first not in self.items:
            raise self._refused(param, 0, value[0])
        if max_inputs is not None and (first in self.counted or not self.items):
            rules.check_count(len(value), max_inputs, param=param.partition(".")[0])
        if not self.items:
            return value
        if self.mixed:
            return [self._item(param, i, item) for i, item in enumerate(value)]
        wrong = _first_not(value, first)
        if wrong is not None:
            raise self._refused(param, wrong, value[wrong])
        if first is list and self.totalled and max_ids is not None:
            rules.check_decode_ids(sum(map(len, value)), max_ids)
        if first is list and self.inner is not None:
            for i, item in enumerate(value):
                wrong = _first_not(item, self.inner)
                if wrong is not None:
                    raise self._refused(param, f"{i}, position {wrong},", item[wrong])
        return value

    def _item(self, param: str, i: int, item: Any) -> Any:
        """One item of a mixed list: a string, or an object whose ``text`` is one."""
        if type(item) is str:
            return item
        if type(item) is dict and type(item.get("text")) is str:
            return item["text"]
        raise self._refused(param, i, item)

    def _refused(self, param: str, where: int | str | None, value: Any) -> InvalidRequest:
        name = _NAMES.get(type(value), "something else")
        if type(value) in (int, float, bool):
            name += f" ({value})"
        got = f"not {name}" if where is None else f"item {where} is {name}".replace(",,", ",")
        top = param.partition(".")[0]
        return InvalidRequest(f"'{param}' must be {self.what}; {got}", param=top,
                              code=f"invalid_{top}")


def content_item(item: Any, where: str, shape: Shape | None = None) -> str | ImageRef:
    """One text or image of a content list, or a 400 naming ``where``: Jina's
    ``{"text": ...}`` and ``{"image": ...}``, OpenAI's and vLLM's content parts
    ``{"type": "text", "text": ...}`` and ``{"type": "image_url", "image_url": "..." |
    {"url": "..."}}``."""
    if type(item) is str:
        return item
    if type(item) is dict and not ("text" in item and ("image" in item or "image_url" in item)):
        kind = item.get("type")
        if type(item.get("text")) is str and kind in (None, "text"):
            return item["text"]
        source = item.get("image_url") if kind in (None, "image_url") else None
        source = item.get("image") if source is None and kind in (None, "image") else source
        if type(source) is dict:
            source = source.get("url")
        if type(source) is str:
            return ImageRef(source, where.partition("[")[0].partition(".")[0], where)
    top = where.partition("[")[0].partition(".")[0]
    what = shape.what if shape is not None else "a text or an image"
    raise InvalidRequest(f"'{where}' must be {what}; it is not: a text is a string or "
                         '{"text": ...}, an image {"image": ...} or {"type": "image_url", '
                         '"image_url": {"url": ...}} with a data URI', param=top,
                         code=f"invalid_{top}")


def _first_not(items: list[Any], kind: type) -> int | None:
    """The index of the first item whose type is not ``kind`` (a bool is no int), in C: the
    set of types first (the fastest pass), the position only for a list that needs one. A
    list longer than ``_SLICE`` is checked a slice at a time (about 1.5 ms each): between
    two, the interpreter can hand the GIL to another thread (a probe's), which one pass over
    a million items would hold for 70 ms or more."""
    if len(items) > _SLICE:
        for start in range(0, len(items), _SLICE):
            found = _first_not(items[start:start + _SLICE], kind)
            if found is not None:
                return start + found
        return None
    if set(map(type, items)) <= {kind}:
        return None
    return next(compress(count(), map(partial(is_not, kind), map(type, items))))


@dataclass(frozen=True)
class Listed:
    """A field that may hold a list pydantic would check item by item: its key in the body and
    the ``shape`` that checks it first, or (a nested model) the ``fields`` of its own."""

    key: str
    shape: Shape | None = None
    fields: tuple[Listed, ...] = ()


def check_lists(fields: tuple[Listed, ...], body: dict[str, Any], max_inputs: int | None,
                max_ids: int | None = None, prefix: str = "") -> None:
    """Each list of ``body`` that ``fields`` name, by its shape (a 400 naming the first
    wrong item); values that are no list are pydantic's to judge, at the cost of one error."""
    for field in fields:
        value = body.get(field.key)
        if field.shape is not None and type(value) is list:
            field.shape.check(value, prefix + field.key, max_inputs, max_ids)
        elif field.fields and type(value) is dict:
            check_lists(field.fields, value, max_inputs, max_ids, f"{prefix}{field.key}.")


@cache
def listed_fields(model: type[BaseModel]) -> tuple[Listed, ...]:
    """The fields of ``model`` that hold lists no ``Shape`` of their own checks, each with one
    derived from its type; a ``TypeError`` for a list whose items cannot be described."""
    found = []
    for name, field in model.model_fields.items():
        if any(isinstance(getattr(m, "func", None), Shape) for m in field.metadata):
            continue  # its own Shape runs as pydantic's validator
        key = field.alias or name
        members = _members(field.annotation)
        nested = tuple(f for m in members if _is_model(m) for f in listed_fields(m))
        if nested:
            found.append(Listed(key, fields=nested))
        lists = [m for m in members if get_origin(m) is list]
        if lists:
            found.append(Listed(key, _derived([get_args(m)[0] for m in lists],
                                              f"{model.__name__}.{name}", str in members)))
        for mapping in (m for m in members if get_origin(m) is dict):
            if _bare(get_args(mapping)[1]) is not Any:  # Any values cannot be refused
                raise TypeError(f"{model.__name__}.{name}: give it a Shape (api/shapes.py)")
    return tuple(found)


_PLURALS = {str: "strings", int: "integers", float: "numbers", bool: "true or false",
            dict: "objects"}


def _derived(items: list[Any], where: str, text: bool) -> Shape:
    """The Shape of a list whose items are of the types ``items`` name (``text``: the field
    takes a lone string too, which the message says)."""
    kinds: list[type] = []
    inner: type | None = None
    names: list[str] = []
    for item in map(_bare, items):
        if item is Any:
            return Shape("a list")
        if get_origin(item) is Literal:
            kinds += {type(v) for v in get_args(item)}
            names += [repr(v) for v in get_args(item)]
        elif get_origin(item) is list and _bare(get_args(item)[0]) in _PLURALS:
            inner = _bare(get_args(item)[0])
            kinds.append(list)
            names.append(f"lists of {_PLURALS[inner]}")
        elif _is_model(item) or item in _PLURALS:
            kind = dict if _is_model(item) else item
            kinds.append(kind)
            names.append(_PLURALS[kind])
        else:
            raise TypeError(f"{where}: a list of {item} has no shape; give it a Shape "
                            "(api/shapes.py)")
    what = ("a string or " if text else "") + "a list of " + (
        " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1])
    return Shape(what, items=tuple(dict.fromkeys(kinds)), inner=inner, counted=tuple(kinds))


def _members(annotation: Any) -> tuple[Any, ...]:
    """The types a field's annotation allows (a union's members), without their metadata."""
    annotation = _bare(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(map(_bare, get_args(annotation)))
    return (annotation,)


def _bare(annotation: Any) -> Any:
    """``annotation`` without ``Annotated``'s metadata (``StrictStr`` is ``str``)."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)
