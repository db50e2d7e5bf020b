"""The model's text side, rebuilt where the model is not: an HTTP process in front of the
engine process tokenizes with what the engine's card describes (``text_spec``), so that its
token ids are exactly the engine's own, and never loads the model itself.

>>> from embedsvc.model.fake import FakeEncoder
>>> enc = FakeEncoder(dimension=4)
>>> text = text_model(describe(enc.info), text_spec(enc))
>>> text.tokenize(["hello world"]) == enc.tokenize(["hello world"])
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..work import ModelInfo, Pair, Sequenced
from .pairs import tokenize_pairs
from .tokenizer import TextSide, tokenizer_from_json

_SCORERS = ("reranker", "classifier")


class TokenizerText(TextSide):
    """A model's fast tokenizer and template, from its ``tokenizer.json`` text."""

    def __init__(self, info: ModelInfo, tokenizer: str) -> None:
        self.info = info
        self._use_tokenizer(tokenizer_from_json(tokenizer))


class PairText(TokenizerText):
    """A cross-encoder's: texts and pairs, cut as ``CrossEncoder``'s tokenizer call cuts
    them (pairs.py's ``tokenize_pairs``)."""

    def __init__(self, info: ModelInfo, tokenizer: str) -> None:
        super().__init__(info, tokenizer)
        self._truncate_at = info.max_input_tokens

    def tokenize_sequences(self, inputs: Sequence[Sequenced], direction: str | None
                           ) -> list[Pair]:
        return tokenize_pairs(self, self._truncate_at, inputs, direction)


def describe(info: ModelInfo) -> dict[str, Any]:
    """``info`` as plain data (the card's), for ``text_model``."""
    return dataclasses.asdict(info)


def text_model(info: dict[str, Any], spec: dict[str, Any]) -> Any:
    """The text side that ``spec`` (an encoder's ``text_spec()``) describes; RuntimeError
    if its template is not the one the engine reported."""
    model = ModelInfo(**{**info, "labels": tuple(info.get("labels", ())),
                         "modalities": tuple(info.get("modalities", ("text",)))})
    if "fake" in spec:  # the simulated device's (tests, bench/sim_server.py)
        from .fake import FakeEncoder

        text: Any = FakeEncoder(dimension=model.dimension,
                                max_input_tokens=model.max_input_tokens, record=False)
        text.info = model
    else:
        text = (PairText if model.kind in _SCORERS else TokenizerText)(model, spec["tokenizer"])
    marked = text.wrap([-1])
    at = marked.index(-1)
    if [marked[:at], marked[at + 1:]] != [list(spec["prefix"]), list(spec["suffix"])]:
        raise RuntimeError("the tokenizer rebuilt from the engine's card wraps texts "
                           "differently from the engine's")
    return text


def text_spec(encoder: Any) -> dict[str, Any]:
    """What a front needs to tokenize as ``encoder`` does: its tokenizer's JSON (or, for the
    fake encoder, its word hash) and the ids its template puts around a text."""
    marked = encoder.wrap([-1])
    at = marked.index(-1)
    spec: dict[str, Any] = {"prefix": marked[:at], "suffix": marked[at + 1:]}
    from .fake import FakeEncoder

    tokenizer_json = getattr(encoder, "tokenizer_json", None)
    if tokenizer_json is None:
        if not isinstance(encoder, FakeEncoder):
            raise RuntimeError(f"{type(encoder).__name__} has no tokenizer a front can use")
        spec["fake"] = True
    else:
        spec["tokenizer"] = tokenizer_json()
    return spec
