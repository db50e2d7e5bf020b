"""The first or last N tokens of a text, at a cost that follows N, not the text's length.

Tokenizing a 200,000-character input in full to keep its first 254 tokens costs seconds and
gigabytes (one ``Encoding`` entry per token). Instead a prefix (or, cutting from the left, a
suffix) of the text is tokenized, four times longer each round, until the tokens that the cut
cannot have changed are more than ``limit``, or the window covers the whole text.

Why the kept tokens equal those of full tokenization: a fast tokenizer splits the text into
words (pre-tokens) and tokenizes each word on its own; a cut changes only the words that
touch it. So the tokens of the last two words of a prefix (the first two of a suffix) are
dropped, and so are those within ``margin`` characters of the cut, which covers an added
token (``[MASK]``) that the cut splits into ordinary words. The property tests in
tests/unit/test_window.py check this against full tokenization on the real tokenizer.

A pair of texts keeps what the tokenizer's truncation would keep of each (``pair_shares``),
from their windows; where that depends on which text is longer, ``TokenCounts`` counts both
in pieces cut the same way, only as far as the comparison needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

Offsets = list[tuple[int, int]]
_CHARS_PER_TOKEN = 4  # the first window: enough for typical text in one round
_GROWTH = 4
_BOUNDARY_WORDS = 2


def token_window(tokenizer: Any, texts: Sequence[str], limit: int | None,
                 direction: str = "right", margin: int = 0, offsets: bool = True
                 ) -> list[tuple[list[int], Offsets]]:
    """Ids and character offsets of each text's first (``right``) or last (``left``)
    ``limit`` tokens, no special tokens; all of them when ``limit`` is None.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` without truncation or padding; ``margin`` is
    the length of its longest added token. ``offsets=False`` spares building the offsets of
    texts read whole (their list is then empty).
    """
    out: list[tuple[list[int], Offsets] | None] = [None] * len(texts)
    for i, part, kept in _windows(tokenizer, texts, limit, direction, margin, offsets):
        shift = len(texts[i]) - len(part) if direction == "left" else 0
        out[i] = _cut(kept, limit, direction, shift)
    return out  # type: ignore[return-value]


class Read(NamedTuple):
    """A text as ``window_tokens`` read it: ``ids`` without special tokens, all of them when
    it was read whole, else its first (``right``) or last (``left``) ``limit`` (``cut``: it
    has more); ``known``: how many tokens it is known to have (all, when read whole)."""

    ids: list[int]
    known: int
    cut: bool


def window_tokens(tokenizer: Any, texts: Sequence[str], limit: int, direction: str = "right",
                  margin: int = 0) -> list[Read]:
    """Each text read only as far as its window of ``limit`` tokens (see ``Read``)."""
    out = [Read([], 0, False)] * len(texts)
    for i, part, (ids, _) in _windows(tokenizer, texts, limit, direction, margin, False):
        cut = len(part) != len(texts[i])
        out[i] = Read(ids[:limit] if direction == "right" else ids[max(0, len(ids) - limit):],
                      len(ids), True) if cut else Read(ids, len(ids), False)
    return out


def pair_shares(a: tuple[int, bool], b: tuple[int, bool], budget: int,
                a_longer: Callable[[], bool]) -> tuple[int, int]:
    """How many tokens of each text of a pair the tokenizer's own truncation keeps:
    ``longest_first`` to ``budget`` tokens of text (its length less the pair's special tokens).

    A side is (the tokens it is known to have, cut), from ``window_tokens`` at a limit of at
    least ``budget``: a cut text has more. The truncation gives the longer
    text (the second, on a tie) what the shorter one leaves, or, both being over half the
    budget, half of it each and the odd token to the longer one; so which text is longer can
    decide, and ``a_longer()`` (whether the first has more tokens) is asked where the tokens
    read do not tell. A cut text's length then stands in as any that compares the same.
    Reading both texts whole instead costs their length, and the tokenizer's truncation of
    two long texts builds overflow pieces that grow with the product of their lengths
    (gigabytes for two 20,000-character sides).
    """
    (na, cut_a), (nb, cut_b) = a, b
    if cut_a and cut_b:
        na, nb = budget + 1 + (budget % 2 == 1 and a_longer()), budget + 1
    elif cut_a:  # a has more than na tokens: longer than b unless b has as many
        na = max(nb, budget) + 1 if nb < na or a_longer() else nb
    elif cut_b:
        nb = max(na, budget + 1) if na < nb or not a_longer() else na - 1
    return _longest_first(na, nb, budget)


def _longest_first(na: int, nb: int, budget: int) -> tuple[int, int]:
    """The tokenizers library's ``longest_first`` for a pair of ``na`` and ``nb`` tokens."""
    if na + nb <= budget:
        return na, nb
    n1, n2 = (nb, na) if na > nb else (na, nb)  # n1 the shorter; the first on a tie
    n2 = n1 if n1 > budget else max(n1, budget - n1)
    if n1 + n2 > budget:
        n1, n2 = budget // 2, budget // 2 + budget % 2
    return (n2, n1) if na > nb else (n1, n2)


class TokenCounts:
    """The token counts of texts, each read piece by piece only as far as a comparison needs,
    and once: a query compared with many long documents is counted once for all of them.

    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> tok = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    >>> tok.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> TokenCounts(tok, limit=1).longer("a " * 500, "b " * 499)
    True
    """

    def __init__(self, tokenizer: Any, limit: int, margin: int = 0) -> None:
        self._tokenizer, self._limit, self._margin = tokenizer, limit, margin
        self._pieces: dict[str, Iterator[tuple[int, bool]]] = {}
        self._seen: dict[str, tuple[int, bool]] = {}

    def longer(self, a: str, b: str) -> bool:
        """Whether ``a`` has more tokens than ``b``: the one behind is read on until one has
        ended behind the other's count so far."""
        while True:
            (na, a_ended), (nb, b_ended) = self._so_far(a), self._so_far(b)
            if a_ended and (b_ended or nb > na):
                return na > nb
            if b_ended and na > nb:
                return True
            self._read_on(b if a_ended or (not b_ended and nb < na) else a)

    def _so_far(self, text: str) -> tuple[int, bool]:
        if text not in self._seen:
            self._pieces[text] = _counts(self._tokenizer, text, self._limit, self._margin)
            self._read_on(text)
        return self._seen[text]

    def _read_on(self, text: str) -> None:
        self._seen[text] = next(self._pieces[text])


def _counts(tokenizer: Any, text: str, limit: int, margin: int) -> Iterator[tuple[int, bool]]:
    """The tokens of ``text`` counted so far, and whether that is all of them, a piece at a
    time; a piece ends after the last whole word its end cannot have changed, where the next
    one starts, so the count is that of the whole text's tokenization."""
    span, start, counted = _CHARS_PER_TOKEN * _GROWTH * (limit + 16), 0, 0
    while True:
        part = text[start:start + span]
        enc = tokenizer.encode(part, add_special_tokens=False)
        if start + len(part) == len(text):
            yield counted + len(enc.ids), True
            return
        n = _whole_words(enc, len(_kept(enc, len(part), "right", margin)[0]))
        if n == 0:  # a word longer than the piece
            span *= _GROWTH
            continue
        counted += n
        start += enc.offsets[n - 1][1]
        yield counted, False


def _whole_words(enc: Any, n: int) -> int:
    """``n`` less the tokens of a word that goes on past the first ``n`` tokens."""
    words = enc.word_ids
    while 0 < n < len(words) and words[n] is not None and words[n] == words[n - 1]:
        n -= 1
    return n


def _windows(tokenizer: Any, texts: Sequence[str], limit: int | None, direction: str,
             margin: int, offsets: bool) -> Iterator[tuple[int, str, tuple[list[int], Offsets]]]:
    """(index, window, tokens the window's edge cannot have changed) of each text, once the
    window holds ``limit`` such tokens or covers the whole text."""
    span = {i: _CHARS_PER_TOKEN * (limit + 16) for i in range(len(texts))} if limit else {}
    todo = list(range(len(texts)))
    while todo:
        parts = [_part(texts[i], span.get(i), direction) for i in todo]
        encodings = tokenizer.encode_batch(parts, add_special_tokens=False)
        again = []
        for i, part, enc in zip(todo, parts, encodings, strict=True):
            whole = len(part) == len(texts[i])
            if whole:
                kept = (enc.ids, enc.offsets if offsets else [])
            else:
                kept = _kept(enc, len(part), direction, margin)
            if limit is not None and len(kept[0]) < limit and not whole:
                span[i] *= _GROWTH
                again.append(i)
                continue
            yield i, part, kept
        todo = again


def _part(text: str, span: int | None, direction: str) -> str:
    if span is None or span >= len(text):
        return text
    return text[:span] if direction == "right" else text[len(text) - span:]


def _kept(enc: Any, length: int, direction: str, margin: int) -> tuple[list[int], Offsets]:
    """The tokens of ``enc`` that a cut at the window's edge cannot have changed."""
    ids, offsets, words = enc.ids, enc.offsets, enc.word_ids
    if direction == "right":
        edge, end = _edge_word(words, reverse=True), length - margin
        n = 0
        while n < len(ids) and _inside(words[n], edge, before=True) and offsets[n][1] <= end:
            n += 1
        return list(ids[:n]), list(offsets[:n])
    edge = _edge_word(words, reverse=False)
    n = len(ids)
    while n > 0 and _inside(words[n - 1], edge, before=False) and offsets[n - 1][0] >= margin:
        n -= 1
    return list(ids[n:]), list(offsets[n:])


def _edge_word(words: Sequence[int | None], reverse: bool) -> int | None:
    """The word index from which tokens are dropped (the last or first few words)."""
    known = [w for w in words if w is not None]
    if not known:
        return None
    return max(known) - _BOUNDARY_WORDS + 1 if reverse else min(known) + _BOUNDARY_WORDS - 1


def _inside(word: int | None, edge: int | None, before: bool) -> bool:
    if word is None or edge is None:
        return False  # a token without a word: keep nothing past it, to be safe
    return word < edge if before else word > edge


def _cut(kept: tuple[list[int], Offsets], limit: int | None, direction: str, shift: int
         ) -> tuple[list[int], Offsets]:
    ids, offsets = kept
    if limit is not None and len(ids) > limit:
        keep = slice(None, limit) if direction == "right" else slice(len(ids) - limit, None)
        ids, offsets = ids[keep], offsets[keep]
    if shift and offsets:
        offsets = [(a + shift, b + shift) for a, b in offsets]
    return ids, offsets
