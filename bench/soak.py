"""Soak test: steady load on a real `embedsvc serve`, sampling RSS, threads and open fds.

    .venv/bin/python bench/soak.py --duration 600 --interval 30 --clients 8
    .venv/bin/python bench/soak.py --duration 600 --interval 30 --clients 8 --hostile 150
    .venv/bin/python bench/soak.py --duration 600 --interval 30 --clients 8 --expensive 2
    .venv/bin/python bench/soak.py --duration 600 --interval 30 --clients 8 --attacks 2

Starts the server on a free loopback port (the bundled model on the CPU), sends requests
from --clients threads for --duration seconds, and prints one row per --interval: requests
served so far, errors, and the server's resident memory, thread count and open file
descriptors. Flat columns mean nothing leaks. The load runs on the same cores as the server.

--hostile N keeps N hostile connections open beside the normal clients, a third each:
idle (sending nothing), trickling a request head one byte a second, and trickling a body
one byte a second after a complete head; each one the server closes is opened again. The
summary gives the normal clients' latency (p50, p99) and 5xx count, to compare with a run
without --hostile, and how many hostile connections the server closed.

--attacks N adds N clients that send, back to back, the embedding server's attacks of issue
26: a 2 MB list of a million ids ending in a float, 16 MB of /decode ids, /embed_all over
its cap and at it, and 16 MB of OpenAI ids that decode to 128 spaces each. They must get
their 4xx (or 429, or 504 for a /decode still waiting at its deadline) while the normal
clients see no 5xx, a p99 close to a clean run's, and flat memory.

The --expensive and --attacks clients each run in a process of their own, as they would on
another machine; the normal clients share this one.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import multiprocessing
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

WORDS = ("embedding", "service", "batch", "token", "model", "vector", "query", "document",
         "search", "rank", "cluster", "latency", "queue", "device", "thread", "request")


def proc_stats(pid: int) -> tuple[float, int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return rss_kib / 1024, threads, fds


def start_server(log: Path, extra: list[str], timeout: float = 120
                 ) -> tuple[subprocess.Popen, str]:
    """``embedsvc serve`` on a free port, its output in ``log``; the process and its URL."""
    exe = Path(sys.executable).with_name("embedsvc")
    out = open(log, "wb")  # noqa: SIM115 - the server writes to it until it stops
    proc = subprocess.Popen([str(exe), "serve", "--port", "0", "--threads", "32", *extra],
                            stdout=out,
                            stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return proc, serving_url(proc, log, timeout)


def serving_url(proc: subprocess.Popen, log: Path, timeout: float = 120) -> str:
    """The URL of the server ``proc`` once its ``log`` says it serves; exits if it dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"serving on (http://\S+) ", log.read_text(errors="replace"))
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{log.read_text()}")
        time.sleep(0.2)
    raise SystemExit("server did not start")


def client(url: str, stop: threading.Event, counts: dict[str, int], lock: threading.Lock,
           latencies: list[float]) -> None:
    rng = random.Random()
    with httpx.Client(base_url=url, timeout=60) as c:
        while not stop.is_set():
            inputs = [" ".join(rng.choices(WORDS, k=rng.randint(3, 40)))
                      for _ in range(rng.choice((1, 1, 1, 4, 16)))]
            started = time.monotonic()
            try:
                status = c.post("/embed", json={"inputs": inputs}).status_code
            except httpx.HTTPError:
                status = 0
            with lock:
                counts["ok" if status == 200 else "errors"] += 1
                counts["5xx"] += status >= 500
                if status != 200:
                    counts[f"error {status}"] = counts.get(f"error {status}", 0) + 1
                if status == 200:
                    latencies.append(time.monotonic() - started)


HEAD = b"POST /embed HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
BODY_HEAD = HEAD + b"Content-Length: 1000\r\n\r\n"


def hostile(url: str, count: int, stop: threading.Event, counts: dict[str, int]) -> None:
    """Keep ``count`` idle, slow-head and slow-body connections open; reopen closed ones."""
    host, port = url.removeprefix("http://").split(":")
    kinds = ("idle", "head", "body")
    slots: list[list] = [[kinds[i % 3], None, 0] for i in range(count)]
    while not stop.wait(1.0):
        for slot in slots:
            kind, sock, sent = slot
            try:
                if sock is None:
                    sock = socket.create_connection((host, int(port)), timeout=5)
                    sock.setblocking(False)
                    sent = 0
                    if kind == "body":
                        sock.send(BODY_HEAD)
                    counts["hostile_opened"] += 1
                elif _closed(sock):
                    raise ConnectionResetError
                elif kind != "idle":
                    sock.send(b"x" if kind == "body" else HEAD[sent % len(HEAD):][:1])
                    sent += 1
                slot[1], slot[2] = sock, sent
            except OSError:
                counts["hostile_closed"] += sock is not None
                if sock is not None:
                    sock.close()
                slot[1] = None
    for slot in slots:
        if slot[1] is not None:
            slot[1].close()


