"""Issue 41's descriptor attack, against a live server around the fake encoder: clients that
each pipeline eight GET /docs/swagger-ui-bundle.js (1.5 MB answers) and read nothing.

    .venv/bin/python bench/descriptors.py serve --limit 20000 --clients 160
    .venv/bin/python bench/descriptors.py gunicorn --limit 256 --clients 300

Starts `embedsvc serve` (or gunicorn with deploy/gunicorn.conf.py) under the open-files limit
``--limit`` (soft and hard) with HEALTH_PORT set, opens the clients, then once a second for
``--seconds`` prints whether the process lives, its descriptors (the worker's under
gunicorn), and the first bytes and seconds of a GET /health on the probe port and on the
serving port; then the clients leave and both are asked once more. Run from the checkout
(the fake encoder lives in tests/). Clients and server share this machine's cores.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LAUNCHERS = {
    "serve": [sys.executable, "-m", "tests.integration.fake_serve", "serve", "--port", "0"],
    "gunicorn": [str(BIN / "gunicorn"), "-b", "127.0.0.1:0", "--no-control-socket", "-c",
                 str(REPO / "deploy" / "gunicorn.conf.py"), "tests.integration.fake_app:app"],
}
PIPELINED = b"GET /docs/swagger-ui-bundle.js HTTP/1.1\r\nHost: x\r\n\r\n" * 8
_PORTS = re.compile(r"(?:serving on|Listening at:) http://127\.0\.0\.1:(\d+)")
_PROBES = re.compile(r"probes on http://127\.0\.0\.1:(\d+)")


def health(port: int) -> str:
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = sock.recv(100)[:12].decode("latin-1") or "closed"
    except OSError as exc:
        answer = type(exc).__name__
    return f"{answer} in {time.monotonic() - started:.2f}s"


def descriptors(pid: int) -> int | None:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return sum(len(os.listdir(f"/proc/{p}/fd")) for p in [pid, *map(int, children)])
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("launcher", choices=sorted(LAUNCHERS))
    parser.add_argument("--limit", type=int, default=1024)
    parser.add_argument("--clients", type=int, default=160)
    parser.add_argument("--seconds", type=int, default=8)
    args = parser.parse_args(argv)
    log = Path(f"/tmp/embedsvc-descriptors-{os.getpid()}.log")
    limit = (args.limit, args.limit)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            LAUNCHERS[args.launcher], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "EMBEDSVC_HEALTH_PORT": "0"},
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit),
            start_new_session=True)
    try:
        while not (_PORTS.search(text := log.read_text()) and _PROBES.search(text)):
            time.sleep(0.1)
        port, probes = (int(p.search(text).group(1)) for p in (_PORTS, _PROBES))
        socks = []
        for _ in range(args.clients):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(PIPELINED)
            socks.append(sock)
        for second in range(args.seconds):
            time.sleep(1)
            print(f"{second + 1}s: alive {proc.poll() is None}, descriptors "
                  f"{descriptors(proc.pid)}, probe port {health(probes)}, "
                  f"serving port {health(port)}", flush=True)
        for sock in socks:
            sock.close()
        time.sleep(2)
        print(f"after: alive {proc.poll() is None}, probe port {health(probes)}, "
              f"serving port {health(port)}")
        print("\n".join(line for line in log.read_text().splitlines()
                        if "up to" in line or "out of range" in line))
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
