"""The request path of a loaded model: inputs in, rows out, through the batcher.

An ``Engine`` exists only once its model is loaded (``service.Service`` builds it), so
nothing on the request path is ever half-initialised.

>>> from embedsvc.batching.batcher import Batcher, BatchLimits
>>> from embedsvc.model.fake import FakeEncoder
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
from .batching.admission import deadline_error
from .batching.batcher import Batcher, BatchLimits
from .errors import InvalidRequest
from .metrics import Metrics
from .model.encoder import Encoder, ModelInfo, Piece
from .rules import Inputs
from .settings import Settings

Disconnected = Callable[[], bool] | None
_CHARS_PER_TOKEN = 4  # for the admission estimate only; settled to the exact count after
_TOKENIZE_CHUNK = 256  # inputs tokenized between two looks at the deadline


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

        Checked, then admitted (``Batcher.admit``), then tokenized within ``deadline``, then
        queued. ``disconnected`` (waitress's ``waitress.client_disconnected``) lets the queued
        inputs of a client that went away be dropped before they reach the model.
        """
        arrived = time.monotonic()
        deadline = deadline or arrived + self.settings.request_timeout_s
        rules.check_dimensions(dimensions, self.encoder.info.dimension)
        self.check(inputs)
        asked = time.monotonic()
        ticket = self.batcher.admit(len(inputs), self.estimate(inputs), deadline, disconnected)
        try:
            tokenizing = time.monotonic()  # the wait for admission counts as queue time
            ids = self.tokens(inputs, truncate=truncate, direction=direction, deadline=deadline)
            tokenize_s = time.monotonic() - tokenizing
            self.metrics.tokenization.observe(tokenize_s)
            job = self.batcher.submit(ids, deadline, disconnected, ticket=ticket)
        finally:
            self.batcher.admission.cancel(ticket)  # a no-op once the batcher took it over
        rows = job.result()  # no timeout: the watchdog fails it at its deadline while queued
        if dimensions is not None:
            rows = rows[:, :dimensions]
        if normalize:
            rows = l2_normalize(rows)
        return Embedded(
            vectors=rows,
            tokens=sum(map(len, ids)),
            tokenize_s=tokenize_s,
            queue_s=job.queue_s + tokenizing - asked,
            inference_s=job.inference_s,
            total_s=time.monotonic() - arrived,
        )

    def prepare(
        self, inputs: Inputs, *, truncate: bool | None = None, direction: str = "right",
        deadline: float | None = None,
    ) -> list[list[int]]:
        """Token ids with special tokens, truncated (or refused) to the model's limit."""
        self.check(inputs)
        return self.tokens(inputs, truncate=truncate, direction=direction, deadline=deadline)

    def check(self, inputs: Inputs) -> None:
        """The input rules (count, type, emptiness, characters): before any admission."""
        s = self.settings
        rules.check_inputs(inputs, max_inputs=s.max_inputs_per_request,
                           max_chars=s.max_input_chars)

    def estimate(self, inputs: Inputs) -> int:
        """Tokens ``inputs`` will hold with special tokens, for admission before tokenizing."""
        most = self.encoder.info.max_input_tokens
        special = self.encoder.special_tokens
        if isinstance(inputs[0], str):
            return sum(min(most, len(t) // _CHARS_PER_TOKEN + 1 + special) for t in inputs)
        return sum(min(most, len(ids) + special) for ids in inputs)

    def tokens(
        self, inputs: Inputs, *, truncate: bool | None = None, direction: str = "right",
        deadline: float | None = None,
    ) -> list[list[int]]:
        """Checked ``inputs`` as wrapped token ids; texts are cut before tokenizing (the cost
        follows the model's limit, not the body) and tokenized within ``deadline`` (504)."""
        encoder = self.encoder
        special = encoder.special_tokens
        room = encoder.info.max_input_tokens - special
        truncate = self.settings.auto_truncate if truncate is None else truncate
        if isinstance(inputs[0], str):
            # Not truncating: one token past the room is enough to know an input is too long.
            limit = room if truncate else room + 1
            content: list[list[int]] = []
            for start in range(0, len(inputs), _TOKENIZE_CHUNK):
                if deadline is not None and time.monotonic() > deadline:
                    raise deadline_error()
                chunk = inputs[start:start + _TOKENIZE_CHUNK]
                content.extend(encoder.tokenize(chunk, limit, direction))  # type: ignore[arg-type]
            exact = False
        else:
            vocab = encoder.info.vocab_size
            content = [self._unwrap(rules.check_token_ids(i, ids, vocab))
                       for i, ids in enumerate(inputs)]
            exact = True
        if max(map(len, content), default=0) <= room:  # nothing to cut or refuse
            return list(map(encoder.wrap, content))
        return [encoder.wrap(rules.fit(i, ids, room, special=special, truncate=truncate,
                                       direction=direction, exact=exact))
                for i, ids in enumerate(content)]

    def embed_all(
        self,
        inputs: Inputs,
        *,
        truncate: bool | None = None,
        direction: str = "right",
        deadline: float | None = None,
        disconnected: Disconnected = None,
    ) -> tuple[list[np.ndarray], int]:
        """Per-token vectors of each input (POST /embed_all) and the tokens computed.

        A debugging route, admitted like ``embed`` but not batched with other requests: it
        runs in the request thread, in slices within the batch limits, each holding the
        device between two batches.
        """
        encode_tokens = getattr(self.encoder, "encode_tokens", None)
        if encode_tokens is None:
            raise InvalidRequest("this model's backend gives no per-token vectors; use /embed",
                                 code="not_supported")
        deadline = deadline or time.monotonic() + self.settings.request_timeout_s
        self.check(inputs)
        ticket = self.batcher.admit(len(inputs), self.estimate(inputs), deadline, disconnected)
        try:
            ids = self.tokens(inputs, truncate=truncate, direction=direction, deadline=deadline)
            rows: list[np.ndarray] = []
            for part in _slices(ids, self.batcher.limits):
                lock = self.batcher.device_lock
                if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    raise deadline_error()
                try:
                    rows.extend(encode_tokens(part))
                finally:
                    lock.release()
        finally:
            self.batcher.admission.cancel(ticket)
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

    def pieces(self, texts: Sequence[str], *, deadline: float | None = None,
               disconnected: Disconnected = None) -> list[list[Piece]]:
        """The tokens the model sees for each text (POST /tokenize), under the same
        admission and deadline as ``embed``."""
        deadline = deadline or time.monotonic() + self.settings.request_timeout_s
        self.check(texts)
        ticket = self.batcher.admit(len(texts), self.estimate(texts), deadline, disconnected)
        try:
            out: list[list[Piece]] = []
            for start in range(0, len(texts), _TOKENIZE_CHUNK):
                if time.monotonic() > deadline:
                    raise deadline_error()
                out.extend(self.encoder.pieces(texts[start:start + _TOKENIZE_CHUNK]))
            return out
        finally:
            self.batcher.admission.cancel(ticket)


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
