"""How new connections spread over the fronts of ``embedsvc serve --workers N``.

    .venv/bin/python bench/spread.py --rounds 20 --connections 64 -- \\
        .venv/bin/python -m tests.integration.fake_serve serve --port 0 --workers 2

Starts the command (any server that logs ``serving on http://HOST:PORT`` and answers
``/info`` with the answering process's ``pid``), then, each round, opens ``--connections``
connections at once and asks each which process answers it: a keep-alive client stays with
the front that accepted it, so this spread is the load's. Prints each round's counts, sorted,
and the mean distance of the busiest front from an even share.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import subprocess
import sys
import tempfile
import time
from statistics import mean

SERVING = re.compile(r"serving on http://[\d.]+:(\d+)")


def started(cmd: list[str], log_path: str, timeout: float = 60) -> tuple[subprocess.Popen, int]:
    log = open(log_path, "w")  # noqa: SIM115 - the server's whole life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log_path) as text:
            found = SERVING.search(text.read())
        if found:
            return proc, int(found.group(1))
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"no 'serving on' line in {timeout:.0f}s; see {log_path}")


def one_round(port: int, connections: int) -> list[int]:
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10)
             for _ in range(connections)]
    for conn in conns:
        conn.connect()
    counts: dict[int, int] = {}
    for conn in conns:
        conn.request("GET", "/info")
        pid = json.loads(conn.getresponse().read())["pid"]
        counts[pid] = counts.get(pid, 0) + 1
        conn.close()
    return sorted(counts.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--fronts", type=int, default=2)
    parser.add_argument("--settle-s", type=float, default=3.0, help="wait for every front")
    parser.add_argument("cmd", nargs="+")
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile(suffix=".log", delete=False) as log:
        proc, port = started(args.cmd, log.name)
    try:
        time.sleep(args.settle_s)
        rounds = [one_round(port, args.connections) for _ in range(args.rounds)]
    finally:
        proc.terminate()
        proc.wait(30)
    even = args.connections / args.fronts
    print("counts by front, each round:", " ".join("/".join(map(str, r)) for r in rounds))
    over = [r[-1] - even for r in rounds]
    print(f"busiest front over an even share ({even:g}): mean {mean(over):.1f}, "
          f"max {max(over):g}")


if __name__ == "__main__":
    main()
