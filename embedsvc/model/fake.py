"""A deterministic stand-in for a model, for tests and the simulated device of the benchmark.

>>> enc = FakeEncoder(dimension=4)
>>> ids = enc.tokenize(["hello world"])[0]
>>> enc.encode([ids]).shape
(1, 4)
"""

from __future__ import annotations

import itertools
import re
import threading
import time
import zlib
from collections.abc import Callable, Sequence

import numpy as np

from .encoder import ModelInfo, Piece

_WORD = re.compile(r"\S+")


class FakeEncoder:
    """Deterministic stand-in for tests and the simulated device of the benchmark.

    A word is one token; an input's vector is a position-weighted sum of rows of a fixed
    random matrix (a fixed-weight linear layer), so it depends only on the ids, and a test
    can compute the exact answer with ``expected``. ``delay_s + per_token_s * padded_tokens``
    is spent in ``time.sleep`` (the GIL released, as during device work). ``fail`` lets a
    test inject an exception for chosen batches. ``batches`` records every batch unless
    ``record`` is off.
    """

    def __init__(
        self,
        dimension: int = 8,
        *,
        max_input_tokens: int = 64,
        delay_s: float = 0.0,
        per_token_s: float = 0.0,
        fail: Callable[[Sequence[Sequence[int]]], BaseException | None] | None = None,
        record: bool = True,
    ) -> None:
        self.info = ModelInfo(
            name="fake",
            dimension=dimension,
            max_input_tokens=max_input_tokens,
            vocab_size=1000,
            device="cpu",
            dtype="float32",
        )
        self.delay_s = delay_s
        self.per_token_s = per_token_s
        self.fail = fail
        self.record = record
        self.batches: list[list[list[int]]] = []
        weights = np.random.default_rng(0).standard_normal((1000, dimension)).astype(np.float32)
        self._weights = np.vstack([weights, np.zeros((1, dimension), np.float32)])  # + padding
        self._lock = threading.Lock()

    special_tokens = 2

    def tokenize(self, texts: Sequence[str], limit: int | None = None,
                 direction: str = "right") -> list[list[int]]:
        return [[_word_id(word) for word in _split(text, limit, direction)] for text in texts]

    def wrap(self, ids: Sequence[int]) -> list[int]:
        return [1, *ids, 2]

    def pieces(self, texts: Sequence[str]) -> list[list[Piece]]:
        out = []
        for text in texts:
            spans = itertools.islice(_WORD.finditer(text), self.info.max_input_tokens - 2)
            words = [Piece(_word_id(m[0]), m[0], False, *m.span()) for m in spans]
            out.append([Piece(1, "[CLS]", True, None, None), *words,
                        Piece(2, "[SEP]", True, None, None)])
        return out

    def encode(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        rows = [list(ids) for ids in batch]
        if self.record:
            with self._lock:
                self.batches.append(rows)
        padded = max(len(ids) for ids in rows) * len(rows)
        if self.delay_s or self.per_token_s:
            time.sleep(self.delay_s + self.per_token_s * padded)
        if self.fail is not None:
            error = self.fail(rows)
            if error is not None:
                raise error
        return self._rows(rows)

    def encode_tokens(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Per-token vectors whose sum is the row ``encode`` returns for the same ids."""
        positions = np.arange(1, max(len(ids) for ids in batch) + 1, dtype=np.float32)[:, None]
        return [self._weights[list(ids)] * positions[: len(ids)] for ids in batch]

    def decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True
               ) -> list[str]:
        """The fake cannot invert its word hash: ids come back spelled as ``w<id>``."""
        special = {1: "[CLS]", 2: "[SEP]"}
        return [" ".join(special.get(i, f"w{i}") for i in ids
                         if not (skip_special_tokens and i in special)) for ids in batch]

    def vector(self, ids: Sequence[int]) -> np.ndarray:
        """The raw row for wrapped ``ids``: what ``encode`` returns for them."""
        return self._rows([ids])[0]

    def _rows(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        # One padded gather for the batch, so that the simulated device costs little CPU.
        # Padding points at an all-zero row: each row is the same in any batch.
        longest = max(len(ids) for ids in batch)
        ids = np.full((len(batch), longest), len(self._weights) - 1, dtype=np.intp)
        for i, row in enumerate(batch):
            ids[i, : len(row)] = row
        positions = np.arange(1, longest + 1, dtype=np.float32)[:, None]
        return (self._weights[ids] * positions).sum(axis=1)  # no BLAS call

    def expected(self, text: str) -> np.ndarray:
        """The normalised vector the service should return for ``text``."""
        v = self.vector(self.wrap(self.tokenize([text])[0]))
        return v / np.linalg.norm(v)


def _split(text: str, limit: int | None, direction: str) -> list[str]:
    """The first or last ``limit`` words (runs of non-space, as ``_WORD`` finds them);
    str.split stops splitting at ``limit``, so the cost follows it."""
    if limit is None:
        return text.split()
    if limit <= 0:
        return []
    if direction == "right":
        return text.split(None, limit)[:limit]
    return text.rsplit(None, limit)[-limit:]


def _word_id(word: str) -> int:
    return 3 + zlib.crc32(word.encode("utf-8", "surrogatepass")) % 997
