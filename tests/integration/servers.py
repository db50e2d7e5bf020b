"""Start real server processes on loopback port 0 and find the port they report."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
_PORT_LINES = re.compile(
    r"(?:Listening at: http://127\.0\.0\.1:|Serving on http://127\.0\.0\.1:|serving on "
    r"http://127\.0\.0\.1:)(\d+)"
)


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, f"server exited:\n{self.output()}"
            time.sleep(0.2)
        raise AssertionError(f"not healthy after {timeout}s:\n{self.output()}")


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
