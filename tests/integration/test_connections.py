"""Hostile connections against the launchers embedsvc bounds: `embedsvc serve` (waitress) and
gunicorn with deploy/gunicorn.conf.py. Raw sockets play the slow and odd clients."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from embedsvc.model.fake import FakeEncoder

from .. import loopback
from .fake_server import fake_server
from .servers import FAKE_EMBEDSVC, Server, running

REPO = Path(__file__).parents[2]
MiB = 1 << 20
HEADER_TIMEOUT_S = 2
BOUNDS = {
    "EMBEDSVC_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
    "EMBEDSVC_BODY_TIMEOUT_S": "2",
    "EMBEDSVC_MAX_BODY_BYTES": str(4 * MiB),
    "EMBEDSVC_HEALTH_PORT": "0",
}
LAUNCHERS = {
    "serve": ["embedsvc", "serve", "--port", "0"],
    "gunicorn-conf": ["gunicorn", "-b", "127.0.0.1:0", "--no-control-socket",
                      "-c", str(REPO / "deploy" / "gunicorn.conf.py"), "embedsvc:app"],
}


# The same launchers around the fake encoder: what these tests look at is the HTTP server.
FAKE_LAUNCHERS = {
    "serve": [*FAKE_EMBEDSVC, *LAUNCHERS["serve"][1:]],
    "gunicorn-conf": [*LAUNCHERS["gunicorn-conf"][:-1], "tests.integration.fake_app:app"],
}


@pytest.fixture(scope="module", params=sorted(LAUNCHERS))
def bounded(request, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp(request.param) / "server.log"
    with running(FAKE_LAUNCHERS[request.param], log, env=BOUNDS, cwd=str(REPO)) as server:
        server.launcher = request.param  # type: ignore[attr-defined]
        yield server


def metric(server: Server, name: str, labels: str = "") -> float:
    text = loopback.get(server.url + "/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def raw_exchange(port: int, data: bytes, *, half_close: bool = False,
                 timeout: float = 15) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` on a fresh connection; the status, headers and body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        with contextlib.suppress(OSError):  # the server may answer and close first
            sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        return read_response(sock, timeout)


def read_response(sock: socket.socket, timeout: float) -> tuple[int, dict[str, str], bytes]:
    sock.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = _recv(sock)
        if not chunk:
            return 0, {}, buf  # closed without an answer
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = _recv(sock)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


def assert_json_error(status: int, headers: dict[str, str], body: bytes, want: int) -> dict:
    assert status == want, (status, headers, body[:300])
    assert headers.get("content-type", "").startswith("application/json"), headers
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


class Flood:
    """``idle`` connections that send nothing and ``slow`` ones trickling a request head."""

    HEAD = b"POST /embed HTTP/1.1\r\nHost: flood\r\nContent-Type: application/json\r\n"

    def __init__(self, port: int, idle: int = 75, slow: int = 75, every_s: float = 0.3) -> None:
        self.port, self.idle, self.slow, self.every_s = port, idle, slow, every_s
        self.socks: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, name="test-flood")

    def __enter__(self) -> Flood:
        for _ in range(self.idle + self.slow):
            self.socks.append(socket.create_connection(("127.0.0.1", self.port), timeout=5))
        self._thread.start()
        return self

    def _trickle(self) -> None:
        for i in range(len(self.HEAD)):  # one byte per connection per tick, then stop
            if self._stop.wait(self.every_s):
                return
            for sock in self.socks[self.idle:]:
                with contextlib.suppress(OSError):  # closed by the server, as it should be
                    sock.send(self.HEAD[i:i + 1])

    def closed_by_server(self) -> int:
        closed = 0
        for sock in self.socks:
            sock.setblocking(False)
            try:
                closed += sock.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        return closed

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for sock in self.socks:
            sock.close()


def test_slow_and_idle_connections_leave_clients_and_probes_served(bounded):
    probes = bounded.probe_url()
    before = metric(bounded, "embedsvc_connections_closed_total", '{reason="header_timeout"}')
    with Flood(bounded.port) as flood:
        time.sleep(2 * flood.every_s)  # every connection open, the slow ones trickling
        with loopback.Client(base_url=bounded.url, timeout=5) as c:  # served within 5 s
            resp = c.post("/embed", json={"inputs": ["served beside a flood"]})
            assert resp.status_code == 200 and len(resp.json()[0]) == 384
            assert c.get("/health").status_code == 200
        assert loopback.get(probes + "/health", timeout=5).status_code == 200
        assert loopback.get(probes + "/metrics", timeout=5).status_code == 200
        deadline = time.monotonic() + HEADER_TIMEOUT_S + 8
        while flood.closed_by_server() < 150 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert flood.closed_by_server() == 150
    after = metric(bounded, "embedsvc_connections_closed_total", '{reason="header_timeout"}')
    assert after - before >= 150


def test_the_probe_port_serves_only_probes(bounded):
    probes = bounded.probe_url()
    resp = loopback.post(probes + "/embed", json={"inputs": "x"}, timeout=5)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
    assert loopback.get(probes + "/info", timeout=5).json()["dimension"] == 384


def fds_to_deleted_files(pid: int) -> list[str]:
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.endswith("(deleted)") and "/wgunicorn-" not in target:  # not its heartbeat
            found.append(target)
    return found


def worker_pid(server: Server) -> int:
    return loopback.get(server.url + "/info", timeout=10).json()["pid"]


def test_a_200_mib_body_gets_413_without_being_buffered(bounded):
    pid = worker_pid(bounded)
    head = (b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (200 * MiB))
    with socket.create_connection(("127.0.0.1", bounded.port), timeout=15) as sock:
        sock.sendall(head)
        sent = 0
        try:
            for _ in range(8):  # keep sending while the answer is on its way
                sock.sendall(b"!" * MiB)
                sent += MiB
        except OSError:
            pass
        status, headers, body = read_response(sock, 15)
        assert fds_to_deleted_files(pid) == []  # nothing spooled to a temporary file
    err = assert_json_error(status, headers, body, 413)
    assert err["code"] == "body_too_large" and str(4 * MiB) in err["message"]


def test_a_chunked_body_is_refused_at_max_body_bytes(bounded):
    head = (b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (MiB, b"!" * MiB)
    sent = 0
    with socket.create_connection(("127.0.0.1", bounded.port), timeout=15) as sock:
        sock.sendall(head)
        try:
            while sent < 200 * MiB:
                sock.sendall(chunk)
                sent += MiB
        except OSError:
            pass  # the server stopped reading and closed
        status, headers, body = read_response(sock, 15)
    assert_json_error(status, headers, body, 413)
    assert sent < 200 * MiB, "the server read the whole 200 MiB"


def test_a_late_body_gets_408(bounded):
    with socket.create_connection(("127.0.0.1", bounded.port), timeout=15) as sock:
        sock.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"inputs\": ")
        status, headers, body = read_response(sock, 15)
    assert assert_json_error(status, headers, body, 408)["code"] == "request_timeout"


# A TLS 1.2 ClientHello (record 0x16 0x03 0x01), as a browser or client sends to https://:
# no line end in it, so a server that waits for one answers nothing until its deadline.
CLIENT_HELLO = bytes.fromhex("160301002d01000029" "0303" + "11" * 32 + "00" "0002c02f" "0100")
MALFORMED = {
    "garbage request line": (b"GARBAGE\r\n\r\n", 400),
    "bare method": (b"GET\r\n\r\n", 400),
    "request line with an extra word": (b"GET / HTTP/1.1 extra\r\nHost: x\r\n\r\n", 400),
    "TLS hello on the plain port": (CLIENT_HELLO, 400),
    "bad content-length": (b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n", 400),
    "huge header": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 300_000
                    + b"\r\n\r\n", 431),
    "unknown transfer coding": (b"POST /embed HTTP/1.1\r\nHost: x\r\n"
                                b"Transfer-Encoding: gzip\r\n\r\n", 501),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_the_http_servers_own_answers_are_json(bounded, case):
    data, want = MALFORMED[case]
    if bounded.launcher == "gunicorn-conf" and case == "unknown transfer coding":
        want = 400  # gunicorn refuses the header itself
    status, headers, body = raw_exchange(bounded.port, data, timeout=5)  # at once
    err = assert_json_error(status, headers, body, want)
    if case == "TLS hello on the plain port":
        assert "not TLS: use http://" in err["message"]


# Requests whose head fails past the request line, on Ollama's routes: its clients read
# {"error": "<message>"}, and the HTTP server's own answer must say it so too
OLLAMA_MALFORMED = {
    "bad content-length": (b"POST /api/embed HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n"
                           b"\r\n", 400),
    "a header line without a colon": (b"POST /api/embed HTTP/1.1\r\nHost: x\r\nNoColon\r\n"
                                      b"Content-Length: 2\r\n\r\n{}", 400),
    "bad chunk size": (b"POST /api/embed HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                       b"\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400),
    "huge header": (b"GET /api/tags HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 300_000
                    + b"\r\n\r\n", 431),
}


@pytest.mark.parametrize("case", sorted(OLLAMA_MALFORMED))
def test_the_http_servers_own_answers_on_ollamas_routes_are_in_ollamas_shape(bounded, case):
    data, want = OLLAMA_MALFORMED[case]
    status, headers, body = raw_exchange(bounded.port, data, timeout=5)
    assert status == want, (status, body[:300])
    assert headers.get("content-type", "").startswith("application/json"), headers
    error = json.loads(body)
    assert set(error) == {"error"} and isinstance(error["error"], str) and error["error"], error


def answers(port: int, *sends: bytes, pause: float = 0.3) -> list[tuple[int, bytes]]:
    """The status and body of each answer on one connection to ``sends`` (``pause`` between
    them), read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for i, data in enumerate(sends):
            if i:
                time.sleep(pause)
            with contextlib.suppress(OSError):
                sock.sendall(data)
        buf = b""
        while chunk := _recv(sock):
            buf += chunk
    out = []
    while b"\r\n\r\n" in buf:
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        fields = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        length = int(fields.get("content-length", "0"))
        out.append((int(lines[0].split()[1]), rest[:length]))
        buf = rest[length:]
    return out


