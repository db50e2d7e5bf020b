"""Cross-encoders (rerankers and classifiers) behind the Encoder interface.

A cross-encoder reads a text, or a pair of texts, and gives one raw logit per output label.
Request threads tokenize (``tokenize_sequences``), the batcher thread runs ``encode`` on
whatever mix of texts and pairs was queued, and each request turns its own rows into
scores afterwards (``activate``), so that one batch can serve raw and activated requests.

>>> pair = Pair([101, 7, 102, 9, 102], second=3)
>>> len(pair), pair.second
(5, 3)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..work import Pair, Sequenced
from .pairs import tokenize_pairs
from .st_encoder import SentenceTransformerEncoder, torch_forward


class CrossEncoderScorer(SentenceTransformerEncoder):
    """A sentence-transformers ``CrossEncoder``; rows are raw logits, one column per label.

    ``kind`` is ``reranker`` (one label, scored with ``/rerank``) or ``classifier`` (any
    number of labels, ``/predict``).

    Example (``path`` is a CrossEncoder directory)::

        scorer = CrossEncoderScorer.load(path)
        scorer.place("cpu", "float32")
        logits = scorer.encode(scorer.tokenize_sequences([("query", "document")], "right"))
        scores = scorer.activate(logits, raw=False)
    """

    kind = "reranker"

    def __init__(self, model: Any, name: str, source: str | None = None) -> None:
        self.kind = "reranker" if int(model.num_labels) == 1 else "classifier"
        self._activation = model.activation_fn
        super().__init__(model, name, source)
        self._truncate_at = int(model.max_seq_length)

    @staticmethod
    def _model_class() -> Any:
        from sentence_transformers import CrossEncoder

        return CrossEncoder

    def serve_as(self, kind: str) -> None:
        """Serve as ``reranker`` (one label only) or ``classifier``: the KIND setting."""
        if kind == "reranker" and self._dimension() != 1:
            raise ValueError(
                f"KIND=reranker needs a model with one output label, and this one has "
                f"{self._dimension()} ({', '.join(self._labels())}); set KIND=classifier or auto"
            )
        self.kind = kind
        self.info = self._describe()

    def tokenize_sequences(self, inputs: Sequence[Sequenced], direction: str | None
                           ) -> list[Pair]:
        """Ids with special tokens of each text or (text, text) pair, as the model reads them.

        ``direction`` (``right`` or ``left``) truncates to the model's limit the way
        CrossEncoder's tokenizer call does (``longest_first``: the longer text loses tokens
        first); ``None`` does not truncate, for the caller to refuse those over the limit.

        Each distinct text is read only as far as its window of the model's limit
        (``window_tokens``), so the cost follows the limit, not the text, and a long query
        shared by every pair is read once; a pair keeps what the truncation would keep of the
        whole texts (``tokenize_pairs``). Untruncated, a cut text still holds more tokens than
        the limit (``Pair.cut``).
        """
        return tokenize_pairs(self, self._truncate_at, inputs, direction)

    def encode(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        rows = torch_forward(self._modules, self.features(batch), "scores")
        return rows.reshape(len(batch), -1)

    def activate(self, rows: np.ndarray, raw: bool) -> np.ndarray:
        """Scores from logits as ``CrossEncoder.predict`` gives them.

        ``raw``: the logits (``predict(activation_fn=Identity())``). Otherwise the model's
        activation (sigmoid unless the model names another), then a softmax across labels when
        there are several: ``predict(apply_softmax=True)``, probabilities for a classifier.
        """
        if raw:
            return rows
        import torch

        with torch.inference_mode():
            scores = self._activation(torch.from_numpy(np.ascontiguousarray(rows)))
            if scores.shape[1] > 1:
                scores = torch.nn.functional.softmax(scores, dim=1)
            return scores.numpy()

    def _token_types(self, batch: Sequence[Sequence[int]], input_ids: Any) -> Any:
        import torch

        types = segment_ids(batch, tuple(input_ids.shape))
        return torch.from_numpy(types).to(input_ids.device)

    def _dimension(self) -> int:
        return int(self._model.num_labels)

    def _labels(self) -> tuple[str, ...]:
        id2label = getattr(self._model.config, "id2label", None) or {}
        return tuple(str(id2label.get(i, f"LABEL_{i}")) for i in range(self._dimension()))


def segment_ids(batch: Sequence[Sequence[int]], shape: tuple[int, ...]) -> np.ndarray:
    """Token type ids of a padded batch: 0, and 1 for a pair's second segment."""
    types = np.zeros(shape, dtype=np.int64)
    for row, ids in enumerate(batch):
        if isinstance(ids, Pair):
            types[row, ids.second : len(ids)] = 1
    return types
