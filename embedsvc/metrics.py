"""Every metric of the service, on an injected registry.

>>> from prometheus_client import CollectorRegistry
>>> registry = CollectorRegistry()
>>> m = Metrics(registry)
>>> m.observe_batch([10, 12, 12, 6], seconds=0.01)
>>> registry.get_sample_value("embedsvc_batch_size_count")
1.0
"""

from __future__ import annotations

import math
import re
import secrets
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar, overload

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    Metric,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

M = TypeVar("M")  # a prometheus_client metric, or one of this module's collectors

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_POW2_ITEMS = tuple(float(2**i) for i in range(0, 12))  # 1 .. 2048
_POW2_TOKENS = tuple(float(2**i) for i in range(4, 18))  # 16 .. 131072
_SHARE = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class _Declared(Generic[M]):
    """One row of ``Metrics``' table: the metric it builds on each instance's registry.

    An instance's own metric (in its ``__dict__``) hides the row, so reading one costs a
    plain attribute lookup."""

    def __init__(self, build: Callable[[CollectorRegistry], M]) -> None:
        self.build = build

    @overload
    def __get__(self, obj: None, owner: type) -> _Declared[M]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> M: ...
    def __get__(self, obj: object | None, owner: type) -> _Declared[M] | M:
        if obj is None:
            return self
        raise AttributeError("a metric is built by Metrics.__init__")


def _counter(name: str, doc: str, *labels: str) -> _Declared[Counter]:
    return _Declared(lambda r: Counter(name, doc, labels, registry=r))


def _gauge(name: str, doc: str) -> _Declared[Gauge]:
    return _Declared(lambda r: Gauge(name, doc, registry=r))


def _histogram(name: str, doc: str, buckets: tuple[float, ...]) -> _Declared[BulkHistogram]:
    return _Declared(lambda r: BulkHistogram(name, doc, buckets=buckets, registry=r))


