"""Overload on a live `embedsvc serve` (issue 45): a burst past what the deadline allows,
counted by status (and how many 429s carried Retry-After), with how many of its requests were
tokenized (a refusal before tokenizing costs none), then a single-input client beside 24
clients of 300 inputs each, its latency percentiles.

    PYTHONPATH=$PWD .venv/bin/python bench/overload.py                 # fake device
    PYTHONPATH=$PWD .venv/bin/python bench/overload.py --workers 2
    PYTHONPATH=$PWD .venv/bin/python bench/overload.py --real          # the bundled model

The fake device is tests/integration/fake_serve.py: the real server around a FakeEncoder
that sleeps --per-token-s per padded token, so the rate is known and runs repeat.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.soak import serving_url  # noqa: E402 - the path above makes the repository importable

TEXTS = [f"overload input {k} of a large request" for k in range(300)]


def start(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    head = ([str(Path(sys.executable).with_name("embedsvc"))] if args.real
            else [sys.executable, "-m", "tests.integration.fake_serve"])
    cmd = [*head, "serve", "--port", "0", "--threads", "64", "--request-timeout-s",
           str(args.timeout_s), "--workers", str(args.workers)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FAKE_SERVE_PER_TOKEN_S": str(args.per_token_s)}
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    return proc, serving_url(proc, log)


def post(c: httpx.Client, texts: list[str] | str) -> tuple[int, float, str | None]:
    began = time.monotonic()
    resp = c.post("/embed", json={"inputs": texts})
    return resp.status_code, time.monotonic() - began, resp.headers.get("Retry-After")


def tokenized(url: str) -> float:
    """Requests tokenized so far in every process (a front's count reaches a scrape within
    its snapshot's second)."""
    time.sleep(1.5)
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.search(r"^embedsvc_tokenization_seconds_count(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else float("nan")


def burst(url: str, n: int) -> list[tuple[int, float, str | None]]:
    """``n`` clients of 300 inputs at once."""
    gate, out = threading.Barrier(n), []

    def one() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            gate.wait()
            out.append(post(c, TEXTS))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def beside_flood(url: str, seconds: float) -> tuple[list[float], Counter]:
    """A single-input client beside 24 clients sending 300 inputs back to back."""
    stop, heavy, light = threading.Event(), Counter(), []

    def flood() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while not stop.is_set():
                heavy[post(c, TEXTS)[0]] += 1

    threads = [threading.Thread(target=flood) for _ in range(24)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    with httpx.Client(base_url=url, timeout=120) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            status, took, _ = post(c, "one light input")
            light.append(took if status == 200 else float("inf"))
            time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(300)
    return light, heavy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--real", action="store_true")
    p.add_argument("--per-token-s", type=float, default=4e-5)
    p.add_argument("--timeout-s", type=float, default=2.0)
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start(args, Path(tmp) / "server.log")
        try:
            with httpx.Client(base_url=url, timeout=60) as c:
                for _ in range(6):  # back-to-back batches: the rate is learned
                    post(c, TEXTS[:64])
            before = tokenized(url)
            results = burst(url, args.clients)
            spent = tokenized(url) - before
            counts = Counter(s for s, _, _ in results)
            with_retry = sum(1 for s, _, r in results if s == 429 and r is not None)
            refusals = counts[429] + counts[504]
            slowest_429 = max((t for s, t, _ in results if s == 429), default=0.0)
            print(f"burst {args.clients} x 300: {dict(counts)}; 429 with Retry-After "
                  f"{with_retry}/{refusals} refusals; slowest 429 {slowest_429:.2f} s; "
                  f"tokenized {spent:.0f}")
            time.sleep(args.timeout_s + 2)
            light, heavy = beside_flood(url, args.seconds)
            light.sort()
            p50, p99 = light[len(light) // 2], light[min(len(light) - 1, int(0.99 * len(light)))]
            print(f"light client beside 24 x 300: n={len(light)} p50 {p50 * 1000:.0f} ms "
                  f"p99 {p99 * 1000:.0f} ms max {light[-1] * 1000:.0f} ms; heavy {dict(heavy)}")
        finally:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