def is_ollamas(body: bytes) -> bool:
    error = json.loads(body)
    return set(error) == {"error"} and isinstance(error["error"], str)


GOOD_TAGS = b"GET /api/tags HTTP/1.1\r\nHost: x\r\n\r\n"
GOOD_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
NO_COLON_EMBED = b"POST /api/embed HTTP/1.1\r\nHost: x\r\nNoColon\r\nContent-Length: 2\r\n\r\n{}"


def test_each_request_on_a_connection_gets_its_own_routes_error_shape(bounded):
    """The shape follows the request that failed, not another on its connection: pipelined
    after one of another family, after a kept-alive one whose bytes came with it, or with
    its request line split over two reads."""
    port = bounded.port

    def last(statuses: list[int], *sends: bytes) -> bytes:
        got = answers(port, *sends)
        assert [status for status, _ in got] == statuses, got
        return got[-1][1]

    too_large = (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n"
                 b"\r\n")
    body = last([200, 413], GOOD_TAGS + too_large)
    assert not is_ollamas(body), body  # an OpenAI route's, though /api/tags came first
    assert is_ollamas(last([200, 400], GOOD_MODELS + NO_COLON_EMBED))
    assert is_ollamas(last([400], NO_COLON_EMBED[:2], NO_COLON_EMBED[2:]))  # "PO", the rest
    assert is_ollamas(last([200, 400], GOOD_MODELS, NO_COLON_EMBED[:2], NO_COLON_EMBED[2:]))
    head = b"HEAD http://x/api/tags HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n"
    assert last([400], head) == b""  # a HEAD's answer carries no body, its head parsed or not


