"""The engine's CPU a request under ``--workers 2``: on shared cores, and on a core of its own.

    .venv/bin/python bench/engine_alone.py --rounds 3 --seconds 6

One ``embedsvc serve --workers 2`` over the simulated device (bench/sim_server.py), loaded by
wrk at 32 clients x 1 input (bench/embed.lua), in two placements that alternate round by
round: every process on every core (as ``bench/workers.py sim`` runs it), and the engine
pinned alone to the last core with the fronts, the supervisor and wrk on the others
(``taskset``: Linux). Per round it prints the rate, wrk's p50, the engine's CPU a request
(its ``/proc`` clock), the requests the engine took per wake-up (its threads' voluntary
context switches: each sleep in its poll is one) and the fronts' CPU a request.

It asks what the engine's CPU a request follows on a host: the cores it shares, or how many
requests each of its wake-ups finds. On 2 cores the fronts pinned to one core deliver fewer
requests at a time, so this is no stand-in for a larger host, only a measure of that
dependence.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import run  # noqa: E402 - the path above makes the repository importable


def children(pid: int) -> dict[str, list[int]]:
    """The supervisor's children by role: ``engine`` and ``front``."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    roles: dict[str, list[int]] = {}
    for child in map(int, out.split()):
        argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        role = "engine" if b"engine" in argv else "front" if b"front" in argv else "other"
        roles.setdefault(role, []).append(child)
    return roles


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sleeps(pid: int) -> int:
    """Voluntary context switches of all of ``pid``'s threads."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                total += int(line.split()[1])
    return total


def pin(pid: int, cpus: str) -> None:
    subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(pid)], check=True,
                   capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=6)
    parser.add_argument("--port", type=int, default=18790)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    if cores < 2:
        sys.exit("needs two cores or more")
    last, rest, every = str(cores - 1), f"0-{cores - 2}", f"0-{cores - 1}"
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "sim_server.py"), "--port", str(args.port),
         "--workers", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        for _ in range(240):
            try:
                if httpx.post(url + "/v1/embeddings", json={"input": "x"}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        time.sleep(1)
        roles = children(server.pid)
        engine, fronts = roles["engine"][0], roles["front"]
        sc = run.SCENARIOS[1]  # 32x1
        env = {**os.environ, "BENCH_ROUTE": "/v1/embeddings", "BENCH_INPUTS": "1",
               "BENCH_MIN_WORDS": str(sc.min_words), "BENCH_MAX_WORDS": str(sc.max_words),
               "BENCH_BODIES": str(run.bodies_file(sc))}
        print("| round | placement | req/s | p50 ms | engine CPU us/req | requests a wake-up "
              "| fronts CPU us/req |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for n in range(1, args.rounds + 1):
            for alone in (False, True):
                pin(engine, last if alone else every)
                for pid in (*fronts, server.pid):
                    pin(pid, rest if alone else every)
                wrk = (["taskset", "-c", rest] if alone else []) + [
                    "wrk", "-t1", "-c32", "--timeout", "60s", "-s",
                    str(run.BENCH / "embed.lua"), url]
                subprocess.run([*wrk, "-d2s"], capture_output=True, env=env, check=True)
                cpu, woke = cpu_seconds(engine), sleeps(engine)
                front_cpu = sum(map(cpu_seconds, fronts))
                out = subprocess.run([*wrk, f"-d{args.seconds}s"], capture_output=True,
                                     text=True, env=env, check=True).stdout
                stats = json.loads(out.strip().splitlines()[-1])
                done = stats["requests"]
                print(f"| {n} | {'engine alone on a core' if alone else 'shared cores'} "
                      f"| {done / stats['seconds']:,.0f} | {stats['p50_ms']} "
                      f"| {(cpu_seconds(engine) - cpu) / done * 1e6:.1f} "
                      f"| {done / max(1, sleeps(engine) - woke):.2f} "
                      f"| {(sum(map(cpu_seconds, fronts)) - front_cpu) / done * 1e6:.1f} |",
                      flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


if __name__ == "__main__":
    main()
