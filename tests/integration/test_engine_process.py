"""``embedsvc serve --workers N``: one engine process, N fronts (issue 38), as real processes
on loopback, around the fake encoder (tests/integration/fake_serve.py: the engine and the
fronts are that program again), whose batches sleep so that a test can catch one computing.
The real model's round, and gunicorn's, are in test_engine_gunicorn.py."""

from __future__ import annotations

import contextlib
import http.client
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

import msgspec
import numpy as np
import pytest

from embedsvc.model.fake import FakeEncoder
from embedsvc.remote import client as client_module

from .. import loopback
from ..frames import FrameSocket
from .servers import FAKE_EMBEDSVC, Server, assert_monotonic, counter_series, running

FAKE = FakeEncoder(dimension=384, max_input_tokens=256)  # as fake_serve.py serves it
ENGINE_LINE = re.compile(r"engine serving: pid=(\d+) .* on ipc://(\S+)")


@contextmanager
def workers(tmp_path: Path, n: int = 2, batch_s: float = 0.0, *flags: str,
            name: str = "workers") -> Iterator[Server]:
    env = {"FAKE_SERVE_DELAY_S": str(batch_s)}
    cmd = [*FAKE_EMBEDSVC, "serve", "--port", "0", "--workers", str(n), "--threads", "16",
           *flags]
    with running(cmd, tmp_path / f"{name}.log", env=env) as server:
        all_ready(server, n)
        yield server


def info(server: Server) -> dict:
    return loopback.get(server.url + "/info", timeout=10).json()


def all_ready(server: Server, n: int, timeout: float = 60) -> None:
    """Until the engine knows ``n`` fronts and each front has answered /health and listed
    all ``n`` in /info (new connections go to either front: enough of them reach each; a
    front lists the engine's fronts from its first pong on)."""
    server.wait_fronts(n, timeout)
    deadline = time.monotonic() + timeout
    complete: set[int] = set()  # the fronts (by /info's pid) that have
    while time.monotonic() < deadline:
        got = info(server)
        if len(got["front_pids"]) == n and \
                loopback.get(server.url + "/health", timeout=5).status_code == 200:
            complete.add(got["pid"])
            if len(complete) == n:
                return
        time.sleep(0.05)
    raise AssertionError(f"not {n} fronts ready:\n{server.output()[-3000:]}")


def children(pid: int) -> list[int]:
    found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(p) for p in found]


def engine_socket(server: Server, pid: int) -> str:
    for found in ENGINE_LINE.finditer(server.output()):
        if int(found.group(1)) == pid:
            return found.group(2)
    raise AssertionError(f"no engine line for pid {pid}:\n{server.output()[-2000:]}")


def metric(server: Server, line_start: str, missing: float | None = None) -> float:
    """The sum of the samples whose line starts with ``line_start``; ``missing`` when there
    is none (a labelled counter before its first count), else none is an error."""
    text = loopback.get(server.url + "/metrics", timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(line_start)]
    if not values and missing is not None:
        return missing
    assert values, f"no sample {line_start}"
    return sum(values)


def dropped(server: Server) -> float:
    """Inputs the engine dropped because their client left (0 before the first)."""
    return metric(server, 'embedsvc_dropped_inputs_total{reason="disconnected"}', missing=0.0)


def embed(url: str, texts: list[str], timeout: float = 60):
    return loopback.post(url + "/embed", json={"inputs": texts}, timeout=timeout)


def assert_vectors(resp, texts: list[str]) -> None:
    assert resp.status_code == 200, resp.text
    np.testing.assert_allclose(resp.json(), [FAKE.expected(t) for t in texts], rtol=1e-5)


