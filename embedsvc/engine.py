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

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from . import rules
from .batching.admission import Admission, Ticket, deadline_error
from .batching.batcher import Batcher, ShutdownReport
from .errors import ApiError, ClientDisconnected, InvalidRequest
from .metrics import Metrics
from .model import quantize
from .model.encoder import Encoder, ModelInfo, Piece, Scorer, Sparse
from .model.graph_cache import cache_root
from .model.scorer import Pair, Sequenced
from .model.sparse import active
from .rules import Inputs
from .settings import Settings

Disconnected = Callable[[], bool] | None
# Token-id inputs to texts, each as it is decoded (OpenAI ids: api/openai_tokens.py), given
# ``max_chars`` (MAX_INPUT_CHARS) so that one input's decoding stops once it is too long.
Decoder = Callable[..., Iterable[str]]
# /embed_all answers a vector per token (about 4,600 times its body): TEI's cap, 32 inputs.
EMBED_ALL_MAX_INPUTS = 32
_CHARS_PER_TOKEN = 4  # for the admission estimate only; settled to the exact count after
_TOKENIZE_CHUNK = 256  # inputs tokenized between two looks at the deadline and the client
_LOCK_WATCH_S = 0.1  # how often /embed_all, waiting for the device, looks at its client
_CALIBRATION_BATCH = 64  # calibration texts per request through the batcher
T = TypeVar("T")


@dataclass(slots=True)
class Embedded:
    """The rows for one request, in input order, and where its time went.

    Rows are vectors (embeddings, sparse vocabulary-wide rows) or scores (one column per
    label of a reranker or classifier): every kind's request ends in this one type.
    """

    vectors: np.ndarray
    tokens: int
    tokenize_s: float
    queue_s: float
    inference_s: float
    total_s: float