class Metrics:
    """The ``embedsvc_*`` metrics, named with base units; one instance per registry.

    The table below declares them; a new metric is one row (and one line of
    docs/operations.md's table)."""

    requests = _counter("embedsvc_requests", "HTTP requests by route and status",
                        "route", "status")
    request_duration = _Declared(lambda r: Histogram(
        "embedsvc_request_duration_seconds", "HTTP request duration by route", ["route"],
        buckets=_LATENCY, registry=r))
    model_requests = _counter(
        "embedsvc_model_requests",
        "HTTP requests that went to one of several models, by route and status (labelled "
        "with the model)", "route", "status")
    model_request_duration = _Declared(lambda r: Histogram(
        "embedsvc_model_request_duration_seconds",
        "HTTP request duration by route, of the requests that went to one of several models "
        "(labelled with the model)", ["route"], buckets=_LATENCY, registry=r))
    queue_wait = _histogram("embedsvc_queue_wait_seconds",
                            "Per input: time queued before its batch started", _LATENCY)
    tokenization = _histogram("embedsvc_tokenization_seconds",
                              "Per request: time spent tokenizing its inputs", _LATENCY)
    inference = _histogram("embedsvc_inference_seconds", "Per batch: time on the device",
                           _LATENCY)
    batch_size = _histogram("embedsvc_batch_size", "Inputs per device batch", _POW2_ITEMS)
    batch_tokens = _histogram("embedsvc_batch_tokens",
                              "Padded tokens per device batch (count x longest)", _POW2_TOKENS)
    padding_efficiency = _histogram("embedsvc_padding_efficiency_ratio",
                                    "Per batch: real tokens / padded tokens", _SHARE)
    batch_fronts = _histogram(
        "embedsvc_batch_fronts",
        "Per batch: the HTTP processes its inputs came from (with an engine process)",
        _POW2_ITEMS[:7])
    # with the inputs computed (its count, ``embedsvc_inputs_total``) and their real tokens
    # (its sum, ``embedsvc_input_tokens_total``): counted once a batch, not three times
    input_length = _Declared(lambda r: InputHistogram(
        "embedsvc_input_length_tokens", "Per input: tokens after truncation",
        buckets=_POW2_TOKENS, registry=r))
    modality_inputs = _counter("embedsvc_modality_inputs",
                               "Inputs an image-text model computed, by modality", "modality")
    modality_seconds = _counter(
        "embedsvc_modality_seconds",
        "Seconds an image-text model's towers computed, by modality (text or image)",
        "modality")
    image_preprocess = _histogram(
        "embedsvc_image_preprocess_seconds",
        "Per image: decoding and preprocessing it, in the HTTP process", _LATENCY)
    queue_depth = _gauge("embedsvc_queue_depth", "Inputs queued for the device")
    in_flight = _gauge("embedsvc_in_flight", "Inputs in the batch on the device")
    rejections = _counter("embedsvc_rejections", "Requests refused, by reason", "reason")
    dropped_inputs = _counter("embedsvc_dropped_inputs",
                              "Queued inputs dropped before compute, by reason", "reason")
    batch_failures = _counter("embedsvc_batch_failures", "Device batches that raised")
    oom_splits = _counter("embedsvc_oom_splits",
                          "Batches split in two after a device out-of-memory error")
    batcher_alive = _gauge("embedsvc_batcher_alive", "1 while the batcher thread runs")
    batcher_restarts = _counter("embedsvc_batcher_restarts",
                                "Times the batcher thread was restarted")
    model_load = _gauge("embedsvc_model_load_seconds", "Time to load, place and warm the model")
    model_info = _Declared(lambda r: Info("embedsvc_model", "The served model", registry=r))
    admitted_inputs = _gauge(
        "embedsvc_admitted_inputs",
        "Inputs admitted: reserved while their request tokenizes, queued, or on the device")
    admission_limit = _gauge(
        "embedsvc_admission_limit_inputs",
        "MAX_QUEUE in effect: inputs admitted at once (derived from the rate when unset)")
    connections_closed = _counter(
        "embedsvc_connections_closed",
        "Client connections the server closed for a bound, by reason", "reason")
    open_connections = _gauge("embedsvc_open_connections",
                              "Client connections open on the serving port")
    tenant_requests = _counter("embedsvc_tenant_requests",
                               "Requests by tenant (its API key's name) and status",
                               "tenant", "status")
    tenant_inputs = _counter("embedsvc_tenant_inputs", "Inputs answered, by tenant", "tenant")
    tenant_tokens = _counter("embedsvc_tenant_tokens", "Tokens computed, by tenant", "tenant")

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        for name, row in vars(Metrics).items():
            if isinstance(row, _Declared):
                self.__dict__[name] = row.build(self.registry)
        r = self.registry
        # a batch's histograms under one lock, taken once a batch (``observe_batch``)
        self._batch_lock = threading.Lock()
        self._batch = (self.batch_size, self.batch_tokens, self.padding_efficiency,
                       self.inference, self.input_length, self.batch_fronts)
        for histogram in self._batch:
            histogram.lock = self._batch_lock
        self._request_children: dict[tuple[str, int], tuple[Counter, Histogram]] = {}
        self._origin = secrets.randbits(62)  # this process's snapshots, even if its pid is reused
        self._seq = 0
        self._snapshot_lock = threading.Lock()
        self._device_memory = _DeviceMemory()
        r.register(self._device_memory)
        self._engine_load = _EngineLoad()
        r.register(self._engine_load)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, open fds, cpu seconds

    def observe_batch(self, lengths: list[int], seconds: float, fronts: int = 0) -> None:
        """One computed batch, given the token count of each of its inputs and the HTTP
        processes they came from (``fronts``; 0: one process, not counted)."""
        count, real = len(lengths), sum(lengths)
        padded = max(lengths) * count
        size, tokens, padding, inference, length, by_front = self._batch
        with self._batch_lock:
            if fronts:
                by_front.add(fronts)
            size.add(count)
            tokens.add(padded)
            if padded:  # a batch of inputs of no tokens (an image's are its patches) pads nothing
                padding.add(real / padded)
            inference.add(seconds)
            length.add_many(lengths, real)

    def count_request(self, route: str, status: int, seconds: float) -> None:
        # labels() takes a lock and builds a key per call; the children are kept instead.
        children = self._request_children.get((route, status))
        if children is None:
            children = (self.requests.labels(route=route, status=str(status)),
                        self.request_duration.labels(route=route))
            self._request_children[(route, status)] = children
        children[0].inc()
        children[1].observe(seconds)

    def count_model_request(self, route: str, status: int, seconds: float) -> None:
        """One answered request that went to this model, one of several (the service's
        ``embedsvc_requests_total`` and ``embedsvc_request_duration_seconds`` count it too)."""
        self.model_requests.labels(route=route, status=str(status)).inc()
        self.model_request_duration.labels(route=route).observe(seconds)

    def count_tenant(self, tenant: str, status: int, inputs: int, tokens: int) -> None:
        """One answered request of ``tenant`` (a name of the keys file: a bounded label)."""
        self.tenant_requests.labels(tenant=tenant, status=str(status)).inc()
        if inputs:
            self.tenant_inputs.labels(tenant=tenant).inc(inputs)
        if tokens:
            self.tenant_tokens.labels(tenant=tenant).inc(tokens)

    def count_rejection(self, reason: str) -> None:
        self.rejections.labels(reason=reason).inc()

    def families(self, pid: int | None = None) -> list[Family]:
        """This process's metrics as plain data (``families``)."""
        return families(self.registry, pid)

    def snapshot(self, pid: int) -> tuple[int, int, list[Family]]:
        """This process's metrics to send the engine: its origin, a sequence number that a
        later snapshot's exceeds, and the families (taken under the same lock, so that a
        larger number never holds smaller counts)."""
        with self._snapshot_lock:
            self._seq += 1
            return self._origin, self._seq, self.families(pid)

    def watch_device_memory(self, read: Callable[[], tuple[int, int]]) -> None:
        """Export ``read() -> (allocated, reserved)`` bytes, called at scrape time."""
        self._device_memory.read = read

    def watch_engine_loop(self, busy_seconds: Callable[[], float],
                          waiting_seconds: Callable[[], float | None] | None = None) -> None:
        """Export this engine process's CPU, its loop's ``busy_seconds()`` and its
        ``waiting_seconds()`` for a CPU (None: the platform does not tell), at scrape time."""
        self._engine_load.busy_seconds = busy_seconds
        self._engine_load.waiting_seconds = waiting_seconds


