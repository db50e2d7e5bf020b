"""Traces: each request to a route of the table as an OpenTelemetry server span.

With OTLP_ENDPOINT set (or OpenTelemetry's own ``OTEL_EXPORTER_OTLP_ENDPOINT`` variables,
settings.py), the pipeline hands each request to ``Tracing.handle`` instead of straight to
its handler. The span continues the caller's W3C ``traceparent`` (and ``tracestate``), or
starts a trace; its children are the stages the request measured (``Embedded``): the wait
for admission, tokenizing, the batcher's queue, the device batch, and shaping the answer.
They are placed after the fact from those durations, ending where the engine returned, so
they are the same whether the model is in this process or in the engine process (whose
timings come back in its answer frames). Spans leave through the SDK's batch processor and
the OTLP/HTTP exporter, on the processor's thread, never the request's.

What reaches the collector, and what comes back, is bounded: a span of an error carries the
error's class and its client-facing message, never a traceback or a file path; a collector's
answer is read up to 4 KiB and never decompressed (a small gzip answer could inflate to
gigabytes); the last spans are flushed at exit for at most DRAIN_TIMEOUT_S, so a collector
that never answers cannot hold the process. A caller's ``tracestate`` that is not W3C's
(more than 512 characters, or a member of another form) is dropped, silently: the trace
continues from ``traceparent``, and no log line repeats a caller's header.

Without an endpoint nothing of OpenTelemetry is imported: the pipeline's only cost is one look at
``Pipeline.tracing`` (bench/RESULTS.md, 2026-12-03). Each process that serves builds its own
exporter when it builds its app, after gunicorn's fork (serving/process.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ApiError
from ..settings import SettingsError
from ..work import Embedded, Work
from .web import Call, Reply, Route

MISSING_EXTRA = ("traces are asked for (OTLP_ENDPOINT, or OTEL_EXPORTER_OTLP_ENDPOINT or "
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, is set) but the OpenTelemetry packages "
                 "are not installed: pip install 'embedsvc[otel]', or unset it")
_STAGES = ("embedsvc.admission", "embedsvc.tokenize", "embedsvc.queue", "embedsvc.compute")
_ANSWER_BYTES = 4096  # what is read of a collector's answer (its status is what counts)
_TRACESTATE_CHARS = 512  # W3C: what every vendor must pass on; longer is dropped here
_MEMBER = re.compile(  # one tracestate list-member (W3C trace-context, "tracestate" header)
    r"[a-z0-9][_0-9a-z\-*/]{0,255}(?:@[a-z][_0-9a-z\-*/]{0,13})?"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")
log = logging.getLogger(__name__)


def check_installed(endpoint: str) -> None:
    """SettingsError (one line, naming the extra) when traces are asked for without it."""
    if endpoint:
        _require_sdk()


def _require_sdk() -> None:
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise SettingsError(MISSING_EXTRA) from None


def tracing_for(endpoint: str, drain_timeout_s: float = 5.0) -> Tracing | None:
    """This process's tracing for OTLP_ENDPOINT, or None when it is empty."""
    return Tracing(endpoint, drain_timeout_s=drain_timeout_s) if endpoint else None


def bounded_session() -> Any:
    """A ``requests`` session for the exporter that reads at most ``_ANSWER_BYTES`` of an
    answer, as sent (never decompressed), and asks for it uncompressed."""
    import requests

    class Bounded(requests.Session):
        def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
            kwargs["stream"] = True
            response = super().send(request, **kwargs)
            try:
                response._content = response.raw.read(_ANSWER_BYTES, decode_content=False)
            finally:
                response.close()
            return response

    session = Bounded()
    session.headers["Accept-Encoding"] = "identity"
    return session


