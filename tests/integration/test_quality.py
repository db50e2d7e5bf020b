"""What the served outputs keep of the model's own neighbours, on real text (a small version
of bench/quality.py): a change that degrades retrieval fails here.

300 passages of the Language Reference's help topics (bench/corpus.py), 60 of them as queries
against all the others; the truth is sentence-transformers on PyTorch, by cosine. The
outputs come from the run's `embedsvc serve` on its defaults (the CPU's default graph), as
a client gets them from /v2/embed, and are searched as a vector store searches them.
Measured here (2026-12-03): floats 1.000, int8 codes 0.993 (0.922 with the per-dimension
ranges served before), bits 0.715; the thresholds sit under them by about the spread that
60 queries give, and int8's is the one the service promises (0.97).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from bench.corpus import passages
from embedsvc.model.retrieval import recall

PASSAGES, QUERIES = 300, 60
TYPES = ["float", "int8", "uint8", "ubinary"]


@pytest.fixture(scope="module")
def corpus(reference) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The passages, the queries' indices among them, and PyTorch's scores of the queries
    against every passage."""
    texts = passages(PASSAGES, stdlib=False)
    own = np.array(sorted(random.Random(1).sample(range(len(texts)), QUERIES)))
    truth = reference.encode(texts, normalize_embeddings=True, batch_size=32)
    return texts, own, truth[own] @ truth.T


@pytest.fixture(scope="module")
def outputs(corpus, shared, bundled) -> dict[str, np.ndarray]:
    texts = corpus[0]
    got: dict[str, list] = {t: [] for t in TYPES}
    with shared.use("bundled"), bundled.client() as c:
        for start in range(0, len(texts), 100):
            r = c.post("/v2/embed", json={"texts": texts[start:start + 100],
                                          "embedding_types": TYPES})
            assert r.status_code == 200, r.text
            for t in TYPES:
                got[t] += r.json()["embeddings"][t]
    return {t: np.array(rows, np.float32) for t, rows in got.items()}


def kept(corpus, rows: np.ndarray, hamming: bool = False) -> float:
    """recall@10 of ``rows`` searched by dot product (by Hamming distance: packed bits)."""
    _, own, truth = corpus
    if hamming:
        bits = np.unpackbits(rows.astype(np.uint8), axis=1).astype(np.float32)
        return recall(truth, bits[own] @ bits.T + (1 - bits[own]) @ (1 - bits).T, own=own)
    return recall(truth, rows[own] @ rows.T, own=own)


def test_the_default_graphs_floats_keep_the_neighbours(corpus, outputs):
    assert kept(corpus, outputs["float"]) >= 0.97


def test_int8_codes_by_dot_product_keep_the_neighbours(corpus, outputs):
    assert kept(corpus, outputs["int8"]) >= 0.97


def test_uint8_codes_less_128_are_the_int8_codes(outputs):
    np.testing.assert_array_equal(outputs["uint8"] - 128, outputs["int8"])


def test_binary_codes_by_hamming_keep_what_sign_bits_can(corpus, outputs):
    assert kept(corpus, outputs["ubinary"], hamming=True) >= 0.65
