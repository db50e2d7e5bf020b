"""The serving core of one process: the encoder, the batcher, and what turns inputs into vectors.

>>> from embedsvc.encoder import FakeEncoder
>>> from embedsvc.settings import Settings
>>> engine = Engine(Settings(), encoder=FakeEncoder(dimension=4))
>>> engine.start(background=False)
>>> engine.embed(["hello world"]).vectors.shape
(1, 4)
>>> engine.drain(timeout=1.0).failed
0
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from . import __version__, backend, heap
from .batcher import Batcher, BatchLimits, ShutdownReport
from .encoder import Encoder, ModelInfo, SentenceTransformerEncoder
from .errors import InvalidRequest, Unavailable
from .metrics import Metrics
from .settings import Settings

log = logging.getLogger(__name__)

Inputs = Sequence[str] | Sequence[Sequence[int]]
_REAP_S = 0.1  # how often the watchdog fails queued requests past their deadline or orphaned
_WATCH_S = 0.5  # how often it checks the batcher thread
_TRIM_AFTER_BATCH_S = 0.5  # the batcher hands freed heap memory back at most this often
_TRIM_IDLE_S = 5.0  # and the watchdog when no batch did for this long (see heap.py)


@dataclass(slots=True)
class Embedded:
    """The rows for one request, in input order, and where its time went."""

    vectors: np.ndarray
    tokens: int
    tokenize_s: float
    queue_s: float
    inference_s: float
    total_s: float


def load_encoder(
    settings: Settings, preloaded: SentenceTransformerEncoder | None = None
) -> Encoder:
    """Load (unless a pre-fork master already did) and place the model in this process."""
    return backend.load_encoder(settings, preloaded)


class Engine:
    """One encoder and its batcher, with a state that ``/health`` reports.

    States: ``loading`` -> ``ready`` -> ``draining``; ``unhealthy`` when loading failed or the
    batcher thread is not running.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        encoder: Encoder | None = None,
        loader: Callable[[], Encoder] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.pid = os.getpid()
        self.encoder: Encoder | None = None
        self.batcher: Batcher | None = None
        self.failure: str | None = None
        self._given = encoder
        self._loader = loader or (lambda: load_encoder(settings))
        self.on_ready: list[Callable[[ModelInfo], object]] = []  # called once the model is warm
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._last_trim = time.monotonic()
        self._draining = False
        self._started = False
        self._start_lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, background: bool = True) -> None:
        """Load the model and start the batcher, once; ``background`` returns at once."""
        with self._start_lock:
            if self._started:
                return
            self._started = True
        if background:
            threading.Thread(target=self._load, name="embedsvc-loader", daemon=True).start()
        else:
            self._load()
            if self.failure:
                raise RuntimeError(self.failure)

    def _load(self) -> None:
        started = time.monotonic()
        try:
            encoder = self._given or self._loader()
        except Exception as exc:
            log.exception("the model failed to load")
            self.failure = f"the model failed to load: {exc}"
            return
        s = self.settings
        limits = BatchLimits(
            s.max_batch_size, s.max_batch_tokens, s.max_wait_ms / 1000, s.max_queue
        )
        self.batcher = Batcher(partial(self._encode, encoder.encode), limits,
                               metrics=self.metrics)
        self.batcher.start()
        threading.Thread(target=self._watch, name="embedsvc-watchdog", daemon=True).start()
        self.encoder = encoder
        self._announce(encoder, time.monotonic() - started)
        self._ready.set()
        for callback in self.on_ready:
            callback(encoder.info)

    def _announce(self, encoder: Encoder, seconds: float) -> None:
        info = encoder.info
        self.metrics.model_load.set(seconds)
        self.metrics.admission_limit.set(self.settings.max_queue)
        self.metrics.model_info.info({
            "model": info.name, "device": info.device, "dtype": info.dtype,
            "version": __version__, "dimension": str(info.dimension),
        })
        if info.device.startswith("cuda"):
            self.metrics.watch_device_memory(_cuda_memory)
        log.info(
            "model ready: pid=%d device=%s dtype=%s model=%s dimension=%d parameters=%d "
            "size=%.1fMiB load=%.1fs",
            self.pid, info.device, info.dtype, info.name, info.dimension, info.parameters,
            info.size_bytes / 2**20, seconds,
        )

    def _watch(self) -> None:
        """Expire queued requests; restart the batcher thread if it dies (/health says
        unhealthy meanwhile); trim the heap."""
        last_watch = time.monotonic()
        while not self._stop.wait(_REAP_S):
            try:
                if self.batcher is not None:
                    self.batcher.reap()
                now = time.monotonic()
                if now - last_watch >= _WATCH_S:
                    last_watch = now
                    if self.batcher is not None and not self.batcher.alive:
                        self.batcher.restart()
                self._trim(_TRIM_IDLE_S)
            except Exception:  # noqa: BLE001 - requests rely on this thread for their deadlines
                log.exception("watchdog tick failed; continuing")

    def _encode(self, encode: Callable[[list[list[int]]], np.ndarray],
                batch: list[list[int]]) -> np.ndarray:
        rows = encode(batch)
        # The activations just freed would otherwise stay resident: varying batch shapes
        # fragment the heap, and a bulk run's memory grew with its length (bench/RESULTS.md).
        self._trim(_TRIM_AFTER_BATCH_S)
        return rows

    def _trim(self, gap_s: float) -> None:
        now = time.monotonic()
        if now - self._last_trim >= gap_s:
            self._last_trim = now
            heap.trim()  # a few milliseconds after a large batch

    def drain(self, timeout: float) -> ShutdownReport:
        """Refuse new work, finish what was admitted within ``timeout``."""
        self._draining = True
        self._stop.set()
        if self.batcher is None:
            return ShutdownReport(0, 0, True)
        return self.batcher.shutdown(timeout)

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Wait until the model is loaded and warm; False if it failed or time ran out."""
        self._ready.wait(timeout)
        return self.state == "ready"

    @property
    def state(self) -> str:
        if self._draining:
            return "draining"
        if self.failure or (self._ready.is_set() and not (self.batcher and self.batcher.alive)):
            return "unhealthy"
        return "ready" if self._ready.is_set() else "loading"

    def deadline(self) -> float:
        """The deadline of a request arriving now (REQUEST_TIMEOUT_S)."""
        return time.monotonic() + self.settings.request_timeout_s

    def wait_ready(self, deadline: float) -> Encoder:
        """The encoder, once loaded; 503 if it is not by ``deadline`` or cannot be."""
        if not self._ready.is_set():
            self._ready.wait(max(0.0, deadline - time.monotonic()))
        state = self.state
        if state != "ready" or self.encoder is None:
            message = {
                "loading": "the model is still loading; retry in a few seconds",
                "draining": "the server is shutting down; retry on another replica",
            }.get(state, self.failure or "the service is unhealthy; see its log")
            raise Unavailable(message, code=state, headers={"Retry-After": "1"})
        return self.encoder

    # -- requests -----------------------------------------------------------------------------

    def embed(
        self,
        inputs: Inputs,
        *,
        normalize: bool = True,
        dimensions: int | None = None,
        truncate: bool | None = None,
        direction: str = "right",
        deadline: float | None = None,
        disconnected: Callable[[], bool] | None = None,
    ) -> Embedded:
        """Embed ``inputs`` (strings, or token-id lists without special tokens).

        ``disconnected`` (waitress's ``waitress.client_disconnected``) lets queued inputs of a
        client that went away be dropped before they reach the model.
        """
        arrived = time.monotonic()
        deadline = deadline or arrived + self.settings.request_timeout_s
        encoder = self.wait_ready(deadline)
        if dimensions is not None and not 1 <= dimensions <= encoder.info.dimension:
            raise InvalidRequest(
                f"'dimensions' must be between 1 and {encoder.info.dimension} for this model, "
                f"not {dimensions}",
                param="dimensions", code="invalid_dimensions",
            )
        tokenize_started = time.monotonic()
        ids = self.prepare(inputs, truncate=truncate, direction=direction)
        tokenize_s = time.monotonic() - tokenize_started
        self.metrics.tokenization.observe(tokenize_s)
        assert self.batcher is not None
        job = self.batcher.submit(ids, deadline, disconnected)
        rows = job.result()  # no timeout: the watchdog fails it at its deadline while queued
        if dimensions is not None:
            rows = rows[:, :dimensions]
        if normalize:
            rows = _l2_normalize(rows)
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
        encoder = self.encoder
        assert encoder is not None
        if inputs and isinstance(inputs[0], str):
            self.check_chars(inputs)  # type: ignore[arg-type]
            content = encoder.tokenize(inputs)  # type: ignore[arg-type]
        else:
            content = [self._check_ids(i, ids, encoder) for i, ids in enumerate(inputs)]
        limit = encoder.info.max_input_tokens - encoder.special_tokens
        truncate = self.settings.auto_truncate if truncate is None else truncate
        out = []
        for i, ids in enumerate(content):
            if len(ids) > limit:
                if not truncate:
                    raise InvalidRequest(
                        f"input {i} has {len(ids) + encoder.special_tokens} tokens, more than "
                        f"this model's limit of {encoder.info.max_input_tokens}; shorten it or "
                        "ask for truncation",
                        param="input", code="input_too_long",
                    )
                ids = ids[:limit] if direction == "right" else ids[len(ids) - limit:]
            out.append(encoder.wrap(ids))
        return out

    def check_chars(self, texts: Sequence[str]) -> None:
        limit = self.settings.max_input_chars
        for i, text in enumerate(texts):
            if len(text) > limit:
                raise InvalidRequest(
                    f"input {i} has {len(text)} characters, more than MAX_INPUT_CHARS "
                    f"({limit}); split it",
                    param="input", code="input_too_long",
                )

    @staticmethod
    def _check_ids(i: int, ids: Sequence[int], encoder: Encoder) -> list[int]:
        vocab = encoder.info.vocab_size
        for token in ids:
            if not 0 <= token < vocab:
                raise InvalidRequest(
                    f"input {i} holds token id {token}, outside this model's vocabulary "
                    f"(0 to {vocab - 1}); send text, or ids from this model's tokenizer",
                    param="input", code="invalid_token_id",
                )
        return list(ids)

    def info(self) -> dict[str, Any]:
        s = self.settings
        model = self.encoder.info if self.encoder else None
        return {
            "model_id": model.name if model else None,
            "dimension": model.dimension if model else None,
            "max_input_length": model.max_input_tokens if model else None,
            "device": model.device if model else None,
            "dtype": model.dtype if model else None,
            "parameters": model.parameters if model else None,
            "max_batch_tokens": s.max_batch_tokens,
            "max_batch_size": s.max_batch_size,
            "max_wait_ms": s.max_wait_ms,
            "max_queue": s.max_queue,
            "max_client_batch_size": s.max_inputs_per_request,
            "auto_truncate": s.auto_truncate,
            "version": __version__,
            "pid": self.pid,
            "state": self.state,
        }


def _l2_normalize(rows: np.ndarray) -> np.ndarray:
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows))[:, None]
    return rows / np.maximum(norms, 1e-12)


def _cuda_memory() -> tuple[int, int]:
    import torch

    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