class Engine:
    """One loaded encoder and its batcher: every kind's request path, rules to rows.

    Every request that reaches the model goes through ``_run`` (admit -> tokenize -> submit
    -> wait); ``embed_all``, which does not queue for the batcher, is admitted the same way
    (``_admitted``) on what it produces. ``pieces`` and ``decode`` never reach the device:
    they are admitted on their own budget (``host``: MAX_QUEUE inputs, MAX_QUEUE_TOKENS
    tokens or ids), which the device's rate does not govern, so that they neither get 429
    from it nor hold back the requests that do reach it.
    """

    def __init__(self, settings: Settings, encoder: Encoder, batcher: Batcher,
                 metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.encoder = encoder
        self.batcher = batcher
        self.metrics = metrics or batcher.metrics
        limits = batcher.limits
        self.host = Admission(max_inputs=limits.max_queue, max_tokens=limits.max_queue_tokens,
                              timeout_s=limits.timeout_s, floor_inputs=limits.max_request,
                              metrics=self.metrics)
        marked = encoder.wrap([-1])  # where the model's template puts the text
        at = marked.index(-1)
        self._prefix, self._suffix = list(marked[:at]), list(marked[at + 1:])
        self._calibration: quantize.Calibration | None = None
        self._calibrating = threading.Lock()

    @property
    def info(self) -> ModelInfo:
        return self.encoder.info

    def calibration(self) -> quantize.Calibration:
        """The model's int8/uint8 calibration (model/quantize.py): computed through this
        engine, or read from the cache, once, by the first caller that asks (the server's
        first int8 request, a bulk job's start), so that startup never pays for it."""
        with self._calibrating:  # concurrent first callers compute it once
            if self._calibration is None:
                batch = max(1, min(_CALIBRATION_BATCH, self.settings.max_inputs_per_request))
                self._calibration = quantize.calibrate(
                    cache_root(self.settings.cache_dir), self.info, self._raw_rows, batch=batch)
        return self._calibration

    def _raw_rows(self, texts: list[str]) -> np.ndarray:
        """Unnormalised rows, each call one admitted request through the batcher."""
        deadline = time.monotonic() + self.settings.request_timeout_s
        return self.embed(texts, normalize=False, truncate=True, deadline=deadline).vectors

    def shutdown(self, timeout: float) -> ShutdownReport:
        """Refuse new work (503), finish what was admitted within ``timeout``."""
        self.host.close()
        return self.batcher.shutdown(timeout)

    # -- embedding models ---------------------------------------------------------------------

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
        decode: Decoder | None = None,
        flow: Hashable | None = None,
    ) -> Embedded:
        """Embed ``inputs`` (strings, or token-id lists without special tokens).

        Checked, then admitted (``Batcher.admit``), then tokenized within ``deadline``, then
        queued. ``disconnected`` (waitress's ``waitress.client_disconnected``) lets the inputs
        of a client that went away be dropped before they reach the model. ``decode`` turns
        token-id inputs into texts first (ids of another tokenizer, such as OpenAI's).
        ``flow`` (the client's connection) decides its turn among others' (``start_tag``).
        """
        arrived = time.monotonic()
        deadline = deadline or arrived + self.settings.request_timeout_s
        rules.check_dimensions(dimensions, self.encoder.info.dimension)
        inputs = self._decoded(inputs, decode)
        self.check(inputs)
        out = self._run(
            len(inputs), self.estimate(inputs),
            lambda: self.tokens(inputs, truncate=truncate, direction=direction,
                                deadline=deadline, disconnected=disconnected),
            arrived, deadline, disconnected, flow)
        if dimensions is not None:
            out.vectors = out.vectors[:, :dimensions]
        if normalize:
            out.vectors = l2_normalize(out.vectors)
        return out

    def similarity(self, source: str, sentences: Sequence[str], **options: Any
                   ) -> tuple[Embedded, np.ndarray]:
        """Cosine similarity of ``source`` with each of ``sentences`` (TEI's /similarity);
        ``options`` are ``embed``'s."""
        rules.check_listed(sentences, "inputs.sentences")
        out = self.embed([source, *sentences], normalize=True, **options)
        return out, out.vectors[1:] @ out.vectors[0]

    def embed_sparse(self, texts: Sequence[str], **options: Any
                     ) -> tuple[Embedded, list[tuple[np.ndarray, np.ndarray]]]:
        """The active (index, value) pairs of each text, as ``SparseEncoder.encode`` gives
        them; ``options`` are ``embed``'s (truncation, deadline, disconnected)."""
        sparse = self._sparse()
        out = self.embed(list(texts), normalize=False, **options)
        return out, active(out.vectors, sparse.max_active_dims)

    # -- rerankers and classifiers ------------------------------------------------------------

    def rerank(self, query: str, texts: Sequence[str], *, param: str = "texts", **options: Any
               ) -> Embedded:
        """Scores of each of ``texts`` against ``query`` (``param`` names the list in errors);
        ``options`` are ``score``'s."""
        rules.check_query(query, self.settings.max_input_chars)
        rules.check_listed(texts, param)
        return self.score([(query, text) for text in texts], **options)

    def score(
        self,
        inputs: Sequence[Sequenced],
        *,
        raw: bool = False,
        truncate: bool | None = None,
        direction: str = "right",
        deadline: float | None = None,
        disconnected: Disconnected = None,
        flow: Hashable | None = None,
    ) -> Embedded:
        """Score texts and (text, text) pairs with the served cross-encoder.

        ``raw``: logits; else ``CrossEncoder.predict``'s activation. Over-long inputs are cut
        ``longest_first`` from ``direction``, or refused with a 400 when ``truncate`` is false
        (``None``: the AUTO_TRUNCATE setting).
        """
        arrived = time.monotonic()
        s = self.settings
        scorer = self._scorer()
        deadline = deadline or arrived + s.request_timeout_s
        rules.check_sequences(inputs, max_inputs=s.max_inputs_per_request,
                              max_chars=s.max_input_chars)
        truncate = s.auto_truncate if truncate is None else truncate
        out = self._run(
            len(inputs), self._estimate_sequences(inputs),
            lambda: self._sequences(scorer, inputs, truncate, direction, deadline, disconnected),
            arrived, deadline, disconnected, flow)
        out.vectors = scorer.activate(out.vectors, raw)
        return out

    # -- what does not queue for the batcher --------------------------------------------------

    def embed_all(
        self,
        inputs: Inputs,
        *,
        truncate: bool | None = None,
        direction: str = "right",
        deadline: float | None = None,
        disconnected: Disconnected = None,
        flow: Hashable | None = None,
    ) -> tuple[list[np.ndarray], int]:
        """Per-token vectors of each input (POST /embed_all) and the tokens computed.

        A debugging route, not batched with other requests: at most EMBED_ALL_MAX_INPUTS
        inputs, admitted at the model's limit for each (what it can produce), run in the
        request thread in slices of at most one input at the model's limit, each holding the
        device between two batches (so another client waits for one input's compute, not for
        a batch of them); dropped when its client leaves or its deadline passes.
        """
        encode_tokens = self._optional("encode_tokens", "gives no per-token vectors; use /embed")
        deadline = deadline or time.monotonic() + self.settings.request_timeout_s
        self.check(inputs)
        rules.check_embed_all_count(len(inputs), EMBED_ALL_MAX_INPUTS)
        most = len(inputs) * self.encoder.info.max_input_tokens
        with self._admitted(len(inputs), most, deadline, disconnected):
            ids = self.tokens(inputs, truncate=truncate, direction=direction, deadline=deadline,
                              disconnected=disconnected)
            tag = self.batcher.start_tag(flow, sum(map(len, ids)))
            rows: list[np.ndarray] = []
            limits = self.batcher.limits
            turn = min(limits.max_batch_tokens, self.encoder.info.max_input_tokens)
            for part in _slices(ids, limits.max_batch_size, turn):
                self._device_turn(len(ids) - len(rows), deadline, disconnected, tag)
                tag += sum(map(len, part))
                try:
                    rows.extend(encode_tokens(part))
                finally:
                    self.batcher.device_lock.release()
        return rows, sum(len(x) for x in ids)

    def pieces(self, texts: Sequence[str], *, deadline: float | None = None,
               disconnected: Disconnected = None) -> list[list[Piece]]:
        """The tokens the model sees for each text (POST /tokenize), admitted on the host's
        budget: they never reach the device, so its rate does not refuse them."""
        deadline = deadline or time.monotonic() + self.settings.request_timeout_s
        self.check(texts)
        with self._admitted(len(texts), self.estimate(texts), deadline, disconnected,
                            self.host):
            out: list[list[Piece]] = []
            for chunk in self._chunks(texts, deadline, disconnected):
                out.extend(self.encoder.pieces(chunk))
            return out

    def decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True, *,
               deadline: float | None = None, disconnected: Disconnected = None) -> list[str]:
        """Token ids of the served model back to text (POST /decode), admitted on the host's
        budget, counting the ids."""
        decode = self._optional("decode", "cannot decode token ids")
        deadline = deadline or time.monotonic() + self.settings.request_timeout_s
        rules.check_count(len(batch), self.settings.max_inputs_per_request, param="ids")
        vocab = self.encoder.info.vocab_size
        total = sum(map(len, batch))
        rules.check_decode_ids(total, self.host.max_tokens)
        checked = [rules.check_token_ids(i, ids, vocab) for i, ids in enumerate(batch)]
        with self._admitted(len(checked), total, deadline, disconnected, self.host):
            out: list[str] = []
            for chunk in self._chunks(checked, deadline, disconnected):
                out.extend(decode(chunk, skip_special_tokens))
            return out

    # -- the rules and the tokens -------------------------------------------------------------

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
        deadline: float | None = None, disconnected: Disconnected = None,
    ) -> list[list[int]]:
        """Checked ``inputs`` as wrapped token ids; texts are cut before tokenizing (the cost
        follows the model's limit, not the body) and tokenized within ``deadline`` (504)
        while the client is there (499)."""
        encoder = self.encoder
        special = encoder.special_tokens
        room = encoder.info.max_input_tokens - special
        truncate = self.settings.auto_truncate if truncate is None else truncate
        if isinstance(inputs[0], str):
            # Not truncating: one token past the room is enough to know an input is too long.
            limit = room if truncate else room + 1
            content: list[list[int]] = []
            for chunk in self._chunks(inputs, deadline, disconnected):
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

    # -- the one request path -----------------------------------------------------------------

    def _run(self, inputs: int, estimate: int, tokenize: Callable[[], list[list[int]]],
             arrived: float, deadline: float, disconnected: Disconnected,
             flow: Hashable | None = None) -> Embedded:
        """Admit -> tokenize -> submit -> wait: how every kind's request reaches the model."""
        asked = time.monotonic()
        # what _admitted does, without a generator: every request passes here
        gate = self.batcher.admission
        ticket = gate.admit(inputs, estimate, deadline, disconnected)
        try:
            tokenizing = time.monotonic()  # the wait for admission counts as queue time
            ids = tokenize()
            tokenize_s = time.monotonic() - tokenizing
            self.metrics.tokenization.observe(tokenize_s)
            job = self.batcher.submit(ids, deadline, disconnected, ticket=ticket, flow=flow)
        finally:
            gate.cancel(ticket)  # a no-op once the batcher took it over
        rows = job.result()  # no timeout: the watchdog fails it at its deadline while queued
        return Embedded(
            vectors=rows,
            tokens=sum(map(len, ids)),
            tokenize_s=tokenize_s,
            queue_s=job.queue_s + tokenizing - asked,
            inference_s=job.inference_s,
            total_s=time.monotonic() - arrived,
        )

    @contextmanager
    def _admitted(self, inputs: int, tokens: int, deadline: float, disconnected: Disconnected,
                  gate: Admission | None = None) -> Iterator[Ticket]:
        """A reservation of ``gate`` (the device's: the batcher's) held while the block
        runs; freed after it unless the batcher took it over (``submit``)."""
        gate = gate or self.batcher.admission
        ticket = gate.admit(inputs, tokens, deadline, disconnected)
        try:
            yield ticket
        finally:
            gate.cancel(ticket)  # a no-op once the batcher took it over

    def _chunks(self, items: Sequence[T], deadline: float | None, disconnected: Disconnected
                ) -> Iterator[Sequence[T]]:
        """``items`` in runs, each only while the request is still wanted."""
        for start in range(0, len(items), _TOKENIZE_CHUNK):
            self._still_wanted(len(items) - start, deadline, disconnected)
            yield items[start:start + _TOKENIZE_CHUNK]

    def _still_wanted(self, left: int, deadline: float | None, disconnected: Disconnected
                      ) -> None:
        """Raise 504 past ``deadline``, 499 once the client left; ``left`` inputs dropped."""
        error: ApiError
        if deadline is not None and time.monotonic() > deadline:
            error = deadline_error()
        elif disconnected is not None and disconnected():
            error = ClientDisconnected("the client disconnected", code="client_disconnected")
        else:
            return
        self.metrics.dropped_inputs.labels(reason=error.reason).inc(left)
        raise error

    def _device_turn(self, left: int, deadline: float, disconnected: Disconnected, tag: float
                     ) -> None:
        """The device lock, taken between two batches at the turn of ``tag`` (``start_tag``)
        while the request is still wanted."""
        lock = self.batcher.device_lock
        while True:
            self._still_wanted(left, deadline, disconnected)
            wait = max(0.0, min(_LOCK_WATCH_S, deadline - time.monotonic()))
            if lock.acquire(timeout=wait, tag=tag):
                return

    def _decoded(self, inputs: Inputs, decode: Decoder | None) -> Inputs:
        """Texts of token-id inputs meant for another tokenizer, checked as they come."""
        if decode is None or not inputs or isinstance(inputs[0], str):
            return inputs
        self.check(inputs)  # the ids as sent: count, types, empty lists
        s = self.settings
        return rules.check_decoded(decode(inputs, max_chars=s.max_input_chars),
                                   max_chars=s.max_input_chars, max_total=s.max_body_bytes)

    def _estimate_sequences(self, inputs: Sequence[Sequenced]) -> int:
        """``estimate`` for texts and pairs, from their lengths (no pair is joined)."""
        most = self.encoder.info.max_input_tokens
        special = self.encoder.special_tokens + 1  # a pair's template adds one more
        return sum(min(most, (len(item) if isinstance(item, str) else len(item[0]) + len(item[1]))
                       // _CHARS_PER_TOKEN + 1 + special) for item in inputs)

    def _sequences(self, scorer: Scorer, inputs: Sequence[Sequenced],
                   truncate: bool, direction: str, deadline: float, disconnected: Disconnected
                   ) -> list[list[int]]:
        """Ids of each text or pair, within the deadline while the client is there; refused
        past the model's limit when not truncating."""
        pairs: list[Pair] = []
        for chunk in self._chunks(inputs, deadline, disconnected):
            pairs.extend(scorer.tokenize_sequences(chunk, direction if truncate else None))
        if not truncate:
            limit = scorer.info.max_input_tokens
            for i, ids in enumerate(pairs):
                rules.fit(i, ids, limit, special=0, truncate=False, direction=direction,
                          exact=not ids.cut)
        out: list[list[int]] = list(pairs)
        return out

    def _sparse(self) -> Sparse:
        if not isinstance(self.encoder, Sparse):
            raise self._not_serving("gives no sparse vectors; use /embed")
        return self.encoder

    def _scorer(self) -> Scorer:
        if not isinstance(self.encoder, Scorer):
            raise self._not_serving("scores no texts or pairs")
        return self.encoder

    def _not_serving(self, what: str) -> InvalidRequest:
        """A 400 that says what this model is."""
        return InvalidRequest(f"this server's {self.info.kind} model {what}",
                              code="not_supported")

    def _optional(self, method: str, what: str) -> Callable[..., Any]:
        """One of the encoder's optional methods; else a 400 that says what is missing."""
        found = getattr(self.encoder, method, None)
        if found is None:
            raise InvalidRequest(f"this model's backend {what}", code="not_supported")
        return found

    def _unwrap(self, ids: list[int]) -> list[int]:
        """Ids that already carry the model's special tokens (as /tokenize gives them) lose
        them here, so that they are not added twice."""
        head, tail = len(self._prefix), len(self._suffix)
        if (head or tail) and len(ids) >= head + tail and ids[:head] == self._prefix \
                and ids[len(ids) - tail:] == self._suffix:
            return ids[head:len(ids) - tail]
        return ids


def _slices(ids: list[list[int]], max_items: int, max_tokens: int) -> list[list[list[int]]]:
    """``ids`` cut, in order, into runs of at most ``max_items`` and ``max_tokens`` padded
    tokens (a longer input runs alone)."""
    out: list[list[list[int]]] = []
    run: list[list[int]] = []
    longest = 0
    for seq in ids:
        wider = max(longest, len(seq))
        if run and (len(run) >= max_items or wider * (len(run) + 1) > max_tokens):
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