def test_two_fronts_share_one_engine_whose_batches_mix_their_requests(tmp_path):
    with workers(tmp_path, 2, 0.05) as server:
        about = info(server)
        fronts = set(about["front_pids"])
        assert len(fronts) == 2 and about["engine_pid"] not in fronts
        assert set(children(server.pid)) == fronts | {about["engine_pid"]}
        results: list = []

        def client(i: int) -> None:
            with loopback.Client(base_url=server.url, timeout=60) as c:  # its own connection
                for k in range(3):
                    texts = [f"client {i} request {k}"]
                    results.append((texts, c.post("/embed", json={"inputs": texts})))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 72
        for texts, resp in results:  # each its own vector, never another request's
            assert_vectors(resp, texts)
        time.sleep(1.2)  # the other front's metrics reach the engine once a second
        assert metric(server, 'embedsvc_requests_total{route="/embed",status="200"}') == 72
        batches = metric(server, "embedsvc_batch_fronts_count")
        single = metric(server, 'embedsvc_batch_fronts_bucket{le="1.0"}')
        assert batches > single, "no batch held inputs from both fronts"
        # The engine's own load, through a front: its loop worked for these requests.
        assert metric(server, "embedsvc_engine_loop_busy_seconds_total") > 0
        assert metric(server, "embedsvc_engine_cpu_seconds_total") > 0
        assert metric(server, "embedsvc_engine_loop_waiting_seconds_total") >= 0  # a sample


