"""Texts and pairs of texts tokenized as a cross-encoder's tokenizer call would: the part of a
scorer that an HTTP process needs to tokenize for it (model/text.py), without the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from ..work import Pair, Sequenced
from .tokenizer import template_ids
from .window import TokenCounts, pair_shares, window_tokens


def tokenize_pairs(encoder: Any, truncate_at: int,
                   inputs: Sequence[Sequenced], direction: str | None) -> list[Pair]:
    """``tokenize_sequences`` of any cross-encoder: ``encoder._tokenizer`` (the plain fast
    tokenizer), ``_margin`` and ``info``, and ``truncate_at``, the tokens (special ones
    included) its tokenizer's truncation keeps.

    Each distinct text is read as far as its window (``window_tokens``), once; a pair keeps
    of each text what the tokenizer's own ``longest_first`` truncation would (``pair_shares``)
    and is wrapped in the model's template. No tokenizer sees a whole long text, nor builds
    the overflow pieces of its truncation.
    """
    side = direction or "right"
    plain, margin = encoder._tokenizer, encoder._margin
    texts = list(dict.fromkeys(t for item in inputs
                               for t in ((item,) if isinstance(item, str) else item)))
    limit = encoder.info.max_input_tokens
    tokens = dict(zip(texts, window_tokens(plain, texts, limit, side, margin), strict=True))
    template = Template(plain)
    kept = None if direction is None else truncate_at
    counts = TokenCounts(plain, limit, margin)
    out = []
    for item in inputs:
        if isinstance(item, str):
            ids, _, cut = tokens[item]
            if kept is not None:
                ids = _kept(ids, kept - template.single, side)
            wrapped = template.wrap(ids)
            out.append(Pair(wrapped, len(wrapped), cut))
            continue
        a, b = tokens[item[0]], tokens[item[1]]
        ids_a, ids_b = a.ids, b.ids
        if kept is not None:
            shares = pair_shares((a.known, a.cut), (b.known, b.cut), kept - template.pair,
                                 partial(counts.longer, *item))
            ids_a, ids_b = _kept(ids_a, shares[0], side), _kept(ids_b, shares[1], side)
        out.append(template.join(ids_a, ids_b, a.cut or b.cut))
    return out


def _kept(ids: list[int], n: int, side: str) -> list[int]:
    """The first (``right``) or last (``left``) ``n`` of ``ids``."""
    return ids[:n] if side == "right" else ids[max(0, len(ids) - n):]


class Template:
    """Where the model's tokenizer puts its special tokens around a text and a pair of texts,
    and their token types: read once from the tokenizer's own answer for a probe."""

    def __init__(self, tok: Any) -> None:
        self._prefix, self._suffix = template_ids(tok)
        self.single = len(self._prefix) + len(self._suffix)
        probe = tok.encode("hello", "world", add_special_tokens=True)
        a, b = (tok.encode(t, add_special_tokens=False).ids for t in ("hello", "world"))
        ids, types = probe.ids, probe.type_ids
        i = next((i for i in range(len(ids)) if ids[i:i + len(a)] == a), len(ids))
        j = next((j for j in range(i + len(a), len(ids)) if ids[j:j + len(b)] == b), len(ids))
        if j == len(ids):
            raise RuntimeError("cannot find where the tokenizer's template places a pair")
        self._parts = [(ids[:i], types[:i]), (ids[i + len(a):j], types[i + len(a):j]),
                       (ids[j + len(b):], types[j + len(b):])]
        self._types = (types[i], types[j])
        self.pair = len(ids) - len(a) - len(b)

    def wrap(self, ids: list[int]) -> list[int]:
        return [*self._prefix, *ids, *self._suffix]

    def join(self, a: list[int], b: list[int], cut: bool) -> Pair:
        (pre, pre_t), (mid, mid_t), (post, post_t) = self._parts
        type_a, type_b = self._types
        return pair_of([*pre, *a, *mid, *b, *post],
                       [*pre_t, *[type_a] * len(a), *mid_t, *[type_b] * len(b), *post_t], cut)


def pair_of(ids: list[int], type_ids: list[int], cut: bool = False) -> Pair:
    """A tokenized text or pair as a ``Pair``, its second segment read from the type ids;
    ``cut``: a text of it was read only as far as its window."""
    second = next((i for i, t in enumerate(type_ids) if t), len(ids))
    if any(t != (i >= second) for i, t in enumerate(type_ids)):
        # every tokenizer template in use puts segment A, then B: 0...0 1...1
        raise ValueError(f"unexpected token types {type_ids} for a pair of texts")
    return Pair(ids, second, cut)
