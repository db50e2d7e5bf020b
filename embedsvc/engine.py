"""The request path of a loaded model: inputs in, rows out, through the batcher.

An ``Engine`` exists only once its model is loaded (``service.Service`` builds it), so
nothing on the request path is ever half-initialised.

>>> from embedsvc.batcher import Batcher, BatchLimits
>>> from embedsvc.encoder import FakeEncoder
>>> from embedsvc.settings import Settings
>>> encoder = FakeEncoder(dimension=4)
>>> batcher = Batcher(encoder.encode, BatchLimits.from_settings(Settings()))
>>> batcher.start()
>>> engine = Engine(Settings(), encoder, batcher)
>>> engine.embed(["hello world"]).vectors.shape
(1, 4)
>>> batcher.shutdown(timeout=1.0).failed
0
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from . import rules
from .batcher import Batcher, BatchLimits
from .encoder import Encoder, ModelInfo, Piece
from .errors import DeadlineExceeded, InvalidRequest
from .metrics import Metrics
from .rules import Inputs
from .settings import Settings

Disconnected = Callable[[], bool] | None


@dataclass(slots=True)
class Embedded:
    """The rows for one request, in input order, and where its time went."""

    vectors: np.ndarray
    tokens: int
    tokenize_s: float
    queue_s: float
    inference_s: float
    total_s: float


class Engine:
    """One loaded encoder and its batcher: validates, tokenizes, submits and shapes rows."""

    def __init__(self, settings: Settings, encoder: Encoder, batcher: Batcher,
                 metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.encoder = encoder
        self.batcher = batcher
        self.metrics = metrics or batcher.metrics
        marked = encoder.wrap([-1])  # where the model's template puts the text
        at = marked.index(-1)
        self._prefix, self._suffix = list(marked[:at]), list(marked[at + 1:])

    @property
    def info(self) -> ModelInfo:
        return self.encoder.info

    def embed(
        self,
        inputs: Inputs,
        *,
        normalize: bool = True,
        dimensions: int | None = None,
        truncate: bool | None = None,
        direction: str = "right",
        deadline: float | None = None,
        disconnected: Disconnected = None,
    ) -> Embedded:
        """Embed ``inputs`` (strings, or token-id lists without special tokens).

        ``disconnected`` (waitress's ``waitress.client_disconnected``) lets queued inputs of a
        client that went away be dropped before they reach the model.
        """
        arrived = time.monotonic()
        deadline = deadline or arrived + self.settings.request_timeout_s
        rules.check_dimensions(dimensions, self.encoder.info.dimension)
        ids = self.prepare(inputs, truncate=truncate, direction=direction)
        tokenize_s = time.monotonic() - arrived
        self.metrics.tokenization.observe(tokenize_s)
        job = self.batcher.submit(ids, deadline, disconnected)
        rows = job.result()  # no timeout: the watchdog fails it at its deadline while queued
        if dimensions is not None:
            rows = rows[:, :dimensions]
        if normalize:
            rows = l2_normalize(rows)
        return Embedded(
            vectors=rows,
            tokens=sum(len(x) for x in ids),
            tokenize_s=tokenize_s,
            queue_s=job.queue_s,
            inference_s=job.inference_s,
            total_s=time.monotonic() - arrived,
        )

    def prepare(
        self, inputs: Inputs, *, truncate: bool | None = None, direction: str = "right"
    ) -> list[list[int]]:
        """Token ids with special tokens, truncated (or refused) to the model's limit."""
        s, encoder = self.settings, self.encoder
        rules.check_inputs(inputs, max_inputs=s.max_inputs_per_request,
                           max_chars=s.max_input_chars)
        if isinstance(inputs[0], str):
            content = encoder.tokenize(inputs)  # type: ignore[arg-type]
        else:
            vocab = encoder.info.vocab_size
            content = [self._unwrap(rules.check_token_ids(i, ids, vocab))
                       for i, ids in enumerate(inputs)]
        special = encoder.special_tokens
        room = encoder.info.max_input_tokens - special
        truncate = s.auto_truncate if truncate is None else truncate
        return [encoder.wrap(rules.fit(i, ids, room, special=special, truncate=truncate,
                                       direction=direction))
                for i, ids in enumerate(content)]

    def embed_all(
        self,
        inputs: Inputs,
        *,
        truncate: bool | None = None,
        direction: str = "right",
        deadline: float | None = None,
    ) -> tuple[list[np.ndarray], int]:
        """Per-token vectors of each input (POST /embed_all) and the tokens computed.

        A debugging route, not batched with other requests: it runs in the request thread,
        in slices within the batch limits, each holding the device between two batches.
        """
        encode_tokens = getattr(self.encoder, "encode_tokens", None)
        if encode_tokens is None:
            raise InvalidRequest("this model's backend gives no per-token vectors; use /embed",
                                 code="not_supported")
        deadline = deadline or time.monotonic() + self.settings.request_timeout_s
        ids = self.prepare(inputs, truncate=truncate, direction=direction)
        rows: list[np.ndarray] = []
        for part in _slices(ids, self.batcher.limits):
            lock = self.batcher.device_lock
            if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise DeadlineExceeded("the device stayed busy past this request's deadline",
                                       code="timeout")
            try:
                rows.extend(encode_tokens(part))
            finally:
                lock.release()
        return rows, sum(len(x) for x in ids)

    def decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True
               ) -> list[str]:
        """Token ids of the served model back to text (POST /decode)."""
        decode = getattr(self.encoder, "decode", None)
        if decode is None:
            raise InvalidRequest("this model's backend cannot decode token ids",
                                 code="not_supported")
        rules.check_count(len(batch), self.settings.max_inputs_per_request)
        vocab = self.encoder.info.vocab_size
        checked = [rules.check_token_ids(i, ids, vocab) for i, ids in enumerate(batch)]
        return decode(checked, skip_special_tokens)

    def _unwrap(self, ids: list[int]) -> list[int]:
        """Ids that already carry the model's special tokens (as /tokenize gives them) lose
        them here, so that they are not added twice."""
        head, tail = len(self._prefix), len(self._suffix)
        if (head or tail) and len(ids) >= head + tail and ids[:head] == self._prefix \
                and ids[len(ids) - tail:] == self._suffix:
            return ids[head:len(ids) - tail]
        return ids

    def pieces(self, texts: Sequence[str]) -> list[list[Piece]]:
        """The tokens the model sees for each text (POST /tokenize)."""
        s = self.settings
        rules.check_inputs(texts, max_inputs=s.max_inputs_per_request,
                           max_chars=s.max_input_chars)
        return self.encoder.pieces(texts)


def _slices(ids: list[list[int]], limits: BatchLimits) -> list[list[list[int]]]:
    """``ids`` cut, in order, into runs within the batch size and padded-token limits."""
    out: list[list[list[int]]] = []
    run: list[list[int]] = []
    longest = 0
    for seq in ids:
        wider = max(longest, len(seq))
        if run and (len(run) >= limits.max_batch_size
                    or wider * (len(run) + 1) > limits.max_batch_tokens):
            out.append(run)
            run, wider = [], len(seq)
        run.append(seq)
        longest = wider
    if run:
        out.append(run)
    return out


def l2_normalize(rows: np.ndarray) -> np.ndarray:
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows))[:, None]
    return rows / np.maximum(norms, 1e-12)