def listening_sockets(port: int) -> set[str]:
    """The inodes of the sockets listening on ``port`` (``/proc/net/tcp``'s state 0A)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(fields[9])
    return found


def sockets_of(pid: int) -> set[str]:
    links = (os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir())
    return {link[len("socket:["):-1] for link in links if link.startswith("socket:[")}


@pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="no SO_REUSEPORT here")
def test_each_front_accepts_on_its_own_socket_and_new_connections_spread_over_them(tmp_path):
    with workers(tmp_path, 2) as server:
        fronts = info(server)["front_pids"]
        listening = listening_sockets(server.port)
        own = [sockets_of(pid) & listening for pid in fronts]
        assert len(listening) == 2 and all(len(s) == 1 for s in own) and own[0] != own[1], (
            f"the fronts do not each listen on a socket of their own: {listening}, {own}")
        # 64 connections opened at once, then each asks which process answers it: the
        # kernel spread them by their addresses, not to whichever front woke first.
        conns = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
                 for _ in range(64)]
        for conn in conns:
            conn.connect()
        answered: dict[int, int] = {}
        for conn in conns:
            conn.request("GET", "/info")
            pid = json.loads(conn.getresponse().read())["pid"]
            answered[pid] = answered.get(pid, 0) + 1
            conn.close()
        assert set(answered) == set(fronts)
        assert min(answered.values()) >= 10, answered  # even odds: below 10 of 64 is 2e-9


def test_a_killed_engine_answers_every_request_in_it_503_then_a_new_one_serves(tmp_path):
    """SIGKILL of the engine under load: every request in it gets a JSON 503 with
    Retry-After within about a second (the fronts see its socket close; at worst
    LOST_AFTER_S), the supervisor starts another, /health says loading, then ok."""
    with workers(tmp_path, 2, 0.3) as server:
        engine = info(server)["engine_pid"]
        stop = threading.Event()
        answers: list = []

        def client(i: int) -> None:
            with loopback.Client(base_url=server.url, timeout=30) as c:
                while not stop.is_set():
                    texts = [f"load {i} {time.monotonic()}"]
                    sent = time.monotonic()
                    resp = c.post("/embed", json={"inputs": texts})
                    answers.append((sent, time.monotonic(), texts, resp))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        killed = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        states = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            health = loopback.get(server.url + "/health", timeout=5)
            states.add(health.status_code if health.status_code == 200
                       else health.json()["error"]["code"])
            if health.status_code == 200 and info(server)["engine_pid"] not in (engine, None):
                break
            time.sleep(0.1)
        recovered = time.monotonic()
        all_ready(server, 2)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(30)
        assert "loading" in states, states  # /health said so while the new one started
    in_flight = [a for a in answers if a[0] < killed < a[1]]
    assert in_flight, "no request was in the engine when it was killed"
    for _sent, done, texts, resp in in_flight:
        assert done - killed < 2.0, f"answered {done - killed:.1f}s after the kill"
        if resp.status_code == 200:  # computed and sent before the kill took effect
            assert_vectors(resp, texts)
            continue
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1", resp.text
        assert resp.json()["error"]["type"] == "service_unavailable"
    for _, _, texts, resp in answers:
        assert resp.status_code in (200, 503), resp.text
        if resp.status_code == 200:
            assert_vectors(resp, texts)
    assert any(a[0] > recovered and a[3].status_code == 200 for a in answers)
    assert "the engine process (pid" in server.output()


def test_a_front_stopped_longer_than_the_links_silence_limit_still_gets_its_answer(tmp_path):
    """A front whose process does not run for a while (SIGSTOP here; a paused container, a
    host that did not schedule it) sends no pings meanwhile: the engine's silence is only
    its own. Its request, computing in the live engine, must get its rows once it runs
    again; the front counted the pause as the engine's silence, took the engine for gone
    the moment it ran again, and answered 503 ``engine_gone``."""
    with workers(tmp_path, 2, 5.0) as server, \
            loopback.Client(base_url=server.url, timeout=30) as client:
        front = client.get("/info").json()["pid"]  # the keep-alive connection's front
        answer: list = []
        thread = threading.Thread(target=lambda: answer.append(
            client.post("/embed", json={"inputs": ["a stopped front"]})))
        thread.start()
        time.sleep(0.5)  # in the engine's 5 s batch
        os.kill(front, signal.SIGSTOP)
        time.sleep(client_module.LOST_AFTER_S + 1)
        os.kill(front, signal.SIGCONT)
        thread.join(30)
    assert_vectors(answer[0], ["a stopped front"])
    assert "is gone" not in server.output()


def test_counters_never_go_backwards_over_scrapes_through_four_fronts(tmp_path):
    """Each front merged its own live counts with the others' last snapshots: scrapes after
    41 requests read 14, 21, 14, 21, 7, 21."""
    with workers(tmp_path, 4, 0.01) as server:
        stop = threading.Event()

        def load(i: int) -> None:
            with loopback.Client(base_url=server.url, timeout=60) as c:
                while not stop.is_set():
                    c.post("/embed", json={"inputs": [f"load {i}"]})

        threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        try:  # each scrape a new connection: the kernel spreads them over the fronts
            scrapes = [loopback.get(server.url + "/metrics", timeout=30).text
                       for _ in range(200)]
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert_monotonic(scrapes)
        key = ("embedsvc_requests_total", (("route", "/embed"), ("status", "200")))
        assert counter_series(scrapes[-1])[key] > counter_series(scrapes[0]).get(key, 0.0)


def test_an_engine_killed_each_time_it_serves_is_replaced_every_time(tmp_path):
    """The supervisor stopped the service at the fifth engine killed within 5 s of its
    start, though each had come up and served: such an exit is a kill, not a failure to
    start, and never adds up to giving up."""
    with workers(tmp_path, 2) as server:
        killed: list[int] = []
        for i in range(8):
            engine = serving_engine(server, not_in=killed)
            assert_vectors(embed(server.url, [f"kill {i}"]), [f"kill {i}"])
            os.kill(engine, signal.SIGKILL)
            killed.append(engine)
        serving_engine(server, not_in=killed)
        assert_vectors(embed(server.url, ["after"]), ["after"])
        assert server.proc.poll() is None, server.output()[-2000:]
        assert server.output().count("exited with signal 9 after it came up") >= 8


def serving_engine(server: Server, not_in: list[int], timeout: float = 30,
                   fronts: int = 2) -> int:
    """The pid of an engine, none of ``not_in``, once a front answers /health 200 with it
    and every one of the ``fronts`` has its card (a new connection may go to either)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.output()[-2000:]
        with contextlib.suppress(OSError):
            pid = info(server)["engine_pid"]
            healthy = loopback.get(server.url + "/health", timeout=5).status_code == 200
            if pid is not None and pid not in not_in and healthy:
                server.wait_fronts(fronts, max(1.0, deadline - time.monotonic()))
                return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"no new engine serving:\n{server.output()[-2000:]}")