# One metric family as plain data: (name, type, help, [(sample name, labels, value), ...]).
# What a front sends the engine (``Snapshot``), and what a scrape merges.
Sample = tuple[str, dict[str, str], float]
Family = tuple[str, str, str, list[Sample]]


def families(registry: CollectorRegistry, pid: int | None = None) -> list[Family]:
    """``registry``'s metrics as plain data. With ``pid``, a process's own figures (its
    memory, CPU, descriptors: ``process_*``) carry it as a label, since summing them over
    processes would mean nothing; an info metric with no value yet has no sample."""
    out: list[Family] = []
    for metric in registry.collect():
        own = pid is not None and metric.name.startswith("process_")
        samples: list[Sample] = []
        for sample in metric.samples:
            labels = dict(sample.labels)
            if metric.type == "info" and not labels:
                continue
            if own:
                labels["pid"] = str(pid)
            samples.append((sample.name, labels, sample.value))
        out.append((metric.name, metric.type, metric.documentation, samples))
    return out


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_TYPES = ("counter", "gauge", "histogram", "summary", "info", "stateset", "unknown")


def check_families(found: Iterable[Family]) -> None:
    """ValueError unless ``found`` is what ``families`` makes: metric and label names
    Prometheus takes, known types, each sample named for its family, finite values. A
    front's snapshot is checked so before the engine keeps it, since a scrape renders it."""
    for name, kind, _, samples in found:
        if not _NAME.fullmatch(name) or kind not in _TYPES:
            raise ValueError(f"a metric family {name[:80]!r} of type {kind[:20]!r}")
        for sample_name, labels, value in samples:
            if not (_NAME.fullmatch(sample_name) and sample_name.startswith(name)):
                raise ValueError(f"a sample {sample_name[:80]!r} in family {name!r}")
            if not all(_LABEL.fullmatch(k) and not k.startswith("__") for k in labels):
                raise ValueError(f"a label name of {sample_name!r} Prometheus refuses")
            if not math.isfinite(value):
                raise ValueError(f"a sample {sample_name!r} that is not a finite number")


