"""Retrieval quality: how many of a query's nearest neighbours another version of the vectors
still finds, which is what users of quantized vectors and int8 graphs care about (a mean
cosine does not see which neighbours change).

Scores are (queries, documents) matrices; each query is also a document (its own column,
``own``, is left out), as when the rows of a set are searched against the set.

>>> a = np.array([[1.0, 0.9, 0.1], [0.9, 1.0, 0.2], [0.1, 0.2, 1.0]])
>>> neighbours(a, k=1).ravel().tolist()
[1, 0, 1]
>>> recall(a, a, k=1), recall(a, -a, k=1)
(1.0, 0.0)
"""

from __future__ import annotations

import numpy as np

K = 10  # recall@10 and nDCG@10: the first page of results


def neighbours(scores: np.ndarray, k: int = K, own: np.ndarray | None = None) -> np.ndarray:
    """Each query's ``k`` best documents, best first; ``own``: each query's own column
    (default: the diagonal), left out. Ties go to the lower index."""
    scores = np.array(scores, np.float64)  # a copy: the own column is overwritten
    rows = np.arange(len(scores))
    scores[rows, rows if own is None else own] = -np.inf
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def recall(truth: np.ndarray, got: np.ndarray, k: int = K,
           own: np.ndarray | None = None) -> float:
    """The share of the ``k`` best documents by ``truth``'s scores that ``got``'s scores also
    rank in their ``k`` best, averaged over the queries."""
    want, found = neighbours(truth, k, own), neighbours(got, k, own)
    return float(np.mean([len(set(w) & set(f)) / k for w, f in zip(want, found, strict=True)]))
