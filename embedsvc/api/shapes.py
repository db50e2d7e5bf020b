"""The shape of a body's lists, checked at a cost bounded by the body: what may hold millions.

pydantic validates a union by trying each branch in turn and records an error per item per
branch: a 2 MB list of a million ids ending in one float cost 8 s with the GIL held and
1.8 GB, and froze every thread of the process. A ``Shape`` looks at a list once instead: its
length against MAX_INPUTS_PER_REQUEST first (the validation context's ``max_inputs``), then
the type of every item, in C (``map(type, ...)``) a slice at a time, so that other threads
run between slices, stopping at the first wrong one and naming it by position, in a message
that says what the route takes.

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

from functools import partial
from itertools import compress, count
from operator import is_not
from typing import Any

from pydantic import ValidationInfo

from .. import rules
from ..errors import InvalidRequest

_SLICE = 65536  # items whose types are checked in one C pass, holding the GIL

_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
          list: "a list", dict: "an object", type(None): "null"}


class Shape:
    """What one field may be: a lone string (``text``), or a list of items of one of the
    types ``items`` (``inner``: the type inside lists that are items; ``mixed``: items of
    several of those types in one list; ``counted``: item types that make each item an
    input, so the list's length is a count of inputs)."""

    def __init__(self, what: str, *, text: bool = False, items: tuple[type, ...] = (),
                 inner: type | None = None, mixed: bool = False,
                 counted: tuple[type, ...] = (str, list, dict), name: str | None = None,
                 totalled: bool = False) -> None:
        self.what = what
        self.text, self.items, self.inner, self.mixed = text, items, inner, mixed
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
        first = type(value[0])
        if first not in self.items:
            raise self._refused(param, 0, value[0])
        if max_inputs is not None and first in self.counted:
            rules.check_count(len(value), max_inputs, param=param.partition(".")[0])
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