def merge(*sources: Iterable[Family]) -> list[Family]:
    """Families of several processes as one: the samples of equal name and labels added
    (counters, histograms' buckets and sums, gauges such as open connections)."""
    by_name: dict[str, tuple[str, str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]] = {}
    for source in sources:
        for name, kind, documentation, samples in source:
            values = by_name.setdefault(name, (kind, documentation, {}))[2]
            for sample_name, labels, value in samples:
                key = (sample_name, tuple(sorted(labels.items())))
                values[key] = values.get(key, 0.0) + value
    return [(name, kind, documentation, [(n, dict(labels), v) for (n, labels), v in values.items()])
            for name, (kind, documentation, values) in by_name.items()]


def exposition(merged: list[Family]) -> bytes:
    """The Prometheus text exposition of ``merged`` families."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merged))
    return generate_latest(registry)


class _Families(Collector):
    def __init__(self, merged: list[Family]) -> None:
        self._families = merged

    def collect(self) -> Iterator[Metric]:
        for name, kind, documentation, samples in self._families:
            metric = Metric(name, documentation, kind)
            for sample_name, labels, value in samples:
                metric.add_sample(sample_name, labels, value)
            yield metric


class Snapshots:
    """The fronts' latest metrics, as the engine keeps them for a scrape of any front.

    A front sends its own every second, and with each scrape it asks for; each carries the
    front's ``origin`` (one per process: a reused pid is another front) and a sequence
    number that grows with every snapshot it takes. Only a later one replaces the kept one:
    a periodic snapshot that arrives after a scrape's fresher one (they travel on different
    sockets) would take counts back. A scrape merges the engine's own and every front's
    kept one, the asking front's included, so every front's scrape reads the same sums, and
    a later scrape never less; a front that is gone keeps its counters and histograms (its
    requests happened), not its gauges.
    """

    def __init__(self) -> None:
        self._latest: dict[tuple[int, int], tuple[int, list[Family]]] = {}
        self._lock = threading.Lock()

    def keep(self, pid: int, origin: int, seq: int, snapshot: list[Family]) -> None:
        with self._lock:
            kept = self._latest.get((pid, origin))
            if kept is None or seq > kept[0]:
                self._latest[(pid, origin)] = (seq, snapshot)

    def merged(self, own: list[Family], live: Iterable[int]) -> list[Family]:
        alive = set(live)
        with self._lock:
            fronts = [(pid, snap) for (pid, _), (_, snap) in self._latest.items()]
        parts = [own]
        for pid, snapshot in fronts:
            parts.append(snapshot if pid in alive else
                         [f for f in snapshot if f[1] in ("counter", "histogram")])
        return merge(*parts)


class _DeviceMemory(Collector):
    """Device memory read at scrape time, without the device lock; no samples on the CPU."""

    read: Callable[[], tuple[int, int]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "embedsvc_device_memory_bytes", "Device memory held by torch (CUDA only)",
            labels=["kind"],
        )
        if self.read is not None:
            allocated, reserved = self.read()
            family.add_metric(["allocated"], allocated)
            family.add_metric(["reserved"], reserved)
        yield family


class _EngineLoad(Collector):
    """The engine process's own load, so that an operator sees the engine saturate before
    the device does: its CPU (every thread), the seconds its loop spent working rather
    than waiting for frames, and the seconds it was ready to work but had no CPU (the
    fronts, or anything else on the host, held them). No samples outside an engine
    process; no waiting sample where the platform does not tell it."""

    busy_seconds: Callable[[], float] | None = None
    waiting_seconds: Callable[[], float | None] | None = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        cpu = CounterMetricFamily(
            "embedsvc_engine_cpu_seconds", "CPU time of the engine process, every thread")
        busy = CounterMetricFamily(
            "embedsvc_engine_loop_busy_seconds",
            "Time the engine process's loop spent working (reading, admitting, answering) "
            "rather than waiting; its rate is the loop's busy fraction")
        waiting = CounterMetricFamily(
            "embedsvc_engine_loop_waiting_seconds",
            "Time the engine process's loop was ready to run but waited for a CPU (Linux); "
            "its rate is the fraction of time the loop was held up by others' work")
        if self.busy_seconds is not None:
            cpu.add_metric([], time.process_time())
            busy.add_metric([], self.busy_seconds())
            waited = self.waiting_seconds() if self.waiting_seconds is not None else None
            if waited is not None:
                waiting.add_metric([], waited)
        yield cpu
        yield busy
        yield waiting


def thread_waiting_seconds(tid: int, pid: int | str = "self") -> float | None:
    """Seconds thread ``tid`` of process ``pid`` has been runnable but not running, since
    it started: the second field of Linux's ``/proc/PID/task/TID/schedstat``. None where
    there is no such file (another platform, a kernel without schedstats, a thread gone)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class BulkHistogram(Collector):
    """An unlabelled histogram that takes many observations in one call.

    prometheus_client's ``Histogram.observe`` costs a few microseconds per value (a lock per
    counter, a loop over the buckets); the batcher observes every input of every batch, so
    this one bisects the buckets and takes one lock per call. Same exposition.

    >>> registry = CollectorRegistry()
    >>> h = BulkHistogram("demo_tokens", "demo", buckets=(8, 64), registry=registry)
    >>> h.observe_many([3, 9, 100])
    >>> registry.get_sample_value("demo_tokens_bucket", {"le": "64.0"})
    2.0
    """

    def __init__(self, name: str, documentation: str, *, buckets: Iterable[float],
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = [float(b) for b in buckets if b != math.inf] + [math.inf]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        # over the counts and the sum; several histograms observed together may share one
        # (``Metrics.observe_batch``), whose holder then calls ``add`` and ``add_many``
        self.lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        with self.lock:  # observe_many's loop for one value, without building a tuple
            self._counts[bisect_left(self._bounds, value)] += 1
            self._sum += value

    def observe_many(self, values: Iterable[float]) -> None:
        bounds, counts, total = self._bounds, self._counts, 0.0
        with self.lock:
            for value in values:
                counts[bisect_left(bounds, value)] += 1
                total += value
            self._sum += total

    def add(self, value: float) -> None:
        """``observe``, ``lock`` held by the caller."""
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def add_many(self, values: Iterable[float], total: float) -> None:
        """``observe_many`` of ``values`` (whose sum is ``total``), ``lock`` held by the
        caller."""
        bounds, counts = self._bounds, self._counts
        for value in values:
            counts[bisect_left(bounds, value)] += 1
        self._sum += total

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            counts, total = list(self._counts), self._sum
        yield self._family(counts, total)

    def _family(self, counts: list[int], total: float) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), float(cumulative)))
        return HistogramMetricFamily(self.name, self.documentation, buckets=buckets,
                                     sum_value=total)


_INPUTS = ("embedsvc_inputs", "Inputs computed")
_INPUT_TOKENS = ("embedsvc_input_tokens",
                 "Real tokens computed (after truncation, with special tokens)")


class InputHistogram(BulkHistogram):
    """The tokens of each input computed, and two counters that are its count and its sum:
    ``embedsvc_inputs_total`` and ``embedsvc_input_tokens_total``, read with it.

    >>> registry = CollectorRegistry()
    >>> h = InputHistogram("demo_length", "demo", buckets=(8, 64), registry=registry)
    >>> h.observe_many([3, 9, 100])
    >>> registry.get_sample_value("embedsvc_inputs_total")
    3.0
    >>> registry.get_sample_value("embedsvc_input_tokens_total")
    112.0
    """

    def describe(self) -> Iterator[Metric]:
        yield from super().describe()
        yield CounterMetricFamily(*_INPUTS)
        yield CounterMetricFamily(*_INPUT_TOKENS)

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            counts, total = list(self._counts), self._sum
        yield self._family(counts, total)
        yield CounterMetricFamily(*_INPUTS, value=float(sum(counts)))
        yield CounterMetricFamily(*_INPUT_TOKENS, value=total)
