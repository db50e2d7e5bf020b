"""Sparse encoders (SPLADE and kin) behind the Encoder interface.

The batcher thread computes one vocabulary-wide row per input (``encode``); each request
then keeps the active dimensions of its own rows as (index, value) pairs (``active``).

>>> rows = np.array([[0.0, 1.5, 0.0, 0.25]], dtype=np.float32)
>>> [(i.tolist(), v.tolist()) for i, v in active(rows)]
[([1, 3], [1.5, 0.25])]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .encoder import ModelInfo
from .st_encoder import SentenceTransformerEncoder, torch_forward

# The float32 logits one batch may hold (tokens x vocabulary): a MAX_BATCH_TOKENS sized for
# 384-wide rows (16,384) holds 16,384 x 30,522 of them, 2 GB, and a 16 KB request took 3.9 GB.
LOGITS_BYTES = 128 << 20


class SparseEmbedder(SentenceTransformerEncoder):
    """A sentence-transformers ``SparseEncoder``; rows are as wide as the vocabulary.

    Example (``path`` is a SparseEncoder directory)::

        sparse = SparseEmbedder.load(path)
        sparse.place("cpu", "float32")
        rows = sparse.encode([sparse.wrap(ids) for ids in sparse.tokenize(["a text"])])
        [(indices, values)] = active(rows, sparse.max_active_dims)
    """

    kind = "sparse"

    def __init__(self, model: Any, name: str, source: str | None = None) -> None:
        super().__init__(model, name, source)
        # the model's own cap on non-zero dimensions (SparseEncoder.encode applies it too)
        self.max_active_dims: int | None = getattr(model, "max_active_dims", None)

    @staticmethod
    def _model_class() -> Any:
        from sentence_transformers import SparseEncoder

        return SparseEncoder

    def encode(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        return torch_forward(self._modules, self.features(batch), "sentence_embedding")

    def batch_tokens(self, max_batch_tokens: int) -> int:
        return sparse_batch_tokens(self.info, max_batch_tokens)

    def _dimension(self) -> int:
        # SpladePooling learns its width on the first batch; the vocabulary is known now
        transformer = getattr(self._model, "transformers_model", None)
        config = getattr(transformer, "config", None)
        size = getattr(config, "vocab_size", None) or super()._dimension()
        return int(size)


def sparse_batch_tokens(info: ModelInfo, max_batch_tokens: int) -> int:
    """MAX_BATCH_TOKENS for a sparse model: within LOGITS_BYTES of logits (tokens x
    vocabulary floats), and never below one input at the model's limit."""
    fits = LOGITS_BYTES // (4 * info.dimension)
    return max(info.max_input_tokens, min(max_batch_tokens, fits))


def active(rows: np.ndarray, max_active_dims: int | None = None
           ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The non-zero (index, value) pairs of each row, indices ascending, as
    ``SparseEncoder.encode`` gives them: at most ``max_active_dims`` of the largest."""
    if max_active_dims is not None:
        rows = top_active(rows, max_active_dims)
    out = []
    for row in rows:
        indices = np.flatnonzero(row)
        out.append((indices, row[indices]))
    return out


def top_active(rows: np.ndarray, k: int) -> np.ndarray:
    """Rows with all but the ``k`` largest values (in absolute terms) set to zero, as
    sentence-transformers' ``select_max_active_dims`` gives them (in numpy: no torch).

    >>> top_active(np.array([[0.5, -2.0, 1.0]], dtype=np.float32), 2).tolist()
    [[0.0, -2.0, 1.0]]
    """
    if k <= 0:
        raise ValueError(f"max_active_dims must be a positive integer, got {k}")
    if k >= rows.shape[1]:
        return rows
    keep = np.argpartition(-np.abs(rows), k - 1, axis=1)[:, :k]
    out = np.zeros_like(rows)
    np.put_along_axis(out, keep, np.take_along_axis(rows, keep, axis=1), axis=1)
    return out
