"""One request cannot freeze or exhaust the server (issue 26): each attack against a live
`embedsvc serve` process, with bounds on the CPU time it costs the server (its answer time
on a busy machine measures the machine) and on the peak growth of the server's resident
memory (VmHWM, reset before each attack)."""

from __future__ import annotations

import math
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from embedsvc.api.routes import ROUTES
from embedsvc.api.schemas import (
    CohereRerankRequest,
    EmbedRequest,
    EmbedSparseRequest,
    PredictRequest,
    RerankRequest,
)

from .. import loopback
from ..fakes import GatedEncoder
from ..lists import invalid_lists, list_fields
from .conftest import SERVE, kind_server
from .fake_server import fake_server, healthy_answer
from .servers import Server

MB = 1 << 20


class PeakMemory:
    """The peak growth of a process's resident memory since ``reset`` (Linux)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.base = 0

    def _status(self, key: str) -> int:
        text = Path(f"/proc/{self.pid}/status").read_text()
        return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024

    def reset(self) -> None:
        # "5": the high-water mark restarts from the current resident size (proc(5))
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        self.base = self._status("VmRSS")

    def growth(self) -> int:
        return self._status("VmHWM") - self.base


def cpu_seconds(pid: int) -> float:
    """The CPU time a process has used (user and system, proc(5)): what an attack costs the
    server, whatever else the machine runs meanwhile (its wall time is not)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def embedding(shared) -> Iterator[Server]:
    """The run's `embedsvc serve` with a probe port, no other test's traffic on it meanwhile."""
    server = shared.get("probed", SERVE, env={"EMBEDSVC_HEALTH_PORT": "0"})
    with shared.use("probed", exclusive=True):
        server.memory = PeakMemory(server.pid)  # type: ignore[attr-defined]
        yield server


@pytest.fixture
def kinds(kind_dirs, shared) -> Iterator[dict[str, Server]]:
    """The run's reranker and sparse servers, no other test's traffic on them meanwhile."""
    started = {kind: kind_server(shared, kind_dirs, kind) for kind in ("reranker", "sparse")}
    with shared.use(*started, exclusive=True):
        for server in started.values():
            server.memory = PeakMemory(server.pid)  # type: ignore[attr-defined]
        yield started


def post(server: Server, route: str, body: bytes, timeout: float = 120) -> tuple[int, dict,
                                                                              float]:
    started = time.monotonic()
    resp = loopback.post(server.url + route, content=body, timeout=timeout,
                         headers={"Content-Type": "application/json"})
    return resp.status_code, resp.json(), time.monotonic() - started


