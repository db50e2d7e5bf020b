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
from functools import partial
from typing import Any

import numpy as np

from .st_encoder import SentenceTransformerEncoder, torch_forward
from .tokenizer import plain_tokenizer, template_ids
from .window import TokenCounts, pair_shares, window_tokens

Sequenced = str | tuple[str, str]  # one input of a cross-encoder: a text or a pair of texts


class Pair(list):
    """Token ids of a text pair, special tokens in; ids from ``second`` on are segment B.

    It is a list of ids, as the batcher expects of any input (it only takes ``len``), so a
    pair's tokens count against MAX_BATCH_TOKENS like any input's; ``encode`` reads
    ``second`` to give segment B token type 1. ``cut``: a text was read only as far as the
    model's limit (its full token count is unknown, and over the limit).
    """

    __slots__ = ("second", "cut")

    def __init__(self, ids: Sequence[int], second: int, cut: bool = False) -> None:
        super().__init__(ids)
        self.second = second
        self.cut = cut


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
        limit = int(model.max_seq_length)
        self._truncating_to = {
            side: plain_tokenizer(model.tokenizer, truncate_at=limit, direction=side)
            for side in ("right", "left")
        }

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
        return tokenize_pairs(self, self._truncating_to, inputs, direction)

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


def tokenize_pairs(encoder: Any, truncating_to: dict[str, Any],
                   inputs: Sequence[Sequenced], direction: str | None) -> list[Pair]:
    """``tokenize_sequences`` of any cross-encoder: ``encoder._tokenizer`` (the plain fast
    tokenizer), ``_margin`` and ``info``, and ``truncating_to`` each direction's truncating
    copy, whose limit and special tokens say how many tokens of text it keeps.

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
    kept = None if direction is None else truncating_to[direction].truncation["max_length"]
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


def segment_ids(batch: Sequence[Sequence[int]], shape: tuple[int, ...]) -> np.ndarray:
    """Token type ids of a padded batch: 0, and 1 for a pair's second segment."""
    types = np.zeros(shape, dtype=np.int64)
    for row, ids in enumerate(batch):
        if isinstance(ids, Pair):
            types[row, ids.second : len(ids)] = 1
    return types


def pair_of(ids: list[int], type_ids: list[int], cut: bool = False) -> Pair:
    """A tokenized text or pair as a ``Pair``, its second segment read from the type ids;
    ``cut``: a text of it was read only as far as its window."""
    second = next((i for i, t in enumerate(type_ids) if t), len(ids))
    if any(t != (i >= second) for i, t in enumerate(type_ids)):
        # every tokenizer template in use puts segment A, then B: 0...0 1...1
        raise ValueError(f"unexpected token types {type_ids} for a pair of texts")
    return Pair(ids, second, cut)
