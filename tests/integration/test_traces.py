"""Traces over real OTLP/HTTP (issue 42): a receiver in the test decodes what each way of
serving exports (``embedsvc serve``, with ``--workers 2``, ``waitress-serve`` and
``gunicorn --preload -w 2`` on the bundled model), for a request that carries a W3C
``traceparent`` and one that does not."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from .. import loopback
from .servers import FAKE_EMBEDSVC, running, stop

REPO = Path(__file__).resolve().parents[2]
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"
STAGES = ["embedsvc.admission", "embedsvc.tokenize", "embedsvc.queue", "embedsvc.compute",
          "embedsvc.serialize"]
DELAY_S = 0.05  # the fake device's time per batch
FAKE = {"FAKE_SERVE_DELAY_S": str(DELAY_S)}
LAUNCHES: dict[str, tuple[list[str], dict[str, str]]] = {
    "embedsvc-serve": ([*FAKE_EMBEDSVC, "serve", "--port", "0"], FAKE),
    "workers-2": ([*FAKE_EMBEDSVC, "serve", "--port", "0", "--workers", "2"], FAKE),
    "waitress-serve": (["waitress-serve", "--host=127.0.0.1", "--port=0",
                        "tests.integration.fake_app:app"], {}),
    # the bundled model, in one engine process fed by two forked workers
    "gunicorn-preload": (["gunicorn", "--preload", "-w", "2", "-b", "127.0.0.1:0",
                          "--no-control-socket", "embedsvc:app"], {}),
}


def _value(any_value: Any) -> Any:
    return getattr(any_value, any_value.WhichOneof("value"))


class Receiver:
    """An OTLP/HTTP collector on loopback: every span of every POST /v1/traces, decoded."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.posts = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces" and \
                    self.headers["Content-Type"] == "application/x-protobuf"
                if ok:
                    receiver.take(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def take(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    found.append({
                        "name": span.name, "trace": span.trace_id.hex(), "id": span.span_id.hex(),
                        "parent": span.parent_span_id.hex(), "kind": span.kind,
                        "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                        "attributes": {a.key: _value(a.value) for a in span.attributes},
                        "trace_state": span.trace_state, "resource": resource})
        with self._lock:
            self.posts += 1
            self.spans.extend(found)

    def wait(self, count: int, timeout: float = 30) -> list[dict[str, Any]]:
        """The spans once ``count`` have arrived, and a moment longer for any more."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.spans) >= count:
                    break
            time.sleep(0.05)
        time.sleep(0.3)  # several times the exporter's schedule: nothing else is on its way
        with self._lock:
            assert len(self.spans) >= count, f"{len(self.spans)} of {count} spans: {self.spans}"
            return list(self.spans)


@contextmanager
def receiving() -> Iterator[Receiver]:
    receiver = Receiver()
    thread = threading.Thread(target=receiver.server.serve_forever, name="test-otlp")
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
        thread.join(5)


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_each_way_of_serving_exports_the_callers_trace_with_its_stages(launch, tmp_path):
    cmd, env = LAUNCHES[launch]
    with receiving() as receiver:
        env = {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
               "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_SERVICE_NAME": f"embedsvc-{launch}"}
        with running(cmd, tmp_path / "server.log", env=env, cwd=str(REPO)) as server:
            if launch in ("gunicorn-preload", "workers-2"):
                server.wait_fronts(2)  # /info from either names the model
            texts = ["the first text", "a second one", "and a third"]
            resp = loopback.post(server.url + "/v1/embeddings", timeout=60, json={
                "input": texts, "model": "m"}, headers={
                "traceparent": f"00-{TRACE}-{CALLER}-01", "tracestate": "congo=t61rcWkgMzE"})
            assert resp.status_code == 200, resp.text
            plain = loopback.post(server.url + "/embed", json={"inputs": "no parent"},
                                  timeout=60)
            assert plain.status_code == 200
            about = loopback.get(server.url + "/info", timeout=30).json()
            spans = receiver.wait(2 * (1 + len(STAGES)) + 1)  # /info's too
            master = server.pid
            workers = children(master)
    ours = [s for s in spans if s["trace"] == TRACE]
    server_span = next(s for s in ours if s["name"] == "POST /v1/embeddings")
    assert server_span["parent"] == CALLER and server_span["kind"] == 2  # SPAN_KIND_SERVER
    assert server_span["trace_state"] == "congo=t61rcWkgMzE"
    attributes = server_span["attributes"]
    assert attributes == {
        "http.request.method": "POST", "http.route": "/v1/embeddings",
        "url.path": "/v1/embeddings", "http.response.status_code": 200,
        "embedsvc.model": about["model_id"], "embedsvc.kind": "embed", "embedsvc.inputs": 3,
        "embedsvc.tokens": int(resp.headers["x-compute-tokens"]), "embedsvc.batch_size": 3}
    stages = {s["name"]: s for s in ours if s is not server_span}
    assert sorted(stages) == sorted(STAGES)
    for stage in stages.values():
        assert stage["parent"] == server_span["id"]
        assert server_span["start"] <= stage["start"] <= stage["end"] <= server_span["end"]
    assert stages["embedsvc.compute"]["attributes"] == {"embedsvc.batch_size": 3}
    compute_ms = (stages["embedsvc.compute"]["end"] - stages["embedsvc.compute"]["start"]) / 1e6
    assert compute_ms == pytest.approx(float(resp.headers["x-inference-time"]), abs=0.01)
    if LAUNCHES[launch][1] is FAKE:  # the fake device's time
        assert compute_ms >= DELAY_S * 1000
    # a request without traceparent starts a trace of its own
    root = next(s for s in spans if s["name"] == "POST /embed")
    assert root["parent"] == "" and root["trace"] != TRACE
    assert sum(s["trace"] == root["trace"] for s in spans) == 1 + len(STAGES)
    # /info has a span of its own, without stages; probes (/health) have none
    assert sorted(s["name"] for s in spans if not s["name"].startswith("embedsvc.")) == [
        "GET /info", "POST /embed", "POST /v1/embeddings"]
    # each process that serves exports its own spans: never the gunicorn master or the
    # supervisor, which serve nothing
    resource = server_span["resource"]
    assert resource["service.name"] == f"embedsvc-{launch}"
    if launch in ("gunicorn-preload", "workers-2"):
        assert resource["process.pid"] != master and resource["process.pid"] in workers


def test_the_spans_still_buffered_at_a_drain_are_exported(tmp_path):
    """A long export schedule, then SIGTERM: the drain ends with the exporter's flush."""
    cmd, env = LAUNCHES["embedsvc-serve"]
    with receiving() as receiver:
        env = {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
               "OTEL_BSP_SCHEDULE_DELAY": "600000"}
        with running(cmd, tmp_path / "server.log", env=env, cwd=str(REPO)) as server:
            resp = loopback.post(server.url + "/embed", json={"inputs": "last one"}, timeout=60)
            assert resp.status_code == 200
            time.sleep(0.5)
            assert receiver.spans == []  # still in the exporter's buffer
            assert stop(server.proc) == 0
        names = sorted(s["name"] for s in receiver.wait(1 + len(STAGES)))
    assert names == sorted(["POST /embed", *STAGES])
