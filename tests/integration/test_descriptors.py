"""No client can run a server out of descriptors (issue 41, point 6).

Each server here starts as it would on a busy machine, its descriptors numbered above 1024
(a wrapper holds 1024 open first, which the server inherits: select() cannot watch such a
descriptor), under an open-files limit of those plus 512, so that a few hundred sockets reach
its bound. Clients then open connections past the bound, each pipelining large answers it
never reads or stalling in a large upload: the process must live, its probe port answer all
the while, the connections past the bound be turned away (503 or closed, never left waiting),
and service resume once the clients leave.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .. import loopback
from .servers import Server, running
from .test_connections import FAKE_LAUNCHERS, REPO, fds_to_deleted_files, read_response

HELD = 1024  # descriptors the server inherits, so that every one it opens is above select()'s
ROOM = 512  # the open-files limit: what the server holds at start, plus this
# Opens HELD descriptors that the server inherits, sets the limit (soft and hard, so that the
# server cannot raise it), then becomes the server.
WRAPPER = """
import os, resource, sys
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(int(sys.argv[1]))]
for fd in held:
    os.set_inheritable(fd, True)
limit = int(sys.argv[2]) + len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
os.execv(sys.argv[3], sys.argv[3:])
"""
PIPELINED = b"GET /docs/swagger-ui-bundle.js HTTP/1.1\r\nHost: x\r\n\r\n" * 8  # 12 MB of answers
UPLOAD = (b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
          b"Content-Length: 4194304\r\n\r\n" + b" " * (1 << 20))  # a quarter sent, then a stall
_BOUND = re.compile(r"up to (\d+) connections")


def wrapped(cmd: list[str]) -> list[str]:
    exe = str(Path(sys.executable).parent / cmd[0]) if cmd[0] != "python" else sys.executable
    return [sys.executable, "-c", WRAPPER, str(HELD), str(ROOM), exe, *cmd[1:]]


@contextlib.contextmanager
def attacking(port: int, count: int) -> Iterator[list[socket.socket]]:
    """``count`` connections: two of three pipeline large answers and never read, the third
    stall in an upload; closed on exit."""
    socks: list[socket.socket] = []
    try:
        for i in range(count):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel takes little
            sock.settimeout(5)
            sock.connect(("127.0.0.1", port))
            with contextlib.suppress(OSError):  # turned away meanwhile: as it should be
                sock.sendall(UPLOAD if i % 3 == 2 else PIPELINED)
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def health(port: int) -> int:
    return loopback.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code


def turned_away(port: int) -> bool:
    """A new connection past the bound gets a JSON 503, or is closed: never left waiting."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = read_response(sock, timeout=5)
    if status == 0:
        return True  # closed (or reset) without an answer
    return status == 503 and json.loads(body)["error"]["code"] == "too_many_connections"


@pytest.mark.parametrize("launcher", sorted(FAKE_LAUNCHERS))
def test_connections_past_the_descriptor_bound_leave_the_process_and_its_probes_alive(
        launcher, tmp_path):
    env = {"EMBEDSVC_HEALTH_PORT": "0", "EMBEDSVC_BODY_TIMEOUT_S": "60"}
    with running(wrapped(FAKE_LAUNCHERS[launcher]), tmp_path / "server.log", env=env,
                 cwd=str(REPO)) as server:
        bound = int(_BOUND.search(server.output()).group(1))
        assert 20 <= bound < ROOM, server.output()[-2000:]
        probes = int(server.probe_url().rsplit(":", 1)[1])
        pid = loopback.get(server.url + "/info", timeout=10).json()["pid"]
        with attacking(server.port, bound + 30):
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                assert health(probes) == 200  # within 5 s, every time
                time.sleep(0.2)
            assert turned_away(server.port)
            assert server.alive(), server.output()[-3000:]
            if launcher == "serve":  # waitress holds large bodies and answers in temp files
                assert 0 < len(fds_to_deleted_files(pid)) <= 4 * bound
        resumed(server)
        assert "Too many open files" not in server.output()


def resumed(server: Server, timeout: float = 30) -> None:
    """The main port serves again once the attacking clients have left."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            resp = loopback.post(server.url + "/embed", json={"inputs": "after"}, timeout=5)
            assert resp.status_code == 200 and len(resp.json()[0]) == 384
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