def _closed(sock: socket.socket) -> bool:
    try:
        sock.recv(65536)  # an answer (a 408) or the end of the connection
    except BlockingIOError:
        return False
    return True


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def expensive_bodies() -> list[bytes]:
    """The largest requests the defaults allow: a 16 MB body of '!' (80 inputs x 200,000,
    one token per character) and 2,048 inputs."""
    bangs = b'{"inputs": [' + b",".join([b'"' + b"!" * 200_000 + b'"'] * 80) + b"]}"
    many = ('{"inputs": [' + ",".join(f'"soak input number {i}"' for i in range(2048))
            + "]}").encode()
    return [bangs, many]


def expensive_client(url: str, stop: threading.Event, counts: dict[str, int],
                     lock: threading.Lock) -> None:
    """Sends the largest requests back to back; 429 is an answer, anything else but 200 an
    error. Counted apart from the normal clients."""
    bodies = expensive_bodies()
    with httpx.Client(base_url=url, timeout=120) as c:
        for k in itertools.count():
            if stop.is_set():
                return
            try:
                status = c.post("/embed", content=bodies[k % 2],
                                headers={"content-type": "application/json"}).status_code
            except httpx.HTTPError:
                status = 0
            if status == 429:
                time.sleep(1)
            key = {200: "big ok", 429: "big 429"}.get(status, "big errors")
            with lock:
                counts[key] += 1


def attack_bodies() -> list[tuple[str, bytes]]:
    """(route, body) of each attack on an embedding model (issue 26)."""
    ids = ",".join(["1"] * 4090)
    openai = ",".join(["58040"] * 1364)
    return [
        ("/embed", b'{"inputs": [' + b"1," * 999_999 + b"1.5]}"),
        ("/decode", ('{"ids": [' + ",".join([f"[{ids}]"] * 2048) + "]}").encode()),
        ("/embed_all", ('{"inputs": [' + ",".join(['"' + "!" * 254 + '"'] * 33) + "]}").encode()),
        ("/embed_all", ('{"inputs": [' + ",".join(['"' + "!" * 254 + '"'] * 32) + "]}").encode()),
        ("/v1/embeddings", ('{"input": [' + ",".join([f"[{openai}]"] * 2048) + "]}").encode()),
    ]


def attack_client(url: str, stop: threading.Event, counts: dict[str, int],
                  lock: threading.Lock, by_route: dict[str, int]) -> None:
    """Sends the attacks in turn; an answer in 4xx or a 504 is what they should get (the
    valid ones, /embed_all at its cap and the /decode, may get 200); anything else is
    counted as an attack error. ``by_route`` counts the answers by route and status."""
    bodies = attack_bodies()
    with httpx.Client(base_url=url, timeout=120) as c:
        for k in itertools.count():
            if stop.is_set():
                return
            route, body = bodies[k % len(bodies)]
            try:
                status = c.post(route, content=body,
                                headers={"content-type": "application/json"}).status_code
            except httpx.HTTPError:
                if stop.is_set():  # cut off by the server's shutdown at the end of the run
                    return
                status = 0
            # The 16 MB /decode is valid (ids in the vocabulary): decoded (200), or 504 at
            # its deadline; /embed_all at its cap is valid too
            refused = 400 <= status < 500 or status == 504 or (status == 200 and route in (
                "/embed_all", "/decode"))
            with lock:
                counts["attacks answered" if refused else "attack errors"] += 1
                by_route[f"{route} {status}"] = by_route.get(f"{route} {status}", 0) + 1


