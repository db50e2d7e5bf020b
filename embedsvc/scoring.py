"""The request path of rerankers, classifiers and sparse encoders: inputs in, scores out.

Below HTTP, beside ``Engine.embed``: the same rules, the same batcher (a pair's tokens count
against MAX_BATCH_TOKENS like any input's; deadlines, admission, departed clients and OOM
splitting apply alike), and each request shapes only its own rows.

Example (``engine`` serves a reranker)::

    scored = score(engine, [("query", "a document"), ("query", "another")])
    scored.scores[:, 0]  # one relevance score per pair, in request order
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from . import rules
from .errors import InvalidRequest
from .model.scorer import CrossEncoderScorer, Sequenced
from .model.sparse import SparseEmbedder, active

if TYPE_CHECKING:
    from .engine import Embedded, Engine

Disconnected = Callable[[], bool] | None


@dataclass(slots=True)
class Scored:
    """Scores for one request, one row per input in request order (columns: labels)."""

    scores: np.ndarray
    tokens: int
    tokenize_s: float
    queue_s: float
    inference_s: float
    total_s: float


def score(
    engine: Engine,
    inputs: Sequence[Sequenced],
    *,
    raw: bool = False,
    truncate: bool | None = None,
    direction: str = "right",
    deadline: float | None = None,
    disconnected: Disconnected = None,
) -> Scored:
    """Score texts and (text, text) pairs with the served cross-encoder.

    ``raw``: logits; else ``CrossEncoder.predict``'s activation (see ``activate``).
    Over-long inputs are cut ``longest_first`` from ``direction``, or refused with a 400 when
    ``truncate`` is false (``None``: the AUTO_TRUNCATE setting).
    """
    arrived = time.monotonic()
    s = engine.settings
    scorer = cast(CrossEncoderScorer, engine.encoder)
    deadline = deadline or arrived + s.request_timeout_s
    check_sequences(inputs, max_inputs=s.max_inputs_per_request, max_chars=s.max_input_chars)
    truncate = s.auto_truncate if truncate is None else truncate
    # admitted before tokenizing, as Engine.embed does; a pair is estimated as its two texts
    joined = [item if isinstance(item, str) else item[0] + item[1] for item in inputs]
    ticket = engine.batcher.admit(len(inputs), engine.estimate(joined), deadline, disconnected)
    try:
        tokenizing = time.monotonic()
        sequences = scorer.tokenize_sequences(inputs, direction if truncate else None)
        limit = scorer.info.max_input_tokens
        for i, ids in enumerate(sequences):
            rules.fit(i, ids, limit, special=0, truncate=False, direction=direction)
        tokenize_s = time.monotonic() - tokenizing
        engine.metrics.tokenization.observe(tokenize_s)
        job = engine.batcher.submit(sequences, deadline, disconnected,  # type: ignore[arg-type]
                                    ticket=ticket)
    finally:
        engine.batcher.admission.cancel(ticket)  # a no-op once the batcher took it over
    rows = job.result()  # no timeout: the watchdog fails it at its deadline while queued
    return Scored(
        scores=scorer.activate(rows, raw),
        tokens=sum(len(x) for x in sequences),
        tokenize_s=tokenize_s,
        queue_s=job.queue_s + tokenizing - arrived,
        inference_s=job.inference_s,
        total_s=time.monotonic() - arrived,
    )


def check_sequences(inputs: Sequence[Sequenced], *, max_inputs: int, max_chars: int) -> None:
    """Count, emptiness and size of a cross-encoder request's texts and pairs."""
    rules.check_count(len(inputs), max_inputs)
    for i, item in enumerate(inputs):
        texts = (item,) if isinstance(item, str) else item
        if not all(texts):
            raise InvalidRequest(
                f"input {i} holds an empty text; every text needs at least one character",
                param="input", code="empty_input",
            )
        chars = sum(len(t) for t in texts)
        if chars > max_chars:
            raise InvalidRequest(
                f"input {i} has {chars} characters, more than MAX_INPUT_CHARS ({max_chars}); "
                "split it",
                param="input", code="input_too_long",
            )


def embed_sparse(engine: Engine, texts: Sequence[str], **options: object
                 ) -> tuple[Embedded, list[tuple[np.ndarray, np.ndarray]]]:
    """The active (index, value) pairs of each text, as ``SparseEncoder.encode`` gives them.

    ``options`` are ``Engine.embed``'s (truncation, deadline, disconnected).
    """
    out = engine.embed(list(texts), normalize=False, **options)  # type: ignore[arg-type]
    cap = cast(SparseEmbedder, engine.encoder).max_active_dims
    return out, active(out.vectors, cap)


def similarities(engine: Engine, source: str, sentences: Sequence[str], **options: object
                 ) -> tuple[Embedded, np.ndarray]:
    """Cosine similarity of ``source`` with each of ``sentences`` (TEI's /similarity)."""
    out = engine.embed([source, *sentences], normalize=True, **options)  # type: ignore[arg-type]
    return out, out.vectors[1:] @ out.vectors[0]
