"""api/tracing.py: the span of each request (the caller's trace continued, the stages as its
children, the attributes), OTLP_ENDPOINT and OpenTelemetry's own variables, and nothing of
OpenTelemetry imported or done while no endpoint is set. tests/integration/test_traces.py
receives the spans over OTLP/HTTP from real servers."""

from __future__ import annotations

import contextlib
import gzip
import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from embedsvc.api.tracing import MISSING_EXTRA, Tracing
from embedsvc.api.web import Call, Reply, Route
from embedsvc.api.wsgi import Pipeline
from embedsvc.cli import main
from embedsvc.model.fake import FakeEncoder
from embedsvc.serving.preflight import PreflightError
from embedsvc.serving.process import LazyApp
from embedsvc.settings import Settings, SettingsError

from .conftest import make_app

TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER = "b7ad6b7169203331"
PARENT = {"traceparent": f"00-{TRACE}-{CALLER}-01", "tracestate": "vendor=1"}
STAGES = ["embedsvc.admission", "embedsvc.tokenize", "embedsvc.queue", "embedsvc.compute",
          "embedsvc.serialize"]


def traced(app) -> InMemorySpanExporter:
    """Spans of ``app``'s requests, kept in memory instead of sent."""
    exporter = InMemorySpanExporter()
    app.wsgi_app.tracing = Tracing("http://127.0.0.1:9/v1/traces", exporter=exporter)
    return exporter


def finished(app, exporter: InMemorySpanExporter) -> dict:
    app.wsgi_app.tracing.provider.force_flush()
    spans = exporter.get_finished_spans()
    app.wsgi_app.tracing.shutdown()
    return {s.name: s for s in spans}


def test_a_request_continues_the_callers_trace_with_its_stages_as_children(registry):
    app = make_app(FakeEncoder(dimension=8, delay_s=0.02), registry)
    exporter = traced(app)
    resp = app.test_client().post("/v1/embeddings", headers=PARENT,
                                  json={"input": ["one text", "and another"], "model": "m"})
    assert resp.status_code == 200
    spans = finished(app, exporter)
    server = spans.pop("POST /v1/embeddings")
    assert format(server.context.trace_id, "032x") == TRACE
    assert format(server.parent.span_id, "016x") == CALLER and server.parent.is_remote
    assert server.context.trace_state.get("vendor") == "1"
    assert server.kind.name == "SERVER"
    assert dict(server.attributes) == {
        "http.request.method": "POST", "http.route": "/v1/embeddings",
        "url.path": "/v1/embeddings", "http.response.status_code": 200,
        "embedsvc.model": "fake", "embedsvc.kind": "embed", "embedsvc.inputs": 2,
        "embedsvc.tokens": int(resp.headers["x-compute-tokens"]), "embedsvc.batch_size": 2}
    assert sorted(spans) == sorted(STAGES)
    for child in spans.values():
        assert child.context.trace_id == server.context.trace_id
        assert child.parent.span_id == server.context.span_id
        assert server.start_time <= child.start_time <= child.end_time <= server.end_time
    ordered = [spans[name] for name in STAGES]
    assert all(a.end_time <= b.start_time for a, b in zip(ordered, ordered[1:], strict=False))
    assert spans["embedsvc.compute"].attributes["embedsvc.batch_size"] == 2
    # their lengths are the timings the answer reports
    ms = {name: (s.end_time - s.start_time) / 1e6 for name, s in spans.items()}
    assert ms["embedsvc.compute"] == pytest.approx(float(resp.headers["x-inference-time"]),
                                                   abs=0.01)
    assert ms["embedsvc.compute"] >= 20  # the fake device's 20 ms
    assert ms["embedsvc.admission"] + ms["embedsvc.queue"] == pytest.approx(
        float(resp.headers["x-queue-time"]), abs=0.01)
    assert ms["embedsvc.tokenize"] == pytest.approx(
        float(resp.headers["x-tokenization-time"]), abs=0.01)


def test_a_request_without_traceparent_starts_a_trace(registry):
    app = make_app(FakeEncoder(dimension=8), registry)
    exporter = traced(app)
    assert app.test_client().post("/embed", json={"inputs": "hi"}).status_code == 200
    spans = finished(app, exporter)
    server = spans["POST /embed"]
    assert server.parent is None and server.context.trace_id != int(TRACE, 16)
    assert {s.context.trace_id for s in spans.values()} == {server.context.trace_id}