def test_a_killed_front_is_replaced_and_the_other_keeps_serving(tmp_path):
    with workers(tmp_path, 2) as server:
        fronts = info(server)["front_pids"]
        os.kill(fronts[0], signal.SIGKILL)
        for i in range(20):  # the kernel gives new connections to the live front
            assert_vectors(embed(server.url, [f"after {i}"]), [f"after {i}"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = set(info(server)["front_pids"])
            if len(now) == 2 and fronts[0] not in now:
                break
            time.sleep(0.3)
        assert len(now) == 2 and fronts[0] not in now, now
        assert f"the front process (pid {fronts[0]}) exited with signal 9" in server.output()


def test_a_killed_fronts_queued_work_is_dropped_in_the_engine(tmp_path):
    """Its clients are gone with it: the engine drops its queued inputs (counted as
    ``disconnected``) instead of computing them until their deadline."""
    with workers(tmp_path, 2, 0.3, "--max-batch-size", "2") as server:
        sessions: dict[int, loopback.Client] = {}
        for _ in range(40):  # a kept-alive connection to each front
            c = loopback.Client(base_url=server.url, timeout=60)
            pid = c.get("/info").json()["pid"]
            if pid in sessions:
                c.close()
            else:
                sessions[pid] = c
            if len(sessions) == 2:
                break
        assert len(sessions) == 2, "no connection reached the second front"
        (doomed, victim), (_, survivor) = sorted(sessions.items())
        before = dropped(server)
        texts = [f"queued {i}" for i in range(80)]  # 40 batches of 0.3 s: 12 s of work
        sent = threading.Thread(target=_post_quietly, args=(victim, texts), daemon=True)
        sent.start()
        deadline = time.monotonic() + 10
        while metric(server, "embedsvc_queue_depth") < 70 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(server, "embedsvc_queue_depth") >= 70
        # the engine's admission, read through a front: what is queued, and on the device
        assert metric(server, "embedsvc_admitted_inputs") >= 70
        os.kill(doomed, signal.SIGKILL)
        # the engine sees it silent for 2 s with its pid gone; about 8 batches run meanwhile
        deadline = time.monotonic() + 10
        while dropped(server) - before < 40 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert dropped(server) - before >= 40, server.output()[-3000:]
        assert metric(server, "embedsvc_queue_depth") == 0
        assert_vectors(survivor.post("/embed", json={"inputs": ["after"]}), ["after"])
        survivor.close()
        sent.join(10)
        assert f"front pid {doomed} is gone" in server.output()


def _post_quietly(client: loopback.Client, texts: list[str]) -> None:
    with contextlib.suppress(Exception):  # its front is killed under it
        client.post("/embed", json={"inputs": texts})


def test_sigterm_drains_the_fronts_then_the_engine_and_cuts_nothing_admitted(tmp_path):
    with workers(tmp_path, 2, 0.5) as server:
        results: list = []
        clients = []
        for _i in range(8):
            c = loopback.Client(base_url=server.url, timeout=60)
            assert c.get("/health").status_code == 200  # a kept-alive connection
            clients.append(c)

        def send(c, i: int) -> None:
            texts = [f"draining {i}"]
            results.append((texts, c.post("/embed", json={"inputs": texts})))

        threads = [threading.Thread(target=send, args=(c, i)) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # admitted, the first batch computing
        kids = children(server.pid)
        os.killpg(server.pid, signal.SIGTERM)  # the whole group, as systemd's default does
        time.sleep(0.3)
        with pytest.raises(ConnectionRefusedError):  # refused, never queued and then reset
            socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
        for t in threads:
            t.join(60)
        assert server.proc.wait(60) == 0
        for c in clients:
            c.close()
    assert len(results) == 8
    for texts, resp in results:
        assert_vectors(resp, texts)
    for pid in kids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert "engine stopped" in server.output()


def test_a_malformed_or_oversized_frame_is_dropped_and_the_engine_serves_on(tmp_path):
    with workers(tmp_path, 1, 0.0, "--engine", "process") as server:
        engine = info(server)["engine_pid"]
        address = engine_socket(server, engine)
        sock = FrameSocket(f"ipc://{address}")
        try:
            sock.send(b"\x93not a frame")
            sock.send(b"")  # an empty frame
            sock.send(b"\x81\xa5frame\xa6Submit")  # a Submit with no fields
            # metrics a scrape cannot render: the next scrape stopped the engine (signal 6)
            sock.send(msgspec.msgpack.encode({"frame": "Snapshot", "pid": 1, "origin": 1,
                                              "seq": 1, "families": [
                                                  ["x", "bogus", "h", [["x", {}, "y"]]]]}))
            # larger than any request can make: its connection closes once its length is read
            sock.stream.send(b"x" * (8 << 20))
            assert not sock.poll(5000) and sock.stream.closed
        finally:
            sock.close()
        assert loopback.get(server.url + "/metrics", timeout=10).status_code == 200
        assert_vectors(embed(server.url, ["still serving"]), ["still serving"])
        assert info(server)["engine_pid"] == engine
        assert server.output().count("a malformed frame on the engine socket was dropped") >= 5


        assert len(info(server)["front_pids"]) == 1  # ENGINE=process, with one front


def connection_on(server: Server, front: int | None, other_than: int | None = None):
    """A kept-alive client whose connection one front serves (the one named, or any but
    ``other_than``): new connections go to either front, so it tries a few."""
    for _ in range(50):
        c = loopback.Client(base_url=server.url, timeout=60)
        pid = c.get("/info").json()["pid"]
        if (front is None or pid == front) and pid != other_than:
            return c, pid
        c.close()
    raise AssertionError("no connection reached the front wanted")


def test_one_fronts_flood_cannot_starve_another_fronts_client(tmp_path):
    """Twelve connections on one front flood the engine with large requests; a client on
    the other front is answered within about two batches each time (batches take turns by
    connection in the engine's one batcher, whichever front a request came through)."""
    cmd_flags = ("--max-batch-tokens", "2048")
    env_per_token = "FAKE_SERVE_PER_TOKEN_S"
    with running([*FAKE_EMBEDSVC, "serve", "--port", "0", "--workers", "2", "--threads", "32",
                  *cmd_flags], tmp_path / "fair.log", env={env_per_token: "2e-5"}) as server:
        all_ready(server, 2)
        light, light_front = connection_on(server, None)
        floods = [connection_on(server, None, other_than=light_front)[0] for _ in range(12)]
        stop, answers, flooded = threading.Event(), [], []

        def flood(c) -> None:
            while not stop.is_set():
                flooded.append(c.post("/embed", json={"inputs": ["a flood " * 30] * 64}))

        threads = [threading.Thread(target=flood, args=(c,)) for c in floods]
        for t in threads:
            t.start()
        time.sleep(1.0)
        for i in range(20):
            answers.append(light.post("/embed", json={"inputs": [f"light {i}"]}))
        stop.set()
        for t in threads:
            t.join(60)
        for c in [light, *floods]:
            c.close()
        batch_s = metric(server, "embedsvc_inference_seconds_sum") / metric(
            server, "embedsvc_inference_seconds_count")
    assert flooded and {r.status_code for r in flooded} == {200}
    for i, resp in enumerate(answers):
        assert_vectors(resp, [f"light {i}"])
    worst = max(float(r.headers["x-queue-time"]) for r in answers) / 1000
    assert worst < 4 * batch_s + 0.25, (worst, batch_s)


def test_a_request_computing_past_its_deadline_is_answered_as_in_one_process(tmp_path):
    """REQUEST_TIMEOUT_S bounds the wait to reach the model, not the computing: a request
    of 8 batches of 0.5 s each, whose first input reached the model at once, is answered
    with its rows after 4 s on a 1 s deadline, as one process answers it. Its front used
    to give up at the deadline plus 2 s (504, and a Cancel that threw the work away); now
    it waits while the engine's pongs list the request as held."""
    texts = [f"computed past its deadline {k}" for k in range(64)]
    with workers(tmp_path, 2, 0.5, "--request-timeout-s", "1", "--max-batch-size", "8") \
            as server:
        sent = time.monotonic()
        resp = embed(server.url, texts, timeout=30)
        took = time.monotonic() - sent
    assert took > 3.0, f"{took:.1f}s: not past the deadline and its grace"
    assert_vectors(resp, texts)


@pytest.mark.parametrize("launch", [[], ["--workers", "2"]], ids=["one process", "workers"])
def test_a_sighup_while_the_model_loads_ends_nothing(tmp_path, launch):
    """SIGHUP reloads the keys file; a key rotation sends it whenever it likes. One that
    came while the model loaded ended the process (SIGHUP's default, before the handler was
    set): `embedsvc serve` exited, and under --workers the engine died, its load was lost,
    and the supervisor counted a failed start. The program now ignores it until its
    service exists, then reloads; the supervisor passes it to a child once that is up."""
    from .servers import _wait_port, start, stop

    cmd = [*FAKE_EMBEDSVC, "serve", "--port", "0", *launch]
    log = tmp_path / "serve.log"
    proc = start(cmd, log, env={"FAKE_SERVE_LOAD_S": "3"})
    try:
        until = time.monotonic() + 30  # its first line: the program runs (not its interpreter)
        while " INFO " not in log.read_text() and time.monotonic() < until:
            time.sleep(0.02)
        for _ in range(3):  # as it starts its processes, and while the model loads
            os.killpg(proc.pid, signal.SIGHUP)  # every process of the group, as a tty's
            time.sleep(0.5)
        server = Server(proc, _wait_port(proc, log, 60), log)
        server.wait_healthy(60)
        out = server.output()
        assert "exited with" not in out and "exited before it came up" not in out, out
        assert out.count("engine serving:") == (1 if launch else 0), out
        resp = loopback.post(server.url + "/v1/embeddings", json={"input": "after"}, timeout=30)
        assert resp.status_code == 200, resp.text
    finally:
        assert stop(proc) == 0, log.read_text()


def test_an_engine_whose_supervisor_dies_while_it_loads_stops_at_once(tmp_path):
    """The engine watched its supervisor only once its model had loaded: a supervisor
    killed meanwhile left the load running for nobody (the memory of a model, beside the
    copy the next start loads), for as long as the load took. It now watches from its
    start and stops within its watch's period."""
    from .servers import _alive, start, stop

    log = tmp_path / "serve.log"
    proc = start([*FAKE_EMBEDSVC, "serve", "--port", "0", "--workers", "2"], log,
                 env={"FAKE_SERVE_LOAD_S": "8"})
    try:
        until = time.monotonic() + 30
        while not (found := re.search(r"engine pid (\d+)", log.read_text())):
            assert time.monotonic() < until and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        engine = int(found.group(1))
        time.sleep(1.0)  # loading: 7 s of its load to go
        proc.kill()
        killed = time.monotonic()
        while _alive(engine) and time.monotonic() - killed < 5:
            time.sleep(0.05)
        assert not _alive(engine), "the engine went on loading for nobody"
    finally:
        stop(proc)