@dataclass(slots=True)
class TracedCall(Call):
    """The handler's ``Call``, noting the work it ran, its answer and when it came back."""

    ran: Work | None = None
    answer: Embedded | None = None
    answered_at: float = 0.0

    @classmethod
    def of(cls, call: Call) -> TracedCall:
        traced = cls.__new__(cls)
        for f in fields(Call):  # whatever fields Call has, the pipeline's included
            setattr(traced, f.name, getattr(call, f.name))
        traced.ran, traced.answer, traced.answered_at = None, None, 0.0
        return traced

    def run(self, work: Work) -> Embedded:
        out = Call.run(self, work)
        self.ran, self.answer, self.answered_at = work, out, time.monotonic()
        return out


class Tracing:
    """One process's tracer and exporter; ``exporter`` (tests): where spans go instead of
    OTLP/HTTP to ``endpoint``.

    Example, spans to a collector on this machine::

        app = create_app(Settings(otlp_endpoint="http://localhost:4318"))
    """

    def __init__(self, endpoint: str, exporter: Any = None, *,
                 drain_timeout_s: float = 5.0) -> None:
        _require_sdk()
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from .. import __version__

        self._trace = trace
        found = Resource.create({"service.version": __version__, "process.pid": os.getpid()})
        if str(found.attributes.get("service.name", "")).startswith("unknown_service"):
            found = found.merge(Resource({"service.name": "embedsvc"}))  # OTEL_SERVICE_NAME wins
        self.provider = TracerProvider(resource=found, shutdown_on_exit=False)  # ours, below
        # a half second past the drain: at the exit's flush a silent collector outlasts the
        # drain's wait (``shutdown`` False); with the same timeout the export could give up
        # first, and the flush looked finished
        exporter = exporter or OTLPSpanExporter(
            endpoint=endpoint, session=bounded_session(),
            timeout=min(10.0, max(1.0, drain_timeout_s)) + 0.5)
        self.drain_timeout_s = drain_timeout_s
        self._shut = False
        atexit.register(self.shutdown)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("embedsvc", __version__)
        self.propagator = TraceContextTextMapPropagator()
        self.server = trace.SpanKind.SERVER

    def handle(self, route: Route, call: Call, environ: dict[str, Any]) -> Reply:
        """``route``'s handler on ``call``, inside a span that continues the caller's trace;
        open routes (probes, scrapes, the docs page) make none: they would bury the traces."""
        if route.open:
            return route.handler(call)
        clock = time.time_ns() - time.monotonic_ns()  # monotonic -> the epoch, in ns
        method = environ.get("REQUEST_METHOD", route.method)
        span = self.tracer.start_span(
            f"{method} {route.path}", context=self.propagator.extract(_carrier(environ)),
            kind=self.server, start_time=_ns(call.arrived, clock), attributes={
                "http.request.method": method, "http.route": route.path,
                "url.path": environ.get("PATH_INFO", "")})
        traced = TracedCall.of(call)
        try:
            reply = route.handler(traced)
        except ApiError as exc:
            self._end(span, traced, clock, exc.status, exc)
            raise
        except Exception as exc:
            self._end(span, traced, clock, 500, exc)
            raise
        self._end(span, traced, clock, reply.status, None)
        return reply

    def shutdown(self, timeout: float | None = None) -> bool:
        """Export what is buffered and stop the exporter's thread, for at most ``timeout``
        (DRAIN_TIMEOUT_S); whether it finished. Past that the process goes on without the
        last spans (the flush goes on in a daemon thread, which its exit ends)."""
        if self._shut:
            return True
        self._shut = True
        atexit.unregister(self.shutdown)
        limit = self.drain_timeout_s if timeout is None else timeout
        flush = threading.Thread(target=self.provider.shutdown, name="embedsvc-trace-flush",
                                 daemon=True)
        flush.start()
        flush.join(limit)
        if flush.is_alive():
            log.warning("traces: the collector did not take the last spans within %.1fs "
                        "(DRAIN_TIMEOUT_S); going on without them", limit)
            return False
        return True

    def _end(self, span: Any, call: TracedCall, clock: int, status: int,
             error: BaseException | None) -> None:
        done = time.monotonic()
        if span.is_recording():  # else the caller's trace is not sampled: nothing to say
            span.set_attributes(_attributes(call, status))
            if error is not None:
                span.set_attribute("error.type", getattr(error, "code", None)
                                   or type(error).__name__)
                span.add_event("exception", _error_event(error))
            if status >= 500:
                span.set_status(self._trace.Status(self._trace.StatusCode.ERROR,
                                                   _error_message(error, status)))
            if call.answer is not None:
                self._stages(span, call, clock, done)
        span.end(end_time=_ns(done, clock))

    def _stages(self, span: Any, call: TracedCall, clock: int, done: float) -> None:
        """The measured stages as children of ``span``, laid end to end back from where the
        engine returned; then shaping the answer, up to ``done``."""
        out = call.answer
        assert out is not None
        parent = self._trace.set_span_in_context(span)
        lengths = (out.admit_s, out.tokenize_s, max(0.0, out.queue_s - out.admit_s),
                   out.inference_s)
        start = call.answered_at - sum(lengths)
        for name, seconds in zip(_STAGES, lengths, strict=True):
            attributes = {"embedsvc.batch_size": out.batch_size} if name.endswith("compute") \
                else None
            self._child(name, parent, start, start + seconds, clock, attributes)
            start += seconds
        self._child("embedsvc.serialize", parent, call.answered_at, done, clock, None)

    def _child(self, name: str, parent: Any, start: float, end: float, clock: int,
               attributes: dict[str, Any] | None) -> None:
        child = self.tracer.start_span(name, context=parent, start_time=_ns(start, clock),
                                       attributes=attributes)
        child.end(end_time=_ns(end, clock))


