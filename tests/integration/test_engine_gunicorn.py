"""``gunicorn -w N embedsvc:app`` on the bundled model (issue 38): the workers share one
engine process, which is the only process that maps ONNX Runtime, with or without
``--preload``, on a plain command line and with deploy/gunicorn.conf.py; the vectors are the
one-process server's; a SIGKILL of the master leaves no engine behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from .. import loopback
from .servers import assert_monotonic, counter_series, running

TEXTS = ["the workers share one model", "and one batcher", "a third text, a bit longer"]
PLAIN = ["gunicorn", "-w", "4", "-b", "127.0.0.1:0", "--timeout", "10",
         "--no-control-socket", "embedsvc:app"]
CONF = ["gunicorn", "-c", "deploy/gunicorn.conf.py", "-w", "2", "-b", "127.0.0.1:0",
        "--timeout", "10", "embedsvc:app"]
LAUNCHES = {"plain": PLAIN, "preload": [*PLAIN[:-1], "--preload", "embedsvc:app"],
            "conf": CONF}


def descendants(pid: int) -> list[int]:
    """Every process started under ``pid`` (the engine is in a session of its own, but a
    child of the worker that started it)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        path = Path(f"/proc/{parent}/task/{parent}/children")
        kids = [int(p) for p in path.read_text().split()] if path.exists() else []
        found += kids
        todo += kids
    return found


def maps_onnxruntime(pid: int) -> bool:
    try:
        return "onnxruntime" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def exited(pid: int) -> bool:
    """``pid`` is gone or a zombie (it may go between any two looks at /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def engine_ready(url: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        about = loopback.get(url + "/info", timeout=30).json()
        if about.get("engine_pid") and about["engine_pid"] != about["pid"]:
            return about
        time.sleep(0.3)
    raise AssertionError("no engine process")


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_gunicorn_workers_share_one_engine_with_the_one_process_vectors(launch, served,
                                                                        tmp_path):
    env = {"EMBEDSVC_DEVICE": "cpu"}
    with running(LAUNCHES[launch], tmp_path / "gunicorn.log", env=env,
                 cwd=str(Path(__file__).parents[2])) as server:
        about = engine_ready(server.url)
        engine = about["engine_pid"]
        want = loopback.post(served.url + "/embed", json={"inputs": TEXTS}, timeout=60).json()
        for _ in range(8):  # new connections, spread over the workers
            got = loopback.post(server.url + "/embed", json={"inputs": TEXTS}, timeout=60)
            assert got.status_code == 200, got.text
            np.testing.assert_allclose(got.json(), want, rtol=1e-5, atol=1e-6)
        mapped = [pid for pid in [server.pid, *descendants(server.pid)] if maps_onnxruntime(pid)]
        assert mapped == [engine], (mapped, engine)
        os.kill(server.pid, signal.SIGKILL)  # the master
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not exited(engine):
            time.sleep(0.1)
        assert exited(engine), f"the engine (pid {engine}) outlived its master"
        assert "is gone" in server.output()
        with contextlib.suppress(ProcessLookupError):  # the workers notice in a few seconds
            os.killpg(server.pid, signal.SIGKILL)


def test_every_worker_answers_the_service_state_and_counters_never_go_backwards(tmp_path):
    """Right after the first 200, a worker that had not met the engine answered /health 503
    "loading" and /info engine_pid null for up to 2.5 s; and /metrics through different
    workers read 14, 21, 14, 21, 7, 21 requests after 41."""
    with running(PLAIN, tmp_path / "gunicorn.log", env={"EMBEDSVC_DEVICE": "cpu"},
                 healthy=False) as server:
        deadline = time.monotonic() + 120
        while loopback.post(server.url + "/embed", json={"inputs": TEXTS},
                            timeout=60).status_code != 200:
            assert time.monotonic() < deadline, server.output()[-3000:]
            time.sleep(0.2)
        for _ in range(40):  # new connections, spread over the four workers
            health = loopback.get(server.url + "/health", timeout=30)
            assert health.status_code == 200, health.text
            assert loopback.get(server.url + "/info", timeout=30).json()["engine_pid"]
        stop = threading.Event()

        def load(i: int) -> None:
            while not stop.is_set():
                loopback.post(server.url + "/embed", json={"inputs": [f"load {i}"]},
                              timeout=60)

        threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        try:
            scrapes = [loopback.get(server.url + "/metrics", timeout=30).text
                       for _ in range(200)]
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert_monotonic(scrapes)
        assert counter_series(scrapes[-1])[("embedsvc_requests_total", (
            ("route", "/embed"), ("status", "200")))] > counter_series(scrapes[0])[(
                "embedsvc_requests_total", (("route", "/embed"), ("status", "200")))]


LATE = ["gunicorn", "-c", "tests/integration/late_worker_gunicorn_conf.py", "-w", "2", "-b",
        "127.0.0.1:0", "--timeout", "10", "embedsvc:app"]


@pytest.mark.parametrize("launch", ["plain", "conf", "late"])
def test_an_engine_that_cannot_load_the_model_stops_gunicorn_with_its_cause(launch, tmp_path):
    """Every request waited 30 s, then 503, and the master never exited, its engine's
    directory left behind: now a worker exits as gunicorn's failed boot, and the master
    stops with it, as `embedsvc serve --workers` does (the other workers exit too, not as
    failed boots: a second one made the halting master raise, a traceback and exit 1).
    "late": the second worker warms only after the halting master's SIGTERM; it started a
    second engine in a directory made anew, and failed its boot too (a CI run, by chance)."""
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text("{}")
    runtime = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # room for a socket's path
    runtime.chmod(0o700)
    env = {"EMBEDSVC_MODEL": str(model), "XDG_RUNTIME_DIR": str(runtime)}
    log = tmp_path / "broken.log"
    try:
        with running({**LAUNCHES, "late": LATE}[launch], log, env=env, healthy=False,
                     cwd=str(Path(__file__).parents[2])) as server:
            code = server.exit_after_first_request()
        output = log.read_text()
        assert code == 3, output[-3000:]
        causes = [line for line in output.splitlines()
                  if "the engine process could not start: the model failed to load" in line]
        assert causes, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        assert not list(runtime.glob(f"embedsvc-{os.getuid()}/engine-*")), output[-3000:]
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
