"""The life of one process's model: load, watch, drain; and the state ``/health`` reports.

>>> from embedsvc.model.fake import FakeEncoder
>>> service = Service(Settings(), encoder=FakeEncoder(dimension=4))
>>> service.start(background=False)
>>> service.ready().embed(["hello world"]).vectors.shape
(1, 4)
>>> service.drain(timeout=1.0).failed
0
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import generate_latest

from . import __version__
from .engine_client import EngineClient
from .errors import NotFound, Unavailable, shutting_down
from .metrics import Family, Metrics, Sample, exposition, families
from .settings import Settings
from .tenants import Keyring, Quotas
from .work import ModelInfo, ShutdownReport
from .work_kinds import l2_normalize

# The model side (batching/, runner, model/) is imported where this process loads a model:
# an HTTP process in front of the engine process never does (tests/unit/test_layers.py).
if TYPE_CHECKING:
    from .batching.batcher import Batcher, BatchLimits
    from .model.encoder import Encoder
    from .model.st_encoder import SentenceTransformerEncoder
    from .remote.client import Link
    from .runner import LocalPort, Runner

log = logging.getLogger(__name__)

_SWEEP_S = 0.1  # how often queued requests past their deadline or orphaned are cancelled
_WATCH_S = 0.5  # how often the batcher thread is checked
_LOADING = "the model is still loading; retry in a few seconds"
# How long a front's first look at the service waits to meet an engine that is serving (its
# card, the tokenizer built from it: 1.7 s once on a busy machine)
_SETTLE_S = 5.0
# The HTTP side's metric families, which no model owns (Service.exposition)
_HTTP_FAMILIES = ("embedsvc_requests", "embedsvc_request_duration", "embedsvc_tenant_",
                  "embedsvc_connections_closed", "embedsvc_open_connections", "process_",
                  "embedsvc_rejections")  # refusals, most of them before a model is chosen


def load_encoder(
    settings: Settings, preloaded: SentenceTransformerEncoder | None = None
) -> Encoder:
    """Load (unless a pre-fork master already did) and place the model in this process."""
    from .model import backend

    return backend.load_encoder(settings, preloaded)


class Service:
    """Loads the model, then runs its batcher and a watchdog until drained.

    States: ``loading`` -> ``ready`` -> ``draining``; ``unhealthy`` when loading failed or the
    batcher thread is not running. ``ready()`` hands out the ``EngineClient`` once there is one.

    With ``engine_address`` the model is in the engine process at that socket
    (remote/server.py): this process loads nothing, builds its engine client from the engine's
    card (its tokenizer, the model's description) and says ``loading`` while that process
    starts, or restarts after it was lost.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        encoder: Encoder | None = None,
        loader: Callable[[], Encoder] | None = None,
        metrics: Metrics | None = None,
        engine_address: str | None = None,
        keeper: Callable[[], str | None] | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.pid = os.getpid()
        self.failure: str | None = None
        self.on_ready: list[Callable[[ModelInfo], object]] = []  # called once the model is warm
        self._client: EngineClient | None = None
        self._runner: Runner | None = None
        self._given = encoder
        self._loader = loader or (lambda: load_encoder(settings))
        self.keyring = Keyring(settings.keys_file, settings.api_key)  # who may ask, and how much
        self.quotas = Quotas(self.keyring)
        self.engine_address = engine_address
        self._keeper = keeper  # starts the engine process when there is none (gunicorn)
        self._link: Link | None = None
        self._loaded = threading.Event()
        self._stop = threading.Event()
        self._draining = False
        self._started = False
        self._start_lock = threading.Lock()
        # Several models (catalog.py): this service is the first's, and holds every model's
        # by name and alias; the others share its keyring and quotas. Empty: one model.
        self.name = ""
        self.others: list[Service] = []
        self._named: dict[str, Service] = {}

    def start(self, background: bool = True) -> None:
        """Load the model and start the batcher, once; ``background`` returns at once."""
        with self._start_lock:
            if self._started:
                return
            self._started = True
        self.keyring.watch(self._stop)
        for other in self.others:
            other.start(background)
        if self.others:
            threading.Thread(target=self._announce_models, name="embedsvc-models",
                             daemon=True).start()
        if background:
            threading.Thread(target=self._load, name="embedsvc-loader", daemon=True).start()
        else:
            self._load(background=False)
            if self.failure:
                raise RuntimeError(self.failure)

    @property
    def state(self) -> str:
        if self._draining:
            return "draining"
        client = self._client
        if self.failure:
            return "unhealthy"
        if client is None:  # no card yet: the link says whether an engine is coming
            return self._link.state if self._link is not None else "loading"
        return client.port.state

    def settle(self, timeout: float = _SETTLE_S) -> None:
        """A front that has not met the engine yet (a gunicorn worker's first request
        starts it) waits up to ``timeout`` for it when the engine's socket is there (it
        serves), so that /health, /info and /metrics answer the service's state from any
        process, not that this one has just started."""
        for other in self.others:
            other.settle(timeout)
        address = self.engine_address
        if address is None or self._loaded.is_set() \
                or not os.path.exists(address.removeprefix("ipc://")):
            return
        self._loaded.wait(timeout)

    @property
    def engine_pid(self) -> int | None:
        """The pid of the process that holds the model (this one, or the engine process)."""
        if self._link is not None:
            return self._link.engine_pid
        return self.pid if self._client is not None else None

    @property
    def front_pids(self) -> list[int]:
        """The HTTP processes in front of the model: this one, or all the engine's."""
        if self._link is not None:
            return self._link.fronts or [self.pid]
        return [self.pid]

    def exposition(self) -> bytes:
        """/metrics: this process's metrics; with an engine process, the whole service's
        (the engine's, every front's) merged, each counted once. With several models, each
        model's families carry its name as the label ``model``; the HTTP side's (requests,
        tenants, connections, the fronts' ``process_*``) are the first model's service's,
        unlabelled; each engine process's ``process_*`` carry its model's name beside its pid."""
        if not self.others:
            if self._link is None or self._link.state == "loading":
                return generate_latest(self.metrics.registry)
            return exposition(self._families())
        merged: dict[str, Family] = {}
        for service in self.models:
            for name, kind, doc, samples in service._answered_families():
                if name.startswith("process_"):
                    samples = service._own_process(samples, fronts=service is self)
                elif name.startswith(_HTTP_FAMILIES):
                    if service is not self:
                        continue
                else:
                    samples = [(n, {**labels, "model": service.name}, v)
                               for n, labels, v in samples]
                merged.setdefault(name, (name, kind, doc, []))[3].extend(samples)
        return exposition(list(merged.values()))

    def _own_process(self, samples: list[Sample], fronts: bool) -> list[Sample]:
        """Of a ``process_*`` family as this model's service reads it: its engine process's
        samples, labelled with the model, and with ``fronts`` the others' too (every model's
        service reads the same fronts; in one process, each reads this process)."""
        if self._link is None:
            return samples if fronts else []
        engine = str(self.engine_pid)
        return [(n, {**labels, "model": self.name}, v) if labels.get("pid") == engine
                else (n, labels, v) for n, labels, v in samples
                if fronts or labels.get("pid") == engine]

    def _answered_families(self) -> list[Family]:
        """``_families``, or this process's where the engine does not answer (hung, or gone
        and not yet seen to be): one model's engine leaves the others' metrics served, its
        own ``embedsvc_batcher_alive`` 0."""
        try:
            return self._families()
        except Unavailable:
            return families(self.metrics.registry)

    def _families(self) -> list[Family]:
        """This model's metrics as families: this process's, or the engine's merged."""
        if self._link is None or self._link.state == "loading":
            return families(self.metrics.registry)
        from .remote.wire import Exposition, Scrape

        merged = self._link.ask(Scrape(self.pid, *self.metrics.snapshot(self.pid)),
                                Exposition, timeout=2.0)
        return list(merged.families)

    @property
    def model(self) -> ModelInfo | None:
        """The loaded model's description, or None while loading."""
        client = self._client
        return client.info if client is not None else None

    @property
    def queue_limit(self) -> int | None:
        """MAX_QUEUE in effect (derived from the measured rate when unset)."""
        client = self._client
        return client.port.queue_limit if client is not None else self.settings.max_queue

    @property
    def runner(self) -> Runner | None:
        """The model side, when it is in this process and loaded (its batcher, encoder)."""
        return self._runner

    def ready(self, timeout: float | None = None) -> EngineClient:
        """The handle on the engine, waiting up to ``timeout`` for the model; 503 if it is
        not there."""
        if self._client is None and not self.failure:
            self._loaded.wait(timeout)
        state, client = self.state, self._client
        if state == "draining":
            raise shutting_down()
        if state != "ready" or client is None:
            message = _LOADING if state == "loading" else (
                "the model failed to load; the server log says why" if self.failure
                else "the service is unhealthy; see its log")
            raise Unavailable(message, code=state, headers={"Retry-After": "1"})
        return client

    def drain(self, timeout: float) -> ShutdownReport:
        """Refuse new work, finish what was admitted within ``timeout``."""
        self._draining = True
        self._stop.set()
        report = ShutdownReport(0, 0, True)
        if self._client is not None:
            report = self._client.shutdown(timeout)
        if self._link is not None:
            self._link.close()
        for other in self.others:  # in turn, each within the time left of ``timeout``
            more = other.drain(timeout)
            report = ShutdownReport(report.completed + more.completed,
                                    report.failed + more.failed, report.clean and more.clean,
                                    report.uncomputed + more.uncomputed)
        return report

    # -- several models -------------------------------------------------------------------

    @property
    def models(self) -> list[Service]:
        """Every model's service, the first (this one) first."""
        return [self, *self.others]

    def serve_also(self, entries: list[tuple[str, tuple[str, ...], Service]]) -> None:
        """Serve several models: ``entries`` (name, aliases, service), this one's first."""
        for name, aliases, service in entries:
            service.name = name
            if service is not self:
                service.keyring, service.quotas = self.keyring, self.quotas
                self.others.append(service)
            for key in (name, *aliases):  # "x:latest" is "x", as the catalog reads it
                self._named[key] = self._named[key.removesuffix(":latest")] = service

    def choose(self, name: str | None, kinds: frozenset[str] | None, timeout: float
               ) -> Service:
        """The service of the model a request names (404 naming the served ones for a name
        not served), or without a name the first model of one of ``kinds``. One model:
        this one, whatever the name (clients send their own names, as OpenAI's do)."""
        if not self.others:
            return self
        if name:
            found = self._named.get(name) or self._named.get(name.removesuffix(":latest"))
            if found is None:
                served = ", ".join(s.name for s in self.models)
                raise NotFound(f"the model {name[:100]!r} is not served here; this server serves "
                               f"{served} (GET /v1/models)", param="model",
                               code="model_not_found")
            return found
        if kinds is None:
            return self
        deadline = time.monotonic() + timeout
        for service in self.models:
            model = service.model
            if model is None:  # still loading: its kind is known once it is up
                try:
                    model = service.ready(max(0.0, deadline - time.monotonic())).info
                except Unavailable:
                    continue
            if model.kind in kinds:
                return service
        return self  # the route answers wrong_model_kind, or 503 while models load

    def _announce_models(self) -> None:
        """Once every model is up: one line with each one's size and the total."""
        for service in self.models:
            while not service._loaded.wait(0.5):
                if self._stop.is_set():
                    return
        up = [(s.name, s.model) for s in self.models if s.model is not None]
        log.info("models ready: %s; %.1f MiB in all",
                 ", ".join(f"{name} ({model.kind}, {model.device}, "
                           f"{model.size_bytes / 2**20:.1f} MiB)" for name, model in up),
                 sum(model.size_bytes for _, model in up) / 2**20)

    def states(self) -> dict[str, str]:
        """Each model's state, by name."""
        return {service.name: service.state for service in self.models}

    def _load(self, background: bool = True) -> None:
        if self.engine_address is not None:
            self._connect(self.engine_address)
            return
        started = time.monotonic()
        try:
            encoder = self._given or self._loader()
        except Exception as exc:
            # Mostly the user's to fix (a path, a hub id offline, a device): one line that
            # says what went wrong; the traceback only at LOG_LEVEL=debug.
            failure = f"the model failed to load: {_reason(exc)}"
            log.debug("the model failed to load", exc_info=True)
            if background:  # a foreground start raises it to its caller, which reports it
                log.error("%s", failure)
            self.failure = failure  # only now: waiting requests answer as soon as it is set
            self._loaded.set()
            return
        if self.name:  # one of several models: clients know it by its name in the list
            encoder.info = dataclasses.replace(encoder.info, name=self.name)
        port = local_port(self.settings, encoder, self.metrics)
        port.admission.quotas = self.quotas
        self._runner = port.runner
        batcher = port.runner.batcher
        self._client = EngineClient(self.settings, encoder, port, self.metrics)
        threading.Thread(target=self._watch, args=(batcher,), name="embedsvc-watchdog",
                         daemon=True).start()
        self._announce(encoder.info, time.monotonic() - started)
        _settle()
        self._loaded.set()
        for callback in self.on_ready:
            callback(encoder.info)

    def _connect(self, address: str) -> None:
        """Wait for the engine process's card; build this process's engine client from it."""
        from .model.text import text_model
        from .remote.client import Link, RemotePort

        self._link = link = Link(address, snapshot=lambda: self.metrics.snapshot(self.pid),
                                 keeper=self._keeper)
        link.start()
        while not self._stop.is_set():
            card = link.wait_card(0.5)
            if card is None:
                continue
            try:
                text = text_model(card.info, card.text)
            except Exception as exc:  # noqa: BLE001 - a front that cannot tokenize cannot serve
                self.failure = f"the engine's tokenizer cannot be rebuilt here: {_reason(exc)}"
                log.error("%s", self.failure)
            else:
                self._client = EngineClient(self.settings, text, RemotePort(link), self.metrics)
                log.info("front ready: pid=%d, the model in the engine process (pid %d)",
                         self.pid, card.pid)
                _settle()
            break
        self._loaded.set()

    def _announce(self, info: ModelInfo, seconds: float) -> None:
        self.metrics.model_load.set(seconds)
        self.metrics.model_info.info({
            "model": info.name, "device": info.device, "dtype": info.dtype,
            "version": __version__, "dimension": str(info.dimension), "kind": info.kind,
        })
        if info.device.startswith("cuda"):
            self.metrics.watch_device_memory(_cuda_memory)
        log.info(
            "model ready: pid=%d device=%s dtype=%s model=%s kind=%s dimension=%d parameters=%d "
            "size=%.1fMiB load=%.1fs",
            self.pid, info.device, info.dtype, info.name, info.kind, info.dimension,
            info.parameters,
            info.size_bytes / 2**20, seconds,
        )
        if "image" in info.modalities:
            from .image import require_pillow

            try:
                require_pillow()
            except ImportError as exc:
                log.warning("%s; until then this %s model embeds texts only, and a request "
                            "with images gets 503", exc, info.kind)

    def _watch(self, batcher: Batcher) -> None:
        """Cancel queued requests past their deadline or orphaned; restart a dead batcher
        thread (/health says unhealthy meanwhile)."""
        last_watch = time.monotonic()
        while not self._stop.wait(_SWEEP_S):
            try:
                batcher.cancel_due()
                now = time.monotonic()
                if now - last_watch >= _WATCH_S:
                    last_watch = now
                    if not batcher.alive:
                        batcher.restart()
            except Exception:  # noqa: BLE001 - requests rely on this thread for their deadlines
                log.exception("watchdog tick failed; continuing")


def serve_models(settings: Settings, make: Callable[[Settings, int], Service]) -> Service:
    """The services of the models ``settings`` list (catalog.py), ``make(settings, index)``
    building each: the first's, which holds the others when there are several."""
    from .catalog import catalog

    entries = catalog(settings)
    services = [make(entry.settings, i) for i, entry in enumerate(entries)]
    if len(services) > 1:
        services[0].serve_also([(entry.name, entry.aliases, service)
                                for entry, service in zip(entries, services, strict=True)])
    elif settings.models or settings.models_file:  # one model listed: the name it is given
        services[0].name = entries[0].name  # as its engine process takes it (children.py)
    return services[0]


# the model kinds whose answers are normalised vectors (``Embed.shape``): dense embedding
# and image-text models; rerankers' scores and sparse encoders' logits are not
UNIT_KINDS = frozenset({"embedding", "image-text"})


def local_port(settings: Settings, encoder: Encoder, metrics: Metrics) -> LocalPort:
    """The model side in this process, its batcher started."""
    from .batching.batcher import Batcher
    from .runner import LocalPort, Runner

    if hasattr(encoder, "towers"):  # an image-text model counts each tower's work
        encoder.towers = metrics
    batcher = Batcher(encoder.encode, batch_limits(settings, encoder), metrics=metrics)
    if encoder.info.kind in UNIT_KINDS:  # answers normalised once a batch (Batcher.unit)
        batcher.unit = l2_normalize
    batcher.start()
    return LocalPort(Runner(settings, encoder, batcher, metrics))


def local_client(settings: Settings, encoder: Encoder, metrics: Metrics | None = None
                 ) -> EngineClient:
    """An engine client whose model is in this process (its batcher started; no watchdog)."""
    metrics = metrics or Metrics()
    return EngineClient(settings, encoder, local_port(settings, encoder, metrics), metrics)


def batch_limits(settings: Settings, encoder: Encoder) -> BatchLimits:
    """The batcher's limits; an encoder with wide rows (sparse: vocabulary-wide logits per
    token) caps the tokens of a batch (``batch_tokens``) so that their memory stays bounded."""
    from .batching.batcher import BatchLimits

    limits = BatchLimits.from_settings(settings)
    cap = getattr(encoder, "batch_tokens", None)
    if cap is None:
        return limits
    return dataclasses.replace(limits, max_batch_tokens=cap(limits.max_batch_tokens))


def _settle() -> None:
    """Move what starting built (modules, the web stack, the tokenizer, the model's graph)
    out of the garbage collector's generations: it lives as long as the process, and each
    full collection walked all of it again. A request that builds many containers (a 2 MB
    body of 350,000 one-item lists) triggers such collections while it parses: measured,
    its parse took 0.35 CPU-s with the startup's objects in the generations, 0.15 frozen."""
    gc.freeze()


def _reason(exc: BaseException) -> str:
    """``Type: message``, the message's first line only (library errors can run long)."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _cuda_memory() -> tuple[int, int]:
    import torch

    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