def _attributes(call: TracedCall, status: int) -> dict[str, Any]:
    """The server span's attributes once the request is answered."""
    out: dict[str, Any] = {"http.response.status_code": status}
    model = (call.chosen or call.service).model  # with several models, the one chosen
    if model is not None:
        out["embedsvc.model"] = model.name
    work, answer = call.ran, call.answer
    tenant = getattr(call, "tenant", None) or (work.tenant if work is not None else None)
    if tenant:
        out["embedsvc.tenant"] = tenant
    if work is not None:
        out["embedsvc.kind"] = work.kind
        out["embedsvc.inputs"] = work.count
    if answer is not None:
        out["embedsvc.tokens"] = answer.tokens
        out["embedsvc.batch_size"] = answer.batch_size
    return out


def _error_event(error: BaseException) -> dict[str, str]:
    """An error as a span event: its class and the message its client got, never the
    traceback (the SDK's ``record_exception`` sends the server's file paths)."""
    return {"exception.type": type(error).__name__,
            "exception.message": _error_message(error, 500)}


def _error_message(error: BaseException | None, status: int) -> str:
    if isinstance(error, ApiError):
        return error.message
    return f"status {status}" if error is None else "an unexpected error (see the log)"


def _carrier(environ: dict[str, Any]) -> dict[str, str]:
    """The W3C trace-context headers of a WSGI request, as the propagator reads them; a
    ``tracestate`` not of W3C's form is left out (the propagator would log it whole)."""
    out = {}
    parent = environ.get("HTTP_TRACEPARENT")
    if parent:
        out["traceparent"] = parent
        state = environ.get("HTTP_TRACESTATE")
        if state and _valid_tracestate(state):
            out["tracestate"] = state
    return out


def _valid_tracestate(value: str) -> bool:
    if len(value) > _TRACESTATE_CHARS:
        return False
    members = [m.strip(" \t") for m in value.split(",")]
    return len(members) <= 32 and all(not m or _MEMBER.fullmatch(m) for m in members)


def _ns(monotonic: float, clock: int) -> int:
    return int(monotonic * 1e9) + clock
