"""A launch line as typed, its processes, and what clients get when its model process dies.

    PATH=.venv/bin:$PATH .venv/bin/python bench/engine_kill.py \
        "embedsvc serve --workers 4 --port 18080" 18080
    PATH=.venv/bin:$PATH .venv/bin/python bench/engine_kill.py \
        "exec gunicorn -w 4 --threads 8 -b 127.0.0.1:18081 embedsvc:app" 18081

Starts the line in a shell, waits for /health, prints the processes of its tree that map
ONNX Runtime (/proc/PID/maps) beside /info's engine pid; then 16 keep-alive clients send
one-input /v1/embeddings, the engine is SIGKILLed after 3 s, and every answer the clients
got is counted by (status, error code, Retry-After), with how long /health took to say ok
again and which processes outlived a SIGTERM to the launch.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

CLIENTS = 16


def tree(root: int) -> list[int]:
    """``root`` and its descendants, from /proc's parent pids."""
    parents = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            parents[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found = [root]
    for pid in found:
        found += [child for child, parent in parents.items() if parent == pid]
    return found


def wait_ok(url: str, timeout: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return None


def engine_pid(url: str) -> int:
    for _ in range(100):  # a gunicorn worker starts its service on its first request
        pid = httpx.get(url + "/info", timeout=5).json().get("engine_pid")
        if pid:
            return pid
        time.sleep(0.2)
    raise SystemExit("no engine pid in /info")


def load(url: str, results: collections.Counter, stop: threading.Event) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            try:
                resp = client.post(url + "/v1/embeddings",
                                   json={"input": [f"text {time.time()}"], "model": "m"})
                ok = resp.status_code == 200 and len(resp.json()["data"][0]["embedding"]) == 384
                code = "ok" if ok else resp.json().get("error", {}).get("code")
                key = (resp.status_code, code, resp.headers.get("retry-after"))
            except (httpx.HTTPError, ValueError) as exc:
                key = ("exception", type(exc).__name__, None)
            results[key] += 1


def main(line: str, port: int) -> None:
    url = f"http://127.0.0.1:{port}"
    with open(f"/tmp/engine_kill-{port}.log", "wb") as log:
        proc = subprocess.Popen(line, shell=True, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    if wait_ok(url, 120) is None:
        raise SystemExit(f"not healthy: see /tmp/engine_kill-{port}.log")
    engine = engine_pid(url)
    pids = tree(proc.pid)
    mappers = [p for p in pids if "onnxruntime" in Path(f"/proc/{p}/maps").read_text()]
    print(f"{len(pids)} processes; mapping onnxruntime: {mappers}; /info's engine: {engine}")
    results: collections.Counter = collections.Counter()
    stop = threading.Event()
    for _ in range(CLIENTS):
        threading.Thread(target=load, args=(url, results, stop), daemon=True).start()
    time.sleep(3)
    print("before the kill:", dict(results))
    os.kill(engine, signal.SIGKILL)
    time.sleep(0.5)
    back = wait_ok(url, 60)
    time.sleep(3)
    stop.set()
    print("every answer:", dict(results))
    again = "never" if back is None else f"{back + 0.5:.1f} s after the kill"
    print(f"/health ok again: {again}; new engine {engine_pid(url)}")
    pids = tree(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)
    time.sleep(10)
    print("left 10 s after SIGTERM:", [p for p in pids if os.path.exists(f"/proc/{p}")])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
