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
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator

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
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_POW2_ITEMS = tuple(float(2**i) for i in range(0, 12))  # 1 .. 2048
_POW2_TOKENS = tuple(float(2**i) for i in range(4, 18))  # 16 .. 131072
_SHARE = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class Metrics:
    """The ``embedsvc_*`` metrics, named with base units; one instance per registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "embedsvc_requests", "HTTP requests by route and status", ["route", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "embedsvc_request_duration_seconds", "HTTP request duration by route", ["route"],
            buckets=_LATENCY, registry=r,
        )
        self.queue_wait = BulkHistogram(
            "embedsvc_queue_wait_seconds", "Per input: time queued before its batch started",
            buckets=_LATENCY, registry=r,
        )
        self.tokenization = BulkHistogram(
            "embedsvc_tokenization_seconds", "Per request: time spent tokenizing its inputs",
            buckets=_LATENCY, registry=r,
        )
        self.inference = BulkHistogram(
            "embedsvc_inference_seconds", "Per batch: time on the device",
            buckets=_LATENCY, registry=r,
        )
        self.batch_size = BulkHistogram(
            "embedsvc_batch_size", "Inputs per device batch", buckets=_POW2_ITEMS, registry=r,
        )
        self.batch_tokens = BulkHistogram(
            "embedsvc_batch_tokens", "Padded tokens per device batch (count x longest)",
            buckets=_POW2_TOKENS, registry=r,
        )
        self.padding_efficiency = BulkHistogram(
            "embedsvc_padding_efficiency_ratio", "Per batch: real tokens / padded tokens",
            buckets=_SHARE, registry=r,
        )
        self.batch_fronts = BulkHistogram(
            "embedsvc_batch_fronts", "Per batch: the HTTP processes its inputs came from "
            "(with an engine process)", buckets=_POW2_ITEMS[:7], registry=r,
        )
        self.inputs = Counter("embedsvc_inputs", "Inputs computed", registry=r)
        self.input_tokens = Counter(
            "embedsvc_input_tokens", "Real tokens computed (after truncation, with special tokens)",
            registry=r,
        )
        self.input_length = BulkHistogram(
            "embedsvc_input_length_tokens", "Per input: tokens after truncation",
            buckets=_POW2_TOKENS, registry=r,
        )
        self.queue_depth = Gauge(
            "embedsvc_queue_depth", "Inputs queued for the device", registry=r,
        )
        self.in_flight = Gauge(
            "embedsvc_in_flight", "Inputs in the batch on the device", registry=r,
        )
        self.rejections = Counter(
            "embedsvc_rejections", "Requests refused, by reason", ["reason"], registry=r,
        )
        self.dropped_inputs = Counter(
            "embedsvc_dropped_inputs", "Queued inputs dropped before compute, by reason",
            ["reason"], registry=r,
        )
        self.batch_failures = Counter(
            "embedsvc_batch_failures", "Device batches that raised", registry=r,
        )
        self.oom_splits = Counter(
            "embedsvc_oom_splits", "Batches split in two after a device out-of-memory error",
            registry=r,
        )
        self.batcher_alive = Gauge(
            "embedsvc_batcher_alive", "1 while the batcher thread runs", registry=r,
        )
        self.batcher_restarts = Counter(
            "embedsvc_batcher_restarts", "Times the batcher thread was restarted", registry=r,
        )
        self.model_load = Gauge(
            "embedsvc_model_load_seconds", "Time to load, place and warm the model", registry=r,
        )
        self.model_info = Info("embedsvc_model", "The served model", registry=r)
        self.admission_limit = Gauge(
            "embedsvc_admission_limit_inputs",
            "MAX_QUEUE in effect: inputs admitted at once (derived from the rate when unset)",
            registry=r,
        )
        self.connections_closed = Counter(
            "embedsvc_connections_closed",
            "Client connections the server closed for a bound, by reason", ["reason"],
            registry=r,
        )
        self.open_connections = Gauge(
            "embedsvc_open_connections", "Client connections open on the serving port",
            registry=r,
        )
        self.tenant_requests = Counter(
            "embedsvc_tenant_requests", "Requests by tenant (its API key's name) and status",
            ["tenant", "status"], registry=r,
        )
        self.tenant_inputs = Counter(
            "embedsvc_tenant_inputs", "Inputs answered, by tenant", ["tenant"], registry=r,
        )
        self.tenant_tokens = Counter(
            "embedsvc_tenant_tokens", "Tokens computed, by tenant", ["tenant"], registry=r,
        )
        self._request_children: dict[tuple[str, int], tuple[Counter, Histogram]] = {}
        self._origin = secrets.randbits(62)  # this process's snapshots, even if its pid is reused
        self._seq = 0
        self._snapshot_lock = threading.Lock()
        self._device_memory = _DeviceMemory()
        r.register(self._device_memory)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, open fds, cpu seconds

    def observe_batch(self, lengths: list[int], seconds: float) -> None:
        """One computed batch, given the token count of each of its inputs."""
        real = sum(lengths)
        padded = max(lengths) * len(lengths)
        self.batch_size.observe(len(lengths))
        self.batch_tokens.observe(padded)
        self.padding_efficiency.observe(real / padded)
        self.inference.observe(seconds)
        self.inputs.inc(len(lengths))
        self.input_tokens.inc(real)
        self.input_length.observe_many(lengths)

    def count_request(self, route: str, status: int, seconds: float) -> None:
        # labels() takes a lock and builds a key per call; the children are kept instead.
        children = self._request_children.get((route, status))
        if children is None:
            children = (self.requests.labels(route=route, status=str(status)),
                        self.request_duration.labels(route=route))
            self._request_children[(route, status)] = children
        children[0].inc()
        children[1].observe(seconds)

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
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        with self._lock:  # observe_many's loop for one value, without building a tuple
            self._counts[bisect_left(self._bounds, value)] += 1
            self._sum += value

    def observe_many(self, values: Iterable[float]) -> None:
        bounds, counts, total = self._bounds, self._counts, 0.0
        with self._lock:
            for value in values:
                counts[bisect_left(bounds, value)] += 1
                total += value
            self._sum += total

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), float(cumulative)))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets,
                                    sum_value=total)