def all_at_once(work, n: int) -> list:
    results: list = [None] * n
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        barrier.wait(30)
        results[i] = work(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


INVALID_LIST = orjson.dumps({"inputs": [1] * 999_999 + [1.5]})  # 2 MB
# A body just over the lane's size that parses in about a millisecond (api/lane.py)
CHEAP_LARGE = orjson.dumps({"inputs": "x" * (1 << 20)})


def lane_opened(server: Server) -> None:
    """Waits for the body lane to open: a large body parsed by an earlier test keeps it shut
    for three times its parse. This one takes its turn, parses in about a millisecond and
    is refused (too long); the lane is open again right after it."""
    status, answer, _ = post(server, "/embed", CHEAP_LARGE)
    assert status == 400 and answer["error"]["code"] == "input_too_long", answer


def test_a_huge_invalid_list_is_refused_at_once_and_the_probes_keep_answering(embedding):
    probe = embedding.probe_url() + "/health"
    slowest: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            started = time.monotonic()
            assert loopback.get(probe, timeout=5).status_code == 200
            slowest.append(time.monotonic() - started)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    lane_opened(embedding)
    embedding.memory.reset()
    watcher.start()
    spent = cpu_seconds(embedding.pid)
    try:
        status, body, _ = post(embedding, "/embed", INVALID_LIST)
    finally:
        stop.set()
        watcher.join(10)
    spent = cpu_seconds(embedding.pid) - spent
    assert status == 400, body
    assert "item 999999 is a number (1.5)" in body["error"]["message"]
    assert spent < 0.5, spent  # it cost 8 CPU-s
    assert embedding.memory.growth() < 100 * MB
    # The slowest probe took 0.025-0.056 s under four busy loops at a higher priority
    # (bench/RESULTS.md); the type check's slices let the probe threads run between them.
    assert slowest and max(slowest) < 0.5, max(slowest)


def test_an_attacker_sending_invalid_lists_for_30s_fails_no_health_probe(embedding):
    probe = embedding.probe_url() + "/health"
    stop = threading.Event()
    sent: list[int] = []

    def attack() -> None:
        with loopback.Client(timeout=30) as client:
            while not stop.is_set():
                sent.append(client.post(embedding.url + "/embed", content=INVALID_LIST,
                                        headers={"Content-Type": "application/json"})
                            .status_code)

    attacker = threading.Thread(target=attack)
    attacker.start()
    failed = []
    try:
        end = time.monotonic() + 30
        while time.monotonic() < end:
            started = time.monotonic()
            try:  # a kubelet probe with timeoutSeconds: 1
                if loopback.get(probe, timeout=1).status_code != 200:
                    failed.append("status")
            except httpx.TimeoutException:
                failed.append("timeout")
            time.sleep(max(0.0, 1 - (time.monotonic() - started)))
    finally:
        stop.set()
        attacker.join(30)
    assert not failed, failed
    assert len(sent) > 10 and set(sent) == {400}


@pytest.fixture
def every_kind(embedding, kind_dirs, shared) -> Iterator[dict[str, Server]]:
    """The run's server of each kind, with probe ports, no other test's traffic meanwhile."""
    started = {kind: kind_server(shared, kind_dirs, kind)
               for kind in ("reranker", "classifier", "sparse")}
    with shared.use(*started, exclusive=True):
        for server in started.values():
            server.memory = PeakMemory(server.pid)  # type: ignore[attr-defined]
        yield {"embedding": embedding, **started}


MAIN_ROUTE = {"embedding": EmbedRequest, "reranker": RerankRequest,
              "classifier": PredictRequest, "sparse": EmbedSparseRequest}


def parsed_by(kind: str) -> list[tuple[str, type, tuple[str, ...]]]:
    """(route, request model, list field) for every list field a server of ``kind`` parses:
    its routes' models (routes of every kind on the embedding server), its main route's,
    and Cohere's shape that /rerank also reads."""
    routes = [(r.path, r.request) for r in ROUTES if r.request is not None and (
        kind in r.kinds if r.kinds else kind == "embedding")]
    routes.append(("/", MAIN_ROUTE[kind]))
    routes += {"embedding": [("/invocations", EmbedRequest)],
               "reranker": [("/rerank", CohereRerankRequest)]}.get(kind, [])
    return [(path, model, field) for path, model in routes for field in list_fields(model)]


class Prober:
    """GETs /health on each probe port in turn, as a kubelet does (timeoutSeconds: 1)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls, self.sent, self.missed = urls, 0, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self.stop.is_set():
            for url in self.urls:
                try:
                    if loopback.get(url, timeout=1).status_code != 200:
                        self.missed.append((url, "status"))
                except httpx.TimeoutException:
                    self.missed.append((url, "timeout"))
                self.sent += 1
            time.sleep(0.1)

    def __enter__(self) -> Prober:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def test_2_mb_invalid_lists_on_every_list_field_of_every_family_cost_little(every_kind):
    """Issue 41: 1-2 MB invalid lists in Cohere's texts and embedding_types and Ollama's input
    held the GIL 1.6-4.7 CPU-s and added 0.5-0.9 GiB, and readiness probes failed. Every list
    field of every route, each server of its kind: 400 (/decode: 413 past the ids it decodes
    at once), under 0.5 CPU-s of the server and 100 MiB of its memory each, and no probe
    misses meanwhile."""
    wrong = []
    probes = [server.probe_url() + "/health" for server in every_kind.values()]
    with Prober(probes) as prober:
        for kind, server in every_kind.items():
            for route, model, field in parsed_by(kind):
                for label, body in invalid_lists(model, field):
                    # the process's CPU counts its other threads too (the probes, the
                    # watchdog), more as a loaded machine stretches the request: a case over
                    # the bound is measured again, and its cost is the least seen
                    spent = math.inf
                    for _ in range(3):
                        server.memory.reset()
                        before = cpu_seconds(server.pid)
                        status, answer, _ = post(server, route, body)
                        spent = min(spent, cpu_seconds(server.pid) - before)
                        grew = server.memory.growth()
                        if spent < 0.5:
                            break
                    refused = status == 400 or answer["error"]["code"] == "too_many_ids"
                    if not refused or spent >= 0.5 or grew >= 100 * MB:
                        wrong.append(f"{kind} {route} {'.'.join(field)} ({label}): {status}, "
                                     f"{spent:.2f} CPU-s, {grew / MB:.0f} MiB: {answer}")
    assert not wrong, "\n".join(wrong)
    assert prober.sent > 10 and not prober.missed, (prober.sent, prober.missed)


def test_a_big_query_rerank_is_windowed(kinds):
    server = kinds["reranker"]
    server.memory.reset()
    spent = cpu_seconds(server.pid)
    status, body, _ = post(server, "/rerank",
                           orjson.dumps({"query": "!" * 199_990, "texts": ["a"] * 192}))
    spent = cpu_seconds(server.pid) - spent
    assert status == 200, body
    assert len(body) == 192 and spent < 2, spent  # it cost 78 CPU-s
    assert server.memory.growth() < 300 * MB


def test_three_16_mb_document_bodies_at_once_stay_bounded(kinds):
    server = kinds["reranker"]
    doc = "many words in a long document " * 266  # 7,980 characters
    body = orjson.dumps({"query": "which document?", "documents": [doc] * 2048})
    assert 15 * MB < len(body) < 16 * MB
    server.memory.reset()
    answers = all_at_once(lambda i: post(server, "/v1/rerank", body), 3)
    assert [status for status, _, _ in answers] == [200] * 3, answers[0][1]
    assert all(len(answer["results"]) == 2048 for _, answer, _ in answers)
    assert server.memory.growth() < 1536 * MB


def test_twelve_16_mb_decode_bodies_at_once_stay_bounded(embedding):
    body = orjson.dumps({"ids": [[1] * 4090] * 2048})  # 8.4M ids
    assert 15 * MB < len(body) < 16 * MB
    embedding.memory.reset()
    answers = all_at_once(lambda i: post(embedding, "/decode", body), 12)
    # More ids than MAX_QUEUE_TOKENS (1,048,576) decode at once: refused before decoding.
    # The bodies parse one at a time, each about 0.25 s (a refused one shuts the lane for
    # no longer); five at most are in the lane (the rest get 429 unparsed), and one whose
    # turn would come after its deadline gets 504 unparsed.
    refused = [a for status, a, _ in answers if status == 413]
    unparsed = [a for status, a, _ in answers if status in (429, 504)]
    assert refused and len(refused) + len(unparsed) == 12, answers
    error = refused[0]["error"]
    assert error["code"] == "too_many_ids" and "MAX_QUEUE_TOKENS, 1048576" in error["message"]
    assert all("parsed" in a["error"]["message"] and "one at a time" in a["error"]["message"]
               for a in unparsed)
    assert embedding.memory.growth() < 1536 * MB
    # The largest that is decoded, twelve at once: admitted one at a time on the host's
    # budget; those still waiting at their deadline get 504, those past the body lane's
    # waiting room 429, none is cut off another way
    body = orjson.dumps({"ids": [[1] * 4090] * 256})  # 1,047,040 ids
    answers = all_at_once(lambda i: post(embedding, "/decode", body), 12)
    assert {status for status, _, _ in answers} <= {200, 429, 504}, answers[0][1]
    assert 200 in {status for status, _, _ in answers}
    assert all(len(texts) == 256 for status, texts, _ in answers if status == 200)
    assert embedding.memory.growth() < 1536 * MB
    status, texts, _ = post(embedding, "/decode", orjson.dumps({"ids": [[7592, 2088]]}))
    assert (status, texts) == (200, ["hello world"])


def test_embed_all_over_its_cap_is_refused_with_the_cap(embedding):
    status, body, _ = post(embedding, "/embed_all", orjson.dumps({"inputs": ["!" * 254] * 33}))
    assert status == 400 and body["error"]["code"] == "too_many_inputs"
    assert "(32)" in body["error"]["message"] and "/embed" in body["error"]["message"]
    status, rows, _ = post(embedding, "/embed_all", orjson.dumps({"inputs": ["!" * 254] * 32}))
    assert status == 200 and [len(r) for r in rows] == [256] * 32


def test_embed_all_drops_a_departed_client_and_keeps_its_deadline():
    fake = GatedEncoder()
    computed: list[int] = []
    encode_tokens = fake.encode_tokens

    def counted(batch):
        computed.append(len(batch))
        return encode_tokens(batch)

    fake.encode_tokens = counted  # type: ignore[method-assign]
    with fake_server(fake, request_timeout_s=1.5) as server:
        fake.hold()  # the device stays busy with a batch of /embed
        first = threading.Thread(target=lambda: loopback.post(
            server.url + "/embed", json={"inputs": "holds the device"}, timeout=30))
        first.start()
        assert fake.entered.wait(5)
        body = orjson.dumps({"inputs": ["goodbye"] * 5})
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /embed_all HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.3)  # waiting for the device
        sock.close()
        started = time.monotonic()
        late = loopback.post(server.url + "/embed_all", json={"inputs": ["late"]}, timeout=30)
        waited = time.monotonic() - started
        fake.gate.set()
        first.join(10)
        assert late.status_code == 504 and waited < 2.5, (late.text, waited)
        dropped = {reason: server.registry.get_sample_value(
            "embedsvc_dropped_inputs_total", {"reason": reason}) for reason in
            ("disconnected", "timeout")}
        assert dropped == {"disconnected": 5, "timeout": 1}
        assert computed == []
        healthy_answer(server, fake)


def test_a_16_kb_sparse_request_stays_under_1_gb(kinds):
    server = kinds["sparse"]
    server.memory.reset()
    status, body, _ = post(server, "/embed_sparse", orjson.dumps({"inputs": ["!" * 126] * 128}))
    assert status == 200 and len(body) == 128
    assert server.memory.growth() < 1024 * MB


def test_a_16_mb_body_of_openai_ids_is_refused_fast(embedding):
    body = orjson.dumps({"input": [[58040] * 1364] * 2048})  # cl100k 58040: 128 spaces
    assert len(body) < 16 * MB
    lane_opened(embedding)
    spent = cpu_seconds(embedding.pid)
    status, answer, _ = post(embedding, "/v1/embeddings", body)
    spent = cpu_seconds(embedding.pid) - spent
    assert status == 400 and answer["error"]["code"] == "input_too_long", answer
    assert "MAX_BODY_BYTES" in answer["error"]["message"]
    assert spent < 2, spent  # it cost 45 CPU-s
