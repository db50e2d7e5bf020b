"""The model's fast tokenizer as the request threads use it (no torch needed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..work import ModelInfo, Piece
from .window import token_window


def plain_tokenizer(hf_tokenizer: Any, truncate_at: int | None = None,
                     direction: str = "right") -> Any:
    """A private copy of the fast tokenizer: no padding, and no truncation (``token_window``
    cuts single texts) unless ``truncate_at`` is given.

    With ``truncate_at``: ``longest_first`` to that many tokens from ``direction``, special
    tokens included, which is what the tokenizer's own call does with ``truncation=True`` to
    a pair of texts (scorer.py).

    ``encode_batch`` on it only reads shared state, so request threads can call it at once;
    the tokenizer's own call API changes truncation state per call and is not safe that way.
    """
    return tokenizer_from_json(hf_tokenizer.backend_tokenizer.to_str(), truncate_at, direction)


def tokenizer_from_json(text: str, truncate_at: int | None = None,
                        direction: str = "right") -> Any:
    """``plain_tokenizer`` from a ``tokenizer.json``'s text (what lean.py reads)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(text)
    tok.no_padding()
    if truncate_at:
        tok.enable_truncation(truncate_at, direction=direction)
    else:
        tok.no_truncation()
    return tok


def template_ids(tok: Any) -> tuple[list[int], list[int]]:
    """The ids the model's template puts before and after a single text."""
    probe = "hello"
    bare = tok.encode(probe, add_special_tokens=False).ids
    full = tok.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    raise RuntimeError("cannot find where the tokenizer's template places the text")


def added_token_margin(tok: Any) -> int:
    """The length of the tokenizer's longest added token (``token_window``'s ``margin``)."""
    return max((len(t.content) for t in tok.get_added_tokens_decoder().values()), default=0)


def padded(batch: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Input ids padded with ``pad_id`` to the longest, and the attention mask (int64)."""
    width = max(len(ids) for ids in batch)
    input_ids = np.full((len(batch), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), width), dtype=np.int64)
    for row, ids in enumerate(batch):
        input_ids[row, : len(ids)] = ids
        mask[row, : len(ids)] = 1
    return input_ids, mask


class TextSide:
    """The Encoder methods that only tokenize: ``tokenize``, ``wrap``, ``pieces``, ``decode``.

    Shared by the sentence-transformers encoder and the PyTorch-free one (lean.py), so that
    both cut, wrap and show tokens identically. A subclass calls ``_use_tokenizer`` and sets
    ``info`` (``pieces`` reads ``info.max_input_tokens``).
    """

    info: ModelInfo

    def _use_tokenizer(self, tok: Any) -> None:
        self._tokenizer = tok
        self._margin = added_token_margin(tok)
        self._prefix, self._suffix = template_ids(tok)

    def tokenizer_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text: what a process without the model
        tokenizes with (model/text.py)."""
        return str(self._tokenizer.to_str())

    def tokenize(self, texts: Sequence[str], limit: int | None = None,
                 direction: str = "right") -> list[list[int]]:
        if limit is None:
            encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
            return [e.ids for e in encodings]
        return [ids for ids, _ in token_window(self._tokenizer, texts, limit, direction,
                                               self._margin, offsets=False)]

    def wrap(self, ids: Sequence[int]) -> list[int]:
        return [*self._prefix, *ids, *self._suffix]

    def pieces(self, texts: Sequence[str]) -> list[list[Piece]]:
        room = self.info.max_input_tokens - self.special_tokens
        windows = token_window(self._tokenizer, texts, room, "right", self._margin)
        return [[*map(self._special_piece, self._prefix),
                 *(Piece(i, text[a:b], False, a, b) for i, (a, b) in zip(*window, strict=True)),
                 *map(self._special_piece, self._suffix)]
                for text, window in zip(texts, windows, strict=True)]

    def decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True
               ) -> list[str]:
        return self._tokenizer.decode_batch([list(ids) for ids in batch],
                                            skip_special_tokens=skip_special_tokens)

    @property
    def special_tokens(self) -> int:
        return len(self._prefix) + len(self._suffix)

    def _special_piece(self, token_id: int) -> Piece:
        return Piece(token_id, self._tokenizer.id_to_token(token_id), True, None, None)
