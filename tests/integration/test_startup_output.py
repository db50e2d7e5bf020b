"""A server's startup output is its startup lines and nothing else: no progress bars, no
library warnings; and /metrics carries no ``*_created`` samples."""

from __future__ import annotations

import re
import time

from .. import loopback
from .servers import Server, running

_OURS = r"\S+ \S+ INFO \[\d+\] embedsvc\."
# on a first start only: the export record (or ONNX graph) built into the cache
BUILT = _OURS + (r"model\.(onnx_backend: (exporting|quantizing) .*, once: later starts read "
                 r"it from .*|backend: first start of .*: exporting it once to .*)")
BACKEND = _OURS + r"model\.backend: backend: .*"
MODEL_READY = _OURS + r"service: model ready: pid=\d+ device=cpu .*"
SERVING = (r"\S+ \S+ INFO \[\d+\] embedsvc\.serving\.server: serving on "
           r"http://127\.0\.0\.1:\d+ .*")
WAITRESS = r"INFO:waitress:Serving on http://127\.0\.0\.1:\d+"
GUNICORN = r"\[[^]]+\] \[\d+\] \[INFO\] .*"


def access(method: str, route: str, status: int) -> str:
    return (rf"\S+ \S+ INFO \[\d+\] embedsvc\.access: {method} {re.escape(route)} {status} "
            r"inputs=0 tokens=0 ms=[\d.]+")


def lines_when(server: Server, pattern: str, timeout: float = 300) -> list[str]:
    """The output's lines, once a line matches ``pattern``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = server.output().splitlines()
        if any(re.fullmatch(pattern, line) for line in lines):
            return lines
        assert server.proc.poll() is None, server.output()
        time.sleep(0.1)
    raise AssertionError(f"no line like {pattern!r} after {timeout}s:\n{server.output()}")


def assert_lines(lines: list[str], patterns: list[str]) -> None:
    built = [line for line in lines if re.fullmatch(BUILT, line)]
    assert len(built) <= 1, built
    lines = [line for line in lines if line not in built]
    assert len(lines) == len(patterns), "\n".join(lines)
    for line, pattern in zip(lines, patterns, strict=True):
        assert re.fullmatch(pattern, line), f"{line!r} is not like {pattern!r}"


def assert_no_created_samples(server: Server) -> None:
    text = loopback.get(server.url + "/metrics", timeout=30).text
    assert "embedsvc_requests_total" in text
    assert not [ln for ln in text.splitlines() if "_created" in ln]


def test_embedsvc_serve_prints_its_startup_lines_only(served):
    # the shared server: its first request was the GET /health that found it ready
    lines = lines_when(served, access("GET", "/health", 200))
    first = next(i for i, line in enumerate(lines) if " embedsvc.access: " in line)
    assert_lines(lines[: first + 1], [BACKEND, MODEL_READY, SERVING, access("GET", "/health", 200)])
    assert_no_created_samples(served)


def test_waitress_serve_prints_its_startup_lines_only(tmp_path):
    cmd = ["waitress-serve", "--host=127.0.0.1", "--port=0", "embedsvc:app"]
    with running(cmd, tmp_path / "waitress.log", healthy=False, cwd=str(tmp_path)) as server:
        # the first request of any kind starts the model loading; /health says so at once
        assert loopback.get(server.url + "/health", timeout=30).status_code == 503
        lines = lines_when(server, MODEL_READY)
        assert_lines(lines, [WAITRESS, access("GET", "/health", 503), BACKEND, MODEL_READY])
        assert_no_created_samples(server)


def test_gunicorn_prints_its_own_startup_lines_and_ours_only(tmp_path):
    cmd = ["gunicorn", "-b", "127.0.0.1:0", "--no-control-socket", "-w", "1", "--threads", "4",
           "embedsvc:app"]
    with running(cmd, tmp_path / "gunicorn.log", healthy=False, cwd=str(tmp_path)) as server:
        assert loopback.get(server.url + "/health", timeout=30).status_code == 503
        lines = lines_when(server, MODEL_READY)
        ours = [line for line in lines if not re.fullmatch(GUNICORN, line)]
        assert_lines(ours, [access("GET", "/health", 503), BACKEND, MODEL_READY])
        assert len(lines) - len(ours) >= 3  # starting, listening, booting worker
        assert_no_created_samples(server)