def test_an_error_is_recorded_on_the_span_with_its_status(registry):
    app = make_app(FakeEncoder(dimension=8), registry)
    exporter = traced(app)
    resp = app.test_client().post("/v1/embeddings", headers=PARENT,
                                  json={"input": [], "model": "m"})
    assert resp.status_code == 400
    (server,) = finished(app, exporter).values()  # no stage ran
    assert server.attributes["http.response.status_code"] == 400
    assert server.attributes["error.type"] == "empty_input"
    assert [e.name for e in server.events] == ["exception"]
    (event,) = server.events  # the class and the client's message, no traceback
    assert dict(event.attributes) == {"exception.type": "InvalidRequest",
                                      "exception.message": resp.json["error"]["message"]}
    assert server.status.status_code.name == "UNSET"  # a client's error, not the server's


def test_an_unexpected_error_is_a_500_and_an_error_span(registry):
    def broken(call: Call) -> Reply:
        raise RuntimeError("boom")

    app = make_app(FakeEncoder(dimension=8), registry)
    pipeline = Pipeline(app.extensions["embedsvc"], app.wsgi_app.fallback,
                        [Route("/broken", "POST", broken, "fails")])
    app.wsgi_app = pipeline
    exporter = traced(app)
    assert app.test_client().post("/broken", json={}).status_code == 500
    (server,) = finished(app, exporter).values()
    assert server.status.status_code.name == "ERROR"
    assert server.attributes["error.type"] == "RuntimeError"
    assert server.attributes["http.response.status_code"] == 500
    # nothing of the server's code reaches the collector: no traceback, no file path, not
    # even the exception's own text (it may hold anything); the log has them
    (event,) = server.events
    assert dict(event.attributes) == {"exception.type": "RuntimeError",
                                      "exception.message": "an unexpected error (see the log)"}
    assert "boom" not in (server.status.description or "")


