"""Start real server processes on loopback port 0 and find the port they report; share one
process per configuration across the whole run (``Shared``)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from .. import loopback

BIN = Path(sys.executable).parent
_PORT_LINES = re.compile(
    r"(?:Listening at: http://127\.0\.0\.1:|Serving on http://127\.0\.0\.1:|serving on "
    r"http://127\.0\.0\.1:)(\d+)"
)

# `embedsvc` around the fake encoder (tests/integration/fake_serve.py); run from the checkout
FAKE_EMBEDSVC = ["python", "-m", "tests.integration.fake_serve"]
_PROBES = re.compile(r"probes on http://127\.0\.0\.1:(\d+)")
_FRONT_READY = re.compile(r"engine ready: pid=(\d+) .*\(this front: pid (\d+)\)")


@dataclass
class Server:
    proc: subprocess.Popen | None  # None in the processes that did not start it (Shared)
    port: int
    log: Path
    started_pid: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else self.started_pid  # type: ignore[return-value]

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return _alive(self.pid)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def probe_url(self, timeout: float = 10) -> str:
        """The base URL of the probe port (HEALTH_PORT) the server logged."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = _PROBES.search(self.output())
            if found:
                return f"http://127.0.0.1:{found.group(1)}"
            time.sleep(0.1)
        raise AssertionError(f"no probe port logged:\n{self.output()[-2000:]}")

    def exit_after_first_request(self, timeout: float = 30) -> int | None:
        """The exit code of a server that stops as its app is built (gunicorn's workers build
        it on their first request); None if it is still running after ``timeout``."""
        with contextlib.suppress(httpx.HTTPError):
            loopback.get(self.url + "/health", timeout=timeout)
        assert self.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        return self.proc.poll()

    def client(self, **kwargs) -> httpx.Client:
        return loopback.Client(base_url=self.url, timeout=60, **kwargs)

    def _poke(self) -> None:
        with contextlib.suppress(httpx.HTTPError):
            loopback.get(self.url + "/health", timeout=10)

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if loopback.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.alive(), f"server exited:\n{self.output()}"
            time.sleep(0.2)
        raise AssertionError(f"not healthy after {timeout}s:\n{self.output()}")

    def wait_fronts(self, fronts: int, timeout: float = 60) -> None:
        """Until ``fronts`` HTTP processes have the current engine's card: /health says ok as
        soon as one front has it, and a connection the other takes meanwhile gets 503.

        A gunicorn worker meets the engine at its first request, and the kernel may hand
        every connection of a client that asks one at a time to the same worker: so it asks
        with ``fronts`` connections at once, and a worker busy meeting the engine leaves the
        next to another."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = [found.groups() for found in _FRONT_READY.finditer(self.output())]
            latest = ready[-1][0] if ready else None
            if len({front for engine, front in ready if engine == latest}) >= fronts:
                return
            assert self.alive(), f"server exited:\n{self.output()}"
            pokes = [threading.Thread(target=self._poke) for _ in range(fronts)]
            for poke in pokes:
                poke.start()
            for poke in pokes:
                poke.join()
            time.sleep(0.1)
        raise AssertionError(f"not {fronts} fronts ready after {timeout}s:\n{self.output()}")


def _wait_port(proc: subprocess.Popen, log: Path, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _PORT_LINES.search(log.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.1)
    raise AssertionError(f"no port reported after {timeout}s:\n{log.read_text()}")


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None,
          cwd: str | None = None) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    exe = str(BIN / cmd[0]) if (BIN / cmd[0]).exists() else cmd[0]
    with open(log, "wb") as out:
        return subprocess.Popen([exe, *cmd[1:]], stdout=out, stderr=subprocess.STDOUT,
                                env=full_env, cwd=cwd, start_new_session=True)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode


@contextmanager
def running(cmd: list[str], log: Path, env: dict[str, str] | None = None, healthy: bool = True,
            cwd: str | None = None, timeout: float = 120) -> Iterator[Server]:
    proc = start(cmd, log, env, cwd)
    try:
        server = Server(proc, _wait_port(proc, log, timeout), log)
        if healthy:
            server.wait_healthy(timeout)
        yield server
    finally:
        stop(proc)
        if proc.poll() is None:  # pragma: no cover - stop() already escalated
            os.killpg(proc.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# set by tests/conftest.py in the controlling process; not EMBEDSVC_*, the settings, of which
# a server warns when it knows no such one
SHARED_DIR = "TESTS_EMBEDSVC_SHARED"


class Shared:
    """One server process per configuration for the whole run, shared by the xdist workers.

    The first worker to ask for a name starts its server and records pid and port in
    ``root``; the others find the record. Whoever made ``root`` calls ``stop_all`` at the end
    (tests/conftest.py in the controller). A test holds a server through ``use``: shared, or
    exclusive where it counts the server's metrics or measures its memory, so that no other
    test's traffic reaches it meanwhile.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def get(self, name: str, cmd: list[str], env: dict[str, str] | None = None,
            cwd: str | None = None, timeout: float = 120) -> Server:
        log, record = self.root / f"{name}.log", self.root / f"{name}.json"
        with _flock(self.root / f"{name}.start", fcntl.LOCK_EX):
            if record.exists():
                known = json.loads(record.read_text())
                server = Server(None, known["port"], log, known["pid"])
                assert server.alive(), f"the shared server {name} exited:\n{server.output()}"
                return server
            proc = start(cmd, log, env, cwd)
            server = Server(proc, _wait_port(proc, log, timeout), log)
            server.wait_healthy(timeout)
            record.write_text(json.dumps({"pid": proc.pid, "port": server.port}))
            return server

    def building(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Held while one worker builds what the others then find (a model directory)."""
        return _flock(self.root / f"{name}.build", fcntl.LOCK_EX)

    @contextmanager
    def use(self, *names: str, exclusive: bool = False) -> Iterator[None]:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        with contextlib.ExitStack() as held:
            for name in sorted(names):  # one order for every test: no deadlock
                held.enter_context(_flock(self.root / f"{name}.use", mode))
            yield

    def stop_all(self, timeout: float = 60) -> None:
        """SIGTERM to every shared server, then wait until each has exited; one that is this
        process's child (tests/conftest.py makes the controller their subreaper, so the
        servers of workers that exited are) is reaped, so that its CPU time is counted."""
        pids = [json.loads(r.read_text())["pid"] for r in self.root.glob("*.json")]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        running = set(pids)
        while running and time.monotonic() < deadline:
            for pid in list(running):
                try:
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        running.discard(pid)
                except ChildProcessError:  # not this process's child: watch it exit
                    if not _alive(pid):
                        running.discard(pid)
            time.sleep(0.1)
        for pid in running:  # pragma: no cover - a drain longer than the timeout
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def counter_series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter's and histogram's series in a /metrics answer (but ``_created``, a
    timestamp): what must never read less in a later scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            if family.type in ("counter", "histogram")
            for s in family.samples if not s.name.endswith("_created")}


def assert_monotonic(scrapes: list[str]) -> None:
    """No series of ``counter_series`` reads less than in an earlier scrape, or vanishes."""
    last: dict = {}
    for i, text in enumerate(scrapes):
        now = counter_series(text)
        for key, value in last.items():
            assert now.get(key, -1.0) >= value, f"scrape {i}: {key} {value} -> {now.get(key)}"
        last = now