def settled_output(server: Server, quiet: float = 0.5) -> str:
    """The server's log once it has not grown for ``quiet`` seconds."""
    text = server.output()
    while True:
        time.sleep(quiet)
        now = server.output()
        if now == text:
            return text
        text = now


def test_a_half_closed_client_gets_its_answer_or_is_logged_as_departed(bounded):
    body = b'{"inputs": ["half closed after the request"]}'
    request = (b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    log_before = settled_output(bounded)  # the previous test's last line may come late
    got = [raw_exchange(bounded.port, request, half_close=True)[0] for _ in range(6)]
    assert set(got) <= {200, 499}, got
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        new = bounded.output()[len(log_before):]
        # the pipeline's lines (answers of the HTTP server itself carry no input count)
        logged = re.findall(r"POST /embed (\d{3}) inputs=", new)
        if len(logged) >= len(got):
            break
        time.sleep(0.1)
    assert sorted(int(s) for s in logged) == sorted(got), (got, logged)


@contextmanager
def serve(tmp_path: Path, *flags: str, batch_s: float | None = None) -> Iterator[Server]:
    """`embedsvc serve`; with ``batch_s``, around the fake encoder spending that per batch."""
    if batch_s is None:
        cmd, env = ["embedsvc"], None
    else:
        cmd, env = FAKE_EMBEDSVC, {"FAKE_SERVE_DELAY_S": str(batch_s)}
    with running([*cmd, "serve", "--port", "0", *flags], tmp_path / "serve.log", env=env,
                 cwd=str(REPO)) as server:
        yield server


def post_in_thread(server: Server, inputs: list[str], out: list) -> threading.Thread:
    def send() -> None:
        try:
            out.append(loopback.post(server.url + "/embed", json={"inputs": inputs}, timeout=60))
        except httpx.HTTPError as exc:
            out.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def computing(server: Server) -> bool:
    return (metric(server, "embedsvc_in_flight") > 0
            or metric(server, "embedsvc_inputs_total") > 0)


def wait_computing(server: Server, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not computing(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert computing(server), server.output()[-2000:]


LONG = [f"input number {i} " + "with several more words " * 20 for i in range(2048)]


def test_a_second_sigterm_exits_at_once_without_sigabrt(tmp_path):
    out: list = []
    with serve(tmp_path, "--max-batch-size", "32", batch_s=0.05) as server:
        thread = post_in_thread(server, LONG, out)
        wait_computing(server)
        server.proc.terminate()
        time.sleep(0.3)
        server.proc.terminate()
        code = server.proc.wait(3)
        thread.join(10)
    assert code == 128 + 15, server.output()[-2000:]
    assert "terminate called" not in server.output()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_upload_and_a_running_request_complete_through_the_drain(tmp_path, signum):
    body = json.dumps({"inputs": ["uploaded across the signal"] * 4}).encode()
    head = (b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    out: list = []
    with serve(tmp_path, "--drain-timeout-s", "20", "--max-batch-size", "16",
               batch_s=0.3) as server, \
            socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + body[:10])
        thread = post_in_thread(server, LONG[:64], out)
        wait_computing(server)
        server.proc.send_signal(signum)
        time.sleep(1.0)  # the old drain closed the connection after 0.2 s of quiet
        sock.sendall(body[10:])
        status, _, answer = read_response(sock, 30)
        code = server.proc.wait(30)
        thread.join(10)
    assert status == 200, answer[:300]
    assert len(json.loads(answer)) == 4
    assert out and not isinstance(out[0], Exception) and out[0].status_code == 200
    assert len(out[0].json()) == 64
    assert code == 0, server.output()[-2000:]
    assert re.search(r"drained in \S+: \d+ inputs computed while draining, none left "
                     r"unfinished; stopping", server.output()), server.output()[-2000:]


def test_the_drain_log_counts_inputs_computed_by_a_request_cut_at_the_timeout(tmp_path):
    out: list = []
    with serve(tmp_path, "--drain-timeout-s", "1", "--max-batch-size", "16",
               batch_s=0.05) as server:
        thread = post_in_thread(server, LONG, out)
        wait_computing(server)
        server.proc.terminate()
        code = server.proc.wait(30)
        thread.join(10)
    assert code == 0, server.output()[-2000:]  # not -6: no SIGABRT from a batch cut short
    assert "terminate called" not in server.output()
    found = re.search(r"drained in \S+: (\d+) inputs computed while draining; requests "
                      r"unfinished at the timeout \((\d+) inputs\) got 503", server.output())
    assert found, server.output()[-2000:]
    assert int(found.group(1)) > 0 and int(found.group(2)) == 2048
    assert out and not isinstance(out[0], Exception) and out[0].status_code == 503


def test_a_drain_that_times_out_mid_batch_exits_cleanly(tmp_path):
    out: list = []
    full = ["word " * 400] * 128  # one batch of 128 x 256 tokens: seconds on any CPU
    flags = ("--drain-timeout-s", "0", "--max-batch-size", "128", "--max-batch-tokens", "32768")
    with serve(tmp_path, *flags) as server:
        thread = post_in_thread(server, full, out)
        deadline = time.monotonic() + 60
        while metric(server, "embedsvc_in_flight") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.proc.terminate()
        code = server.proc.wait(30)
        thread.join(10)
    assert code == 0, server.output()[-2000:]  # the batch's native threads did not abort
    assert "exiting with a batch still computing" in server.output()
    assert "terminate called" not in server.output()


STALL = {"EMBEDSVC_MAX_CONNECTIONS": "20", "EMBEDSVC_SEND_TIMEOUT_S": "10"}
BIG = 1250  # inputs: about 10 MB of JSON vectors at 384 dimensions


@contextmanager
def fake_launcher(name: str, tmp_path: Path, env: dict[str, str]) -> Iterator[Any]:
    """The launcher ``name`` around the fake encoder: its port, probe port and pid."""
    if name == "serve":
        settings = {k.removeprefix("EMBEDSVC_").lower(): v for k, v in env.items()}
        with fake_server(FakeEncoder(dimension=384, record=False), **settings) as server:
            yield server.port, server.probes.port, os.getpid(), server.registry
        return
    with running(FAKE_LAUNCHERS["gunicorn-conf"], tmp_path / "gunicorn.log",
                 env={**BOUNDS, **env}, cwd=str(REPO)) as server:
        probes = server.probe_url()
        yield server.port, int(probes.rsplit(":", 1)[1]), worker_pid(server), None


def probe_metric(probe_port: int, name: str, labels: str = "") -> float:
    text = loopback.get(f"http://127.0.0.1:{probe_port}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def never_reading(port: int, count: int) -> list[socket.socket]:
    """``count`` clients that each ask for a large answer and never read a byte of it."""
    body = json.dumps({"inputs": ["a"] * BIG}).encode()
    request = (b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    socks = []
    for _ in range(count):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel takes little
        sock.connect(("127.0.0.1", port))
        sock.sendall(request)
        socks.append(sock)
    return socks


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_clients_that_never_read_are_closed_at_the_send_timeout(launcher, tmp_path):
    env = {**STALL, "EMBEDSVC_HEALTH_PORT": "0"}
    answered = '{route="/embed",status="200"}'
    closed = '{reason="send_timeout"}'
    with fake_launcher(launcher, tmp_path, env) as (port, probes, pid, _):
        held_before = len(fds_to_deleted_files(pid))
        socks = never_reading(port, 20)
        try:
            deadline = time.monotonic() + 60
            while (probe_metric(probes, "embedsvc_requests_total", answered) < 16
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            stalled_at = time.monotonic()  # every thread's answer written, none taken
            if launcher == "serve":  # waitress holds the answers in temporary files
                assert len(fds_to_deleted_files(pid)) > held_before
            # every connection is held: the legitimate client is turned away with a 503 and
            # its Retry-After until the stalled ones are closed
            while (resp := loopback.post(f"http://127.0.0.1:{port}/embed",
                                         json={"inputs": "legit"}, timeout=30)).status_code == 503:
                assert resp.json()["error"]["code"] == "too_many_connections"
                time.sleep(int(resp.headers["Retry-After"]))
                assert time.monotonic() - stalled_at < 15
            assert resp.status_code == 200 and len(resp.json()[0]) == 384
            assert time.monotonic() - stalled_at < 15
            while (probe_metric(probes, "embedsvc_connections_closed_total", closed) < 20
                   and time.monotonic() < deadline + 30):
                time.sleep(0.2)
            assert probe_metric(probes, "embedsvc_connections_closed_total", closed) == 20
            assert len(fds_to_deleted_files(pid)) == held_before  # their buffers are freed
            for sock in socks:  # reset, not left half open
                with pytest.raises(ConnectionResetError):
                    while sock.recv(1 << 20):
                        pass
        finally:
            for sock in socks:
                sock.close()


def read_head(sock: socket.socket, buf: bytes = b"") -> tuple[bytes, bytes]:
    """One response head from ``sock`` (after ``buf``), and the bytes that came after it."""
    while b"\r\n\r\n" not in buf:
        chunk = _recv(sock)
        assert chunk, f"closed before a whole head: {buf[:300]!r}"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


def test_head_answers_carry_no_body_on_any_route(bounded):
    from embedsvc.api.routes import ROUTES

    gets = sorted({r.path for r in ROUTES if r.method == "GET"})
    for path in [*gets, "/nowhere", "/embed"]:  # every GET route, a 404 and a 405
        # HEAD then GET /health on one connection: the bytes after the first head must be
        # the second answer, not a body
        with socket.create_connection(("127.0.0.1", bounded.port), timeout=15) as sock:
            sock.sendall(b"HEAD %s HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n"
                         b"Connection: close\r\n\r\n" % path.encode())
            head, rest = read_head(sock)
            while len(rest) < 12:
                chunk = _recv(sock)
                assert chunk, (path, head, rest)
                rest += chunk
            assert rest.startswith(b"HTTP/1.1 200 "), (path, head, rest[:200])
            assert b"content-length: " in head.lower(), (path, head)
    # the HTTP server's own error answer (an unparsable Content-Length), which closes
    with socket.create_connection(("127.0.0.1", bounded.port), timeout=15) as sock:
        sock.sendall(b"HEAD /embed HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n")
        head, rest = read_head(sock)
        while chunk := _recv(sock):
            rest += chunk
    assert head.startswith(b"HTTP/1.1 400 ") and rest == b"", (head, rest[:200])
    probes = int(bounded.probe_url().rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", probes), timeout=15) as sock:
        sock.sendall(b"HEAD /embed HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head, rest = read_head(sock)
        while chunk := _recv(sock):
            rest += chunk
    assert head.startswith(b"HTTP/1.1 404 ") and rest == b"", (head, rest[:200])


def test_connections_queued_when_the_drain_begins_are_answered_not_reset(tmp_path):
    """Connections the kernel has queued but the server has not yet taken when the drain
    begins (a rolling restart under load): closing the listener reset them all, a POST cut
    that way cannot be retried safely. They are taken first and answered: 503 ``draining``
    with Retry-After and ``Connection: close``, since the drain refuses new work by the time
    their requests are read (gunicorn's worker takes them the same way)."""
    body = json.dumps({"inputs": "queued at the drain"}).encode()
    request = (b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    with serve(tmp_path, "--drain-timeout-s", "10", batch_s=0.0) as server:
        server.proc.send_signal(signal.SIGSTOP)  # nothing is accepted meanwhile
        socks = []
        try:
            for _ in range(8):
                sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
                sock.sendall(request)
                socks.append(sock)
            server.proc.send_signal(signal.SIGTERM)  # taken as it runs again, first
        finally:
            server.proc.send_signal(signal.SIGCONT)
        answers = []
        for sock in socks:
            try:
                status, headers, _ = read_response(sock, 30)
                answers.append((status, headers.get("connection")))
            except OSError as exc:
                answers.append((type(exc).__name__, None))
            finally:
                sock.close()
        code = server.proc.wait(30)
    # each answered: served if the loop took it before the signal (as on a busy machine),
    # else 503 draining; whatever the drain answered closes its connection
    assert all(status == 200 or (status == 503 and conn == "close")
               for status, conn in answers), answers
    assert code == 0, server.output()[-2000:]
