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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

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


def text_window(tokenizer: Any, texts: Sequence[str], limit: int, direction: str = "right",
                margin: int = 0) -> list[str]:
    """Each text, or the prefix (``right``) or suffix (``left``) of it whose tokens begin (or
    end) with the text's own first (last) ``limit`` tokens: what a tokenizer that truncates
    to ``limit`` needs to see of it, at a cost that follows ``limit`` (pairs, scorer.py)."""
    return [window for window, _ in text_windows(tokenizer, texts, limit, direction, margin)]


def text_windows(tokenizer: Any, texts: Sequence[str], limit: int, direction: str = "right",
                 margin: int = 0) -> list[tuple[str, int]]:
    """``text_window`` of each text, with how many of the text's own tokens the window is
    known to hold (all of them, for a text kept whole): a lower bound of its length."""
    out = [(text, 0) for text in texts]
    for i, part, kept in _windows(tokenizer, texts, limit, direction, margin, offsets=False):
        out[i] = (part, len(kept[0]))
    return out


def pair_windows(tokenizer: Any, texts: tuple[str, str], windows: Sequence[tuple[str, int]],
                 limit: int, direction: str = "right", margin: int = 0) -> tuple[str, str]:
    """The ``text_windows`` of a pair, widened until the windows' token counts compare as the
    whole texts' do. Truncating a pair ``longest_first`` gives the longer side (the second,
    on a tie) what the limit leaves, so that order, not the lengths, decides which tokens
    stay; a window that stops early, or cuts a word into more tokens than it makes whole,
    can reverse it. A cut window is trusted only when the tokens it is known to hold already
    settle the order against the other side's whole text."""
    (a, b), ((wa, ka), (wb, kb)) = texts, windows
    while True:
        cut_a, cut_b = wa != a, wb != b
        if not cut_a and not cut_b:
            return wa, wb
        if cut_a and not cut_b and ka > kb:
            return wa, wb  # a is longer than b in the text, and so in the window
        if cut_b and not cut_a and kb >= ka:
            return wa, wb  # b is at least as long as a, in the text and in the window
        limit = max(2 * limit, min(ka, kb) + 1)
        (wa, ka), (wb, kb) = text_windows(tokenizer, [a, b], limit, direction, margin)


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