def test_the_tenant_of_the_key_is_an_attribute(registry, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\ntenant = "search-team"\nkey = "sk-search"\n')
    app = make_app(FakeEncoder(dimension=8), registry, keys_file=str(keys))
    exporter = traced(app)
    resp = app.test_client().post("/embed", json={"inputs": ["x", "y", "z"]},
                                  headers={"Authorization": "Bearer sk-search"})
    assert resp.status_code == 200
    server = finished(app, exporter)["POST /embed"]
    assert server.attributes["embedsvc.tenant"] == "search-team"
    assert server.attributes["embedsvc.inputs"] == 3
    assert server.attributes["embedsvc.batch_size"] == 3
    assert all("sk-search" not in str(v) for v in server.attributes.values())


def test_a_caller_that_does_not_sample_gets_no_span(registry):
    app = make_app(FakeEncoder(dimension=8), registry)
    exporter = traced(app)
    unsampled = {"traceparent": f"00-{TRACE}-{CALLER}-00"}
    assert app.test_client().post("/embed", json={"inputs": "hi"},
                                  headers=unsampled).status_code == 200
    assert finished(app, exporter) == {}


def test_the_endpoint_setting_and_opentelemetrys_own_variables():
    assert Settings().otlp_endpoint == ""
    assert Settings(otlp_endpoint="http://collector:4318").otlp_endpoint == \
        "http://collector:4318/v1/traces"
    assert Settings(otlp_endpoint="https://c/otlp/v1/traces/").otlp_endpoint == \
        "https://c/otlp/v1/traces/"
    for bad in ("collector:4318", "grpc://c:4317", "http://"):
        with pytest.raises(SettingsError, match="OTLP_ENDPOINT"):
            Settings(otlp_endpoint=bad)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://base:4318/"}
    assert Settings.from_env(env).otlp_endpoint == "http://base:4318/v1/traces"
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "http://traces:4318/custom"
    assert Settings.from_env(env).otlp_endpoint == "http://traces:4318/custom"
    env["EMBEDSVC_OTLP_ENDPOINT"] = "http://own:4318"
    assert Settings.from_env(env).otlp_endpoint == "http://own:4318/v1/traces"
    # a child process (engine, front) reads back the same endpoint
    again = Settings.from_env(Settings.from_env(env).to_env())
    assert again.otlp_endpoint == "http://own:4318/v1/traces"


def test_without_an_endpoint_nothing_of_opentelemetry_is_imported():
    code = textwrap.dedent("""
        import sys
        from embedsvc.api.wsgi import create_app
        from embedsvc.model.fake import FakeEncoder
        from embedsvc.serving.process import LazyApp
        from embedsvc.settings import Settings
        app = create_app(Settings(), encoder=FakeEncoder(dimension=4))
        app.extensions["embedsvc"].start(background=False)
        assert app.test_client().post("/embed", json={"inputs": "hi"}).status_code == 200
        LazyApp(env={})
        assert app.wsgi_app.tracing is None
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PATH": "", "HF_HUB_OFFLINE": "1"})
    assert out.stdout.strip() == "[]", out.stdout


def test_traces_asked_for_without_the_extra_is_one_line(monkeypatch, capsys, registry):
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # as if not installed
    assert main(["serve", "--port", "0", "--otlp-endpoint", "http://127.0.0.1:4318"]) == 2
    err = capsys.readouterr().err
    assert err == f"embedsvc: {MISSING_EXTRA}\n" and "embedsvc[otel]" in err
    with pytest.raises(PreflightError, match=r"embedsvc\[otel\]"):
        LazyApp(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    with pytest.raises(SettingsError, match=r"embedsvc\[otel\]"):
        make_app(FakeEncoder(dimension=8), registry, otlp_endpoint="http://127.0.0.1:4318")


def test_a_tracestate_not_of_w3cs_form_is_dropped_without_a_word(registry, caplog):
    """A 7 KB malformed tracestate logged a 7,048-character warning per request; it is
    dropped (the trace goes on from traceparent), and a valid one is kept."""
    app = make_app(FakeEncoder(dimension=8), registry)
    exporter = traced(app)
    client = app.test_client()
    with caplog.at_level(logging.DEBUG):
        for state in ("x" * 7000, "a=1," * 200, "UPPER=1", "k=" + "v" * 300):
            headers = {"traceparent": PARENT["traceparent"], "tracestate": state}
            assert client.post("/embed", headers=headers, json={"inputs": "hi"}).status_code \
                == 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    headers = {"traceparent": PARENT["traceparent"], "tracestate": "a=1, tenant@sys=x y,b=2"}
    assert client.post("/embed", headers=headers, json={"inputs": "hi"}).status_code == 200
    spans = [s for s in exporter_spans(app, exporter) if s.name == "POST /embed"]
    assert len(spans) == 5
    assert all(format(s.context.trace_id, "032x") == TRACE for s in spans)
    assert [len(s.context.trace_state) for s in spans] == [0, 0, 0, 0, 3]


def exporter_spans(app, exporter: InMemorySpanExporter) -> list:
    app.wsgi_app.tracing.provider.force_flush()
    spans = list(exporter.get_finished_spans())
    app.wsgi_app.tracing.shutdown()
    return spans


@contextmanager
def collector(answer: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[str]:
    """An OTLP/HTTP collector stand-in on loopback whose every answer is ``answer``."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            answer(self)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    finally:
        server.shutdown()
        server.server_close()


def test_a_collectors_answer_is_read_bounded_and_never_decompressed(tmp_path):
    """A 1 MB gzip answer that inflates to 1 GiB took a serving process from 217 to
    3,303 MiB; the exporter reads 4 KiB of it, as sent."""
    member = gzip.compress(bytes(16 << 20), compresslevel=9)  # 16 MiB of zeros, ~16 KB
    bomb = member * 64  # one gzip stream of 64 members: 1 GiB inflated

    def gzip_bomb(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(400)
        handler.send_header("Content-Encoding", "gzip")
        handler.send_header("Content-Length", str(len(bomb)))
        handler.end_headers()
        with contextlib.suppress(OSError):
            handler.wfile.write(bomb)

    code = textwrap.dedent("""
        import resource, sys
        from embedsvc.api.tracing import Tracing
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tracing = Tracing(sys.argv[1], drain_timeout_s=10)
        tracing.tracer.start_span("one").end()
        tracing.provider.force_flush()
        tracing.shutdown()
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(grew // 1024)
    """)
    with collector(gzip_bomb) as url:
        out = subprocess.run([sys.executable, "-c", code, url], capture_output=True,
                             text=True, check=True, timeout=120)
    assert int(out.stdout.strip()) < 64, out.stdout + out.stderr  # MiB grown; was ~1 GiB


def test_the_last_spans_wait_for_a_collector_that_never_answers_at_most_the_drain_time():
    """A collector that accepts and never answers held the process 32 s past its drain
    (DRAIN_TIMEOUT_S=5); the flush now gives up at the drain's time."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # connections complete, nobody ever answers
    try:
        tracing = Tracing(f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces",
                          drain_timeout_s=1.0)
        tracing.tracer.start_span("one").end()
        started = time.monotonic()
        assert not tracing.shutdown()
        assert time.monotonic() - started < 3.0  # the drain's 1 s, and a margin
    finally:
        listener.close()
