"""The HTTP side's handle on the engine: a request's inputs checked, tokenized and sent to the
model. "Engine" names the model side only (the engine process, its loop, the batcher); this is
its client.

An ``EngineClient`` takes one ``Work`` (work.py) from a handler, applies the input rules
(rules.py), turns token ids of another tokenizer into text, is admitted, tokenizes in the
calling thread (long texts cut to the model's window first), hands the ids to the model side
through its ``Port`` and shapes the rows it gets back (dimensions, normalisation). The port is
the model in this process (runner.py's ``LocalPort``) or the engine process
(remote/client.py's ``RemotePort``): the client never touches the model itself, only its
tokenizer (``TextModel``), so an HTTP process in front of the engine process holds no model
and no device.

>>> from embedsvc.batching.batcher import Batcher, BatchLimits
>>> from embedsvc.model.fake import FakeEncoder
>>> from embedsvc.runner import LocalPort, Runner
>>> from embedsvc.settings import Settings
>>> encoder = FakeEncoder(dimension=4)
>>> runner = Runner(Settings(), encoder, Batcher(encoder.encode,
...                                                BatchLimits.from_settings(Settings())))
>>> runner.batcher.start()
>>> client = EngineClient(Settings(), encoder, LocalPort(runner))
>>> client.run(Work(EMBED, ["hello world"])).vectors.shape
(1, 4)
>>> client.shutdown(timeout=1.0).failed
0
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from . import rules
from .admission import Admission, Ticket, still_wanted
from .errors import InvalidRequest, Unavailable
from .metrics import Metrics
from .rules import Inputs
from .settings import Settings
from .work import (
    EMBED,
    SCORE,
    SPARSE,
    TOKENS,
    Disconnected,
    Embedded,
    ImageRef,
    ModelInfo,
    Pair,
    Piece,
    Pixels,
    Sequenced,
    SparseRow,
    Work,
)
from .work_kinds import kind_of

if TYPE_CHECKING:
    from .model.quantize import Calibration

_CHARS_PER_TOKEN = 4  # for the admission estimate only; settled to the exact count after
_TOKENIZE_CHUNK = 256  # inputs tokenized between two looks at the deadline and the client
# the most tokens of a text counted to say its length in a refusal (a body of megabytes is
# not tokenized whole to say how far past the limit it is)
_COUNT_MOST = 1 << 16
_CALIBRATION_BATCH = 64  # calibration texts per request through the model
T = TypeVar("T")


class TextModel(Protocol):
    """What the front side needs of a model: its description and its tokenizer (the
    ``Encoder`` interface without ``encode``; scorers add ``tokenize_sequences``)."""

    info: ModelInfo

    @property
    def special_tokens(self) -> int: ...

    def tokenize(self, texts: Sequence[str], limit: int | None = None,
                 direction: str = "right") -> list[list[int]]: ...

    def wrap(self, ids: Sequence[int]) -> list[int]: ...

    def pieces(self, texts: Sequence[str]) -> list[list[Piece]]: ...


class Answer(Protocol):
    def result(self) -> Embedded: ...


class Port(Protocol):
    """The model side as the front side sees it: this process's runner, or the engine
    process. ``admit`` reserves room before tokenizing (413, 429, 503, 504); ``submit``
    hands over the ids under that reservation; ``cancel`` frees one never submitted."""

    @property
    def state(self) -> str:
        """``ready``, ``unhealthy`` (the batcher is not running), ``loading`` (the engine
        process is starting) or ``draining``."""

    @property
    def queue_limit(self) -> int: ...

    def admit(self, work: Work, tokens: int) -> Any: ...

    def cancel(self, ticket: Any) -> None: ...

    def submit(self, work: Work, ticket: Any) -> Answer: ...

    def shutdown(self, timeout: float) -> Any: ...


class EngineClient:
    """The front side of one model: ``run(work)`` for every kind of work.

    ``pieces`` and ``decode`` (/tokenize, /decode) never reach the model: they are admitted
    on this side's own budget (``host``: MAX_QUEUE inputs, MAX_QUEUE_TOKENS tokens or ids),
    which the device's rate does not govern, so that they neither get 429 from it nor hold
    back the requests that do reach it.
    """

    def __init__(self, settings: Settings, text: TextModel, port: Port,
                 metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.text = text
        self.port = port
        self.metrics = metrics or Metrics()
        s = settings
        self.host = Admission(max_inputs=s.max_queue,
                              max_tokens=s.max_queue_tokens, timeout_s=s.request_timeout_s,
                              floor_inputs=s.max_inputs_per_request, metrics=self.metrics)
        marked = text.wrap([-1])  # where the model's template puts the text
        at = marked.index(-1)
        self._prefix, self._suffix = list(marked[:at]), list(marked[at + 1:])
        self._calibration: Calibration | None = None
        self._image: tuple[Any, Any] | None = None  # the image policy and preprocessor
        self._calibrating = threading.Lock()

    @property
    def info(self) -> ModelInfo:
        return self.text.info

    def shutdown(self, timeout: float) -> Any:
        """Refuse new work (503), finish what was admitted within ``timeout``."""
        self.host.close()
        return self.port.shutdown(timeout)

    # -- the one entry ------------------------------------------------------------------------

    def run(self, work: Work) -> Embedded:
        """The answer to ``work``: checked, admitted, tokenized, computed, shaped."""
        arrived = time.monotonic()
        if work.deadline is None:
            work.deadline = arrived + self.settings.request_timeout_s
        kind = kind_of(work)
        estimate, tokenize = kind.prepare(self, work)
        out = kind.shape(self, work, self._through(work, estimate, tokenize))
        out.total_s = time.monotonic() - arrived
        return out

    # -- what handlers and the bulk command call ----------------------------------------------

    def embed(self, inputs: Inputs, **options: Any) -> Embedded:
        """Vectors of ``inputs`` (strings, or token-id lists without special tokens);
        ``options`` are ``Work``'s."""
        return self.run(Work(EMBED, inputs, **options))

    def embed_sparse(self, texts: Sequence[str], **options: Any
                     ) -> tuple[Embedded, list[SparseRow]]:
        """The active (index, value) pairs of each text, as ``SparseEncoder.encode`` gives
        them; ``options`` are ``Work``'s (truncation, deadline, disconnected)."""
        out = self.run(Work(SPARSE, list(texts), normalize=False, **options))
        assert out.sparse is not None
        return out, out.sparse

    def similarity(self, source: str, sentences: Sequence[str], **options: Any
                   ) -> tuple[Embedded, np.ndarray]:
        """Cosine similarity of ``source`` with each of ``sentences`` (TEI's /similarity)."""
        rules.check_listed(sentences, "inputs.sentences")
        out = self.run(Work(EMBED, [source, *sentences], normalize=True, **options))
        return out, out.vectors[1:] @ out.vectors[0]

    def rerank(self, query: str, texts: Sequence[str], *, param: str = "texts",
               **options: Any) -> Embedded:
        """Scores of each of ``texts`` against ``query`` (``param`` names the list in
        errors); ``options`` are ``Work``'s."""
        return self.run(Work(SCORE, list(texts), query=query, param=param, **options))

    def score(self, inputs: Sequence[Sequenced], **options: Any) -> Embedded:
        """Scores of texts and (text, text) pairs; ``raw``: logits, else the model's
        activation. Over-long inputs are cut ``longest_first`` from ``direction``, or
        refused with a 400 when ``truncate`` is false (None: AUTO_TRUNCATE)."""
        return self.run(Work(SCORE, inputs, **options))

    def embed_all(self, inputs: Inputs, **options: Any) -> tuple[list[np.ndarray], int]:
        """Per-token vectors of each input (POST /embed_all) and the tokens computed."""
        out = self.run(Work(TOKENS, inputs, **options))
        assert out.token_vectors is not None
        return out.token_vectors, out.tokens

    def calibration(self) -> Calibration:
        """The model's int8/uint8 calibration (model/quantize.py): computed through the
        model, or read from the cache, once, by the first caller that asks (the server's
        first int8 request, a bulk job's start), so that startup never pays for it."""
        from .model import quantize
        from .model.graph_cache import cache_root

        with self._calibrating:  # concurrent first callers compute it once
            if self._calibration is None:
                batch = max(1, min(_CALIBRATION_BATCH, self.settings.max_inputs_per_request))
                self._calibration = quantize.calibrate(
                    cache_root(self.settings.cache_dir), self.info, self._raw_rows, batch=batch)
        return self._calibration

    def codes(self, rows: np.ndarray, dtype: str, *, normalize: bool = True,
              dimensions: int | None = None) -> np.ndarray:
        """``rows`` (shaped by ``normalize`` and ``dimensions``) as ``dtype``: float32, int8
        or uint8 codes of the model's calibration, or packed bits (model/quantize.py).

        Floats, what most requests ask for, are the rows as they are; only another dtype
        imports model/quantize.py, in an HTTP process too (its calibration runs through the
        model, and the codes' arithmetic is kept beside it)."""
        if dtype == "float":
            return np.asarray(rows, np.float32)
        from .model import quantize

        scale = None
        if dtype in (quantize.INT8, quantize.UINT8):
            scale = self.calibration().scale(normalize=normalize, dimensions=dimensions)
        return quantize.quantize(rows, dtype, scale)

    def _raw_rows(self, texts: list[str]) -> np.ndarray:
        """Unnormalised rows, each call one admitted request through the model."""
        return self.run(Work(EMBED, texts, normalize=False, truncate=True)).vectors

    # -- how every kind reaches the model ----------------------------------------------------

    def _through(self, work: Work, estimate: int, tokenize: Callable[[], list[list[int]]]
                 ) -> Embedded:
        """Admit -> tokenize -> submit -> wait: how every kind's work reaches the model."""
        asked = time.monotonic()
        ticket = self.port.admit(work, estimate)
        try:
            tokenizing = time.monotonic()  # the wait for admission counts as queue time
            work.ids = tokenize()
            tokenize_s = time.monotonic() - tokenizing
            self.metrics.tokenization.observe(tokenize_s)
            answer = self.port.submit(work, ticket)
        finally:
            self.port.cancel(ticket)  # a no-op once the model side took it over
        out = answer.result()
        out.tokens = sum(map(len, work.ids))
        out.tokenize_s = tokenize_s
        out.admit_s = tokenizing - asked
        out.queue_s += out.admit_s
        return out

    # -- what does not reach the model --------------------------------------------------------

    def pieces(self, texts: Sequence[str], *, special: bool = True,
               deadline: float | None = None, disconnected: Disconnected = None
               ) -> list[list[Piece]]:
        """The tokens the model sees for each text (POST /tokenize), admitted on the host's
        budget: they never reach the device, so its rate does not refuse them. ``special``:
        with the special tokens the model's template puts around the text (TEI's
        ``add_special_tokens``)."""
        deadline = deadline or time.monotonic() + self.settings.request_timeout_s
        self.check(texts)
        with self._admitted(len(texts), self.estimate(texts), deadline, disconnected):
            out: list[list[Piece]] = []
            for chunk in self._chunks(texts, deadline, disconnected):
                out.extend(self.text.pieces(chunk))
        if special:
            return out
        head, tail = len(self._prefix), len(self._suffix)  # the template's, around each text
        return [row[head:len(row) - tail] for row in out]

    def decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True, *,
               deadline: float | None = None, disconnected: Disconnected = None) -> list[str]:
        """Token ids of the served model back to text (POST /decode), admitted on the host's
        budget, counting the ids."""
        decode = getattr(self.text, "decode", None)
        if decode is None:
            raise InvalidRequest("this model's backend cannot decode token ids",
                                 code="not_supported")
        deadline = deadline or time.monotonic() + self.settings.request_timeout_s
        rules.check_count(len(batch), self.settings.max_inputs_per_request, param="ids")
        vocab = self.info.vocab_size
        total = sum(map(len, batch))
        rules.check_decode_ids(total, self.host.max_tokens)
        checked = [rules.check_token_ids(i, ids, vocab) for i, ids in enumerate(batch)]
        with self._admitted(len(checked), total, deadline, disconnected):
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
        most = self.text.info.max_input_tokens
        special = self.text.special_tokens
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
        text = self.text
        special = text.special_tokens
        room = self.text.info.max_input_tokens - special
        truncate = self.settings.auto_truncate if truncate is None else truncate
        if isinstance(inputs[0], str):
            # Not truncating: one token past the room is enough to know an input is too long.
            limit = room if truncate else room + 1
            content: list[list[int]] = []
            for chunk in self._chunks(inputs, deadline, disconnected):
                content.extend(text.tokenize(chunk, limit, direction))  # type: ignore[arg-type]
            exact = False
        else:
            vocab = self.info.vocab_size
            content = [self._unwrap(rules.check_token_ids(i, ids, vocab))
                       for i, ids in enumerate(inputs)]
            exact = True
        if max(map(len, content), default=0) <= room:  # nothing to cut or refuse
            return list(map(text.wrap, content))
        if not truncate and not exact:  # a text refused: its length counted, up to a bound
            i = next(i for i, ids in enumerate(content) if len(ids) > room)
            counted = len(text.tokenize([inputs[i]], _COUNT_MOST, direction)[0])  # type: ignore[list-item]
            raise rules.too_many_tokens(i, counted + special, room + special,
                                        at_least=counted >= _COUNT_MOST)
        return [text.wrap(rules.fit(i, ids, room, special=special, truncate=truncate,
                                    direction=direction, exact=exact))
                for i, ids in enumerate(content)]

    # -- helpers ------------------------------------------------------------------------------

    @contextmanager
    def _admitted(self, inputs: int, tokens: int, deadline: float, disconnected: Disconnected
                  ) -> Iterator[Ticket]:
        """A reservation of the host's budget held while the block runs."""
        ticket = self.host.admit(inputs, tokens, deadline, disconnected)
        try:
            yield ticket
        finally:
            self.host.cancel(ticket)

    def _chunks(self, items: Sequence[T], deadline: float | None, disconnected: Disconnected
                ) -> Iterator[Sequence[T]]:
        """``items`` in runs, each only while the request is still wanted."""
        for start in range(0, len(items), _TOKENIZE_CHUNK):
            still_wanted(self.metrics, len(items) - start, deadline, disconnected)
            yield items[start:start + _TOKENIZE_CHUNK]

    def images(self, refs: Sequence[ImageRef], *, deadline: float | None = None,
               disconnected: Disconnected = None) -> list[Pixels]:
        """Each image decoded (image/decode.py: the settings' policy, a 400 for anything
        refused) and preprocessed as the model's ``preprocessor_config.json`` says, while
        the request is still wanted."""
        if not refs:
            return []
        from .image.decode import decode_bytes, decoding, refusals_named, source_bytes

        policy, preprocess = self._image_side()
        cost = self.info.image_tokens
        out = []
        for i, ref in enumerate(refs):
            wanted = partial(still_wanted, self.metrics, len(refs) - i, deadline, disconnected)
            wanted()
            with refusals_named(ref.param, ref.where):
                data = source_bytes(ref.source, policy)  # a URL fetched outside a slot
                with decoding(wanted):  # one at a time per CPU in this process: bounded memory
                    started = time.monotonic()
                    pixels = preprocess.one(decode_bytes(data, policy))
            out.append(Pixels(pixels, cost))
            self.metrics.image_preprocess.observe(time.monotonic() - started)
        return out

    def _image_side(self) -> tuple[Any, Any]:
        """The image policy of the settings and the model's preprocessor, built once."""
        if self._image is None:
            from .image import require_pillow
            from .image.decode import ImagePolicy
            from .image.preprocess import Preprocessor

            try:
                require_pillow()
            except ImportError as exc:  # the one line that names the extra
                raise Unavailable(str(exc), code="image_extra_missing") from None

            s = self.settings
            hosts = tuple(h.strip().lower() for h in s.image_url_hosts.split(",") if h.strip())
            policy = ImagePolicy(max_bytes=s.max_image_bytes, max_pixels=s.max_image_pixels,
                                 url_hosts=hosts)
            assert self.info.image is not None
            self._image = policy, Preprocessor.from_config(self.info.image)
        return self._image

    def decoded(self, work: Work) -> Inputs:
        """Texts of token-id inputs meant for another tokenizer, checked as they come."""
        inputs = work.inputs
        if work.decode is None or not inputs or isinstance(inputs[0], str):
            return inputs
        self.check(inputs)  # the ids as sent: count, types, empty lists
        s = self.settings
        return rules.check_decoded(work.decode(inputs, max_chars=s.max_input_chars),
                                   max_chars=s.max_input_chars, max_total=s.max_body_bytes)

    def estimate_sequences(self, inputs: Sequence[Sequenced]) -> int:
        """``estimate`` for texts and pairs, from their lengths (no pair is joined)."""
        most = self.info.max_input_tokens
        special = self.text.special_tokens + 1  # a pair's template adds one more
        return sum(min(most, (len(item) if isinstance(item, str) else len(item[0]) + len(item[1]))
                       // _CHARS_PER_TOKEN + 1 + special) for item in inputs)

    def sequences(self, work: Work, truncate: bool) -> list[list[int]]:
        """Ids of each text or pair, within the deadline while the client is there; refused
        past the model's limit when not truncating."""
        tokenize = getattr(self.text, "tokenize_sequences", None)
        if tokenize is None:
            raise InvalidRequest(f"this server's {self.info.kind} model scores no texts or "
                                 "pairs", code="not_supported")
        pairs: list[Pair] = []
        for chunk in self._chunks(work.inputs, work.deadline, work.disconnected):
            pairs.extend(tokenize(chunk, work.direction if truncate else None))
        if not truncate:
            limit = self.info.max_input_tokens
            for i, ids in enumerate(pairs):
                rules.fit(i, ids, limit, special=0, truncate=False, direction=work.direction,
                          exact=not ids.cut)
        out: list[list[int]] = list(pairs)
        return out

    def _unwrap(self, ids: list[int]) -> list[int]:
        """Ids that already carry the model's special tokens (as /tokenize gives them) lose
        them here, so that they are not added twice."""
        head, tail = len(self._prefix), len(self._suffix)
        if (head or tail) and len(ids) >= head + tail and ids[:head] == self._prefix \
                and ids[len(ids) - tail:] == self._suffix:
            return ids[head:len(ids) - tail]
        return ids