def apart(target: Callable[..., None], url: str, stop: Any, results: Any) -> None:
    """One heavy client (``expensive_client`` or ``attack_client``) in a process of its own,
    as on another machine: in the process of the normal clients, its reading of 35 MB answers
    and its building of 16 MB bodies would hold their GIL and count in their latencies."""
    counts: collections.Counter[str] = collections.Counter()
    by_route: dict[str, int] = {}
    extra = (by_route,) if target is attack_client else ()
    target(url, stop, counts, threading.Lock(), *extra)
    results.put((dict(counts), by_route))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600, help="seconds of load")
    parser.add_argument("--interval", type=float, default=30, help="seconds between samples")
    parser.add_argument("--clients", type=int, default=8, help="client threads")
    parser.add_argument("--expensive", type=int, default=0,
                        help="extra clients sending maximal bodies of '!' and 2048-input "
                        "requests, back to back")
    parser.add_argument("--attacks", type=int, default=0,
                        help="extra clients sending issue 26's attack bodies, back to back")
    parser.add_argument("--hostile", type=int, default=0,
                        help="hostile connections beside the clients (idle, slow head, slow body)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra argument for 'embedsvc serve' (repeat for several)")
    args = parser.parse_args(argv)

    log = Path(tempfile.mkdtemp(prefix="embedsvc-soak-")) / "server.log"
    proc, url = start_server(log, args.serve_arg)
    stop, lock = threading.Event(), threading.Lock()
    counts = {"ok": 0, "errors": 0, "5xx": 0, "hostile_opened": 0, "hostile_closed": 0,
              "big ok": 0, "big 429": 0, "big errors": 0, "attacks answered": 0,
              "attack errors": 0}
    latencies: list[float] = []
    threads = [threading.Thread(target=client, args=(url, stop, counts, lock, latencies),
                                daemon=True) for _ in range(args.clients)]
    if args.hostile:
        threads.append(threading.Thread(target=hostile, args=(url, args.hostile, stop, counts),
                                        daemon=True))
    # forked before any thread of this process starts
    fork = multiprocessing.get_context("fork")
    heavy_stop, results = fork.Event(), fork.Queue()
    heavy = [fork.Process(target=apart, args=(target, url, heavy_stop, results), daemon=True)
             for target in [expensive_client] * args.expensive + [attack_client] * args.attacks]
    for p in heavy:
        p.start()
    for t in threads:
        t.start()
    print(f"soak: {args.clients} clients, {args.hostile} hostile connections, "
          f"{args.expensive} expensive and {args.attacks} attacking clients for "
          f"{args.duration:.0f}s against {url} "
          f"(pid {proc.pid})")
    print("| t (s) | requests ok | errors | RSS (MiB) | threads | open fds |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = []
    started = time.monotonic()
    try:
        while True:
            elapsed = time.monotonic() - started
            rss, nthreads, fds = proc_stats(proc.pid)
            rows.append((rss, nthreads, fds))
            print(f"| {elapsed:.0f} | {counts['ok']} | {counts['errors']} | {rss:.1f} | "
                  f"{nthreads} | {fds} |", flush=True)
            if elapsed >= args.duration:
                break
            time.sleep(min(args.interval, args.duration - elapsed + 0.01))
    finally:
        stop.set()
        heavy_stop.set()
        for t in threads:
            t.join(30)
        attack_answers: dict[str, int] = {}
        for _ in heavy:
            heavy_counts, by_route = results.get(timeout=150)
            for key, n in heavy_counts.items():
                counts[key] = counts.get(key, 0) + n
            for key, n in by_route.items():
                attack_answers[key] = attack_answers.get(key, 0) + n
        for p in heavy:
            p.join(30)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    warm = rows[1] if len(rows) > 1 else rows[0]
    last = rows[-1]
    failed = "".join(f", {v} x {k}" for k, v in sorted(counts.items()) if k.startswith("error "))
    print(f"\nafter warm-up sample -> end: RSS {warm[0]:.1f} -> {last[0]:.1f} MiB "
          f"(max {max(r[0] for r in rows):.1f}), threads {warm[1]} -> {last[1]}, "
          f"fds {warm[2]} -> {last[2]}; {counts['ok']} requests ok, {counts['errors']} errors "
          f"({counts['5xx']} 5xx{failed}); latency p50 {percentile(latencies, 0.5) * 1000:.0f} ms, "
          f"p99 {percentile(latencies, 0.99) * 1000:.0f} ms; hostile connections opened "
          f"{counts['hostile_opened']}, closed by the server {counts['hostile_closed']}; "
          f"server exit code {code}")
    if args.expensive:
        print(f"expensive clients: {counts['big ok']} ok, {counts['big 429']} 429, "
              f"{counts['big errors']} errors")
    if args.attacks:
        print(f"attacking clients: {counts['attacks answered']} answered as they should be, "
              f"{counts['attack errors']} otherwise; by route and status: "
              + ", ".join(f"{k} x{v}" for k, v in sorted(attack_answers.items())))
    clean = counts["errors"] == counts["big errors"] == counts["attack errors"] == 0
    return 0 if clean and code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
