"""Real server processes, started the ways users start them, on loopback port 0."""

import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from .. import loopback
from .conftest import cosine
from .servers import Server, running

REPO = Path(__file__).parents[2]
GUNICORN = ["gunicorn", "-b", "127.0.0.1:0", "--no-control-socket"]
TEXTS = ["launch modes must all serve", "the same vectors"]


def check_vectors(server: Server, reference, client: httpx.Client | None = None) -> int:
    """One embedding request answered correctly; the pid of the worker that answered."""
    c = client or server.client()
    resp = c.post("/v1/embeddings", json={"input": TEXTS})
    assert resp.status_code == 200, resp.text
    got = np.array([d["embedding"] for d in resp.json()["data"]])
    assert (cosine(got, reference.encode(TEXTS)) > 0.9999).all()
    info = c.get("/info").json()
    return info["pid"]


@pytest.mark.parametrize(
    "cmd",
    [
        ["waitress-serve", "--threads=16", "--host=127.0.0.1", "--port=0", "embedsvc:app"],
        [*GUNICORN, "-w", "1", "--threads", "8", "embedsvc:app"],
        [*GUNICORN, "-c", str(REPO / "deploy" / "gunicorn.conf.py"), "embedsvc:app"],
    ],
    ids=["waitress-serve", "gunicorn-w1", "gunicorn-conf"],
)
def test_single_process_launchers_serve_correct_vectors(cmd, reference, tmp_path):
    with running(cmd, tmp_path / "server.log", cwd=str(tmp_path)) as server:
        pid = check_vectors(server, reference)
        assert pid != os.getpid()
        log = server.output()
        assert "model ready: pid=" in log and "device=cpu" in log


def workers_of(master: int) -> list[int]:
    path = Path(f"/proc/{master}/task/{master}/children")
    return [int(p) for p in path.read_text().split()]


def private_bytes(pid: int) -> int:
    total = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(line.split()[1]) * 1024
    return total


def answering_pids(server: Server, reference, want: int, timeout: float = 90) -> set[int]:
    """Send concurrent requests on fresh connections until ``want`` workers have answered."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout

    def hit() -> None:
        while len(seen) < want and time.monotonic() < deadline:
            with loopback.Client(base_url=server.url, timeout=60) as c:
                seen.add(check_vectors(server, reference, c))

    threads = [threading.Thread(target=hit) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return seen


def two_workers(preload: bool, reference, log: Path, env: dict[str, str] | None = None):
    cmd = [*GUNICORN, "-w", "2", "--threads", "4", *(["--preload"] if preload else []),
           "embedsvc:app"]
    return running(cmd, log, env=env, cwd=str(log.parent))


def test_two_workers_both_serve(reference, tmp_path):
    with two_workers(False, reference, tmp_path / "two.log") as server:
        workers = workers_of(server.proc.pid)
        assert len(workers) == 2
        assert answering_pids(server, reference, want=2) == set(workers)


def test_preload_shares_the_weights(reference, tmp_path):
    # PyTorch's weights, which a preloading master shares when each worker holds the model
    # (ENGINE=inline; by default -w 2 shares one engine process, test_engine_gunicorn.py; the
    # PyTorch-free path loads none: test_lean.py). A worker that loaded them itself (one is
    # enough to measure) against each of two that a preloading master forked.
    env = {"EMBEDSVC_BACKEND": "torch", "EMBEDSVC_ENGINE": "inline"}
    with running([*GUNICORN, "-w", "1", "--threads", "4", "embedsvc:app"],
                 tmp_path / "alone.log", env=env, cwd=str(tmp_path)) as server:
        [worker] = workers_of(server.proc.pid)
        assert answering_pids(server, reference, want=1) == {worker}
        alone = private_bytes(worker)
    with two_workers(True, reference, tmp_path / "preload.log", env=env) as server:
        workers = workers_of(server.proc.pid)
        assert answering_pids(server, reference, want=2) == set(workers)
        forked = float(np.mean([private_bytes(p) for p in workers]))
        assert "preloads the weights on the CPU" in server.output()
        weights = server.client().get("/info").json()["parameters"] * 4
    saved = alone - forked
    assert saved >= 0.75 * weights, (
        f"--preload saved {saved / 2**20:.0f} MiB per worker; weights are {weights / 2**20:.0f} MiB"
    )


def test_a_killed_worker_is_replaced_and_the_service_answers(reference, tmp_path):
    with two_workers(True, reference, tmp_path / "kill.log") as server:
        before = workers_of(server.proc.pid)
        os.kill(before[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = workers_of(server.proc.pid)
            if len(now) == 2 and before[0] not in now:
                break
            time.sleep(0.2)
        replacement = set(workers_of(server.proc.pid)) - set(before)
        assert len(replacement) == 1, server.output()
        assert replacement <= answering_pids(server, reference, want=2)


CONF = [*GUNICORN, "-c", str(REPO / "deploy" / "gunicorn.conf.py")]


def caused_by(exc: BaseException | None, kind: type) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def keep_alive_clients(server: Server, count: int, outcomes: list[str]) -> list[threading.Thread]:
    """``count`` clients posting on kept-alive connections until refused or told to stop."""

    def client(t: int) -> None:
        with loopback.Client(base_url=server.url, timeout=60) as c:
            while True:
                try:
                    resp = c.post("/embed", json={"inputs": f"client {t}"})
                except httpx.ConnectError as exc:
                    refused = caused_by(exc, ConnectionRefusedError)
                    outcomes.append("refused" if refused else f"cut at connect: {exc!r}")
                    return
                except httpx.HTTPError as exc:
                    outcomes.append(f"cut: {exc!r}")
                    return
                outcomes.append(str(resp.status_code))
                if resp.status_code == 503:
                    return

    threads = [threading.Thread(target=client, args=(t,)) for t in range(count)]
    for t in threads:
        t.start()
    return threads


def test_gunicorn_sigterm_under_keep_alive_load_refuses_and_resets_nothing(tmp_path):
    for run in range(10):  # each SIGTERM to a fresh server
        outcomes: list[str] = []
        log = tmp_path / f"run-{run}.log"
        with running([*CONF, "tests.integration.fake_app:app"], log, cwd=str(REPO)) as server:
            threads = keep_alive_clients(server, 32, outcomes)
            deadline = time.monotonic() + 30
            while outcomes.count("200") < 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            server.proc.terminate()
            code = server.proc.wait(60)
            for t in threads:
                t.join(60)
        cut = [o for o in outcomes if o not in ("200", "503", "refused")]
        assert not cut, (run, cut[:5], server.output()[-3000:])
        assert code == 0 and outcomes.count("200") >= 200, (run, server.output()[-2000:])
        assert outcomes.count("refused") + outcomes.count("503") == 32
        assert "none left unfinished" in server.output()


def test_a_worker_stopped_while_its_master_serves_on_leaves_the_listener_serving(tmp_path):
    """A stopping worker keeps new connections out of the listening socket's queue, but
    that socket is the master's and every worker's: a worker stopped by TTOU (fewer
    workers) or a reload must leave it to the others. Each new connection is answered, none
    waits for a dropped first packet to be sent again (a second)."""
    env = {"EMBEDSVC_ENGINE": "inline"}  # two fake encoders, no engine process to wait on
    with running([*CONF, "-w", "2", "tests.integration.fake_app:app"], tmp_path / "ttou.log",
                 env=env, cwd=str(REPO)) as server:
        deadline = time.monotonic() + 30
        while len(workers_of(server.proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        before = workers_of(server.proc.pid)
        os.kill(server.proc.pid, signal.SIGTTOU)
        while set(before) <= set(workers_of(server.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(workers_of(server.proc.pid)) == 1, server.output()[-2000:]
        for i in range(20):  # each on a connection of its own
            resp = loopback.post(server.url + "/embed", json={"inputs": f"after {i}"},
                                 timeout=httpx.Timeout(5, connect=0.5))
            assert resp.status_code == 200


LONG = [f"input number {i} " + "with several more words " * 20 for i in range(256)]


def test_gunicorn_drains_the_service_and_stops_the_probe_port(tmp_path):
    out: list = []
    env = {"EMBEDSVC_HEALTH_PORT": "0", "EMBEDSVC_MAX_BATCH_SIZE": "16"}
    with running([*CONF, "embedsvc:app"], tmp_path / "drain.log", env=env,
                 cwd=str(tmp_path)) as server:
        found = re.search(r"probes on (http://127\.0\.0\.1:\d+)", server.output())
        assert found, server.output()[-2000:]
        probes = found.group(1)
        thread = threading.Thread(target=lambda: out.append(loopback.post(
            server.url + "/embed", json={"inputs": LONG}, timeout=120)))
        thread.start()
        deadline = time.monotonic() + 60
        while (loopback.get(probes + "/metrics", timeout=10).text.find("embedsvc_in_flight 0.0")
               >= 0 and time.monotonic() < deadline):
            time.sleep(0.05)
        server.proc.terminate()
        time.sleep(0.5)
        with pytest.raises(ConnectionRefusedError):  # the listener closed at the signal
            socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
        # The probe port answers until the worker exits: ready while the request running at
        # the signal finishes, then draining (as `embedsvc serve`: that window is short).
        seen = set()
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:
                health = loopback.get(probes + "/health", timeout=10)
            except httpx.TransportError:
                break
            seen.add(health.status_code if health.status_code == 200
                     else health.json()["error"]["code"])
            time.sleep(0.02)
        assert seen <= {200, "draining"}, seen
        code = server.proc.wait(60)
        thread.join(60)
    assert code == 0, server.output()[-2000:]
    assert out and out[0].status_code == 200 and len(out[0].json()) == len(LONG)
    with pytest.raises(httpx.ConnectError):  # the probe port went with the worker
        loopback.get(probes + "/health", timeout=5)
    found = re.search(r"drained in \S+: (\d+) inputs computed while draining, none left "
                      r"unfinished", server.output())
    assert found and int(found.group(1)) > 0, server.output()[-2000:]
