"""Light clients beside heavy ones that fill the room (admission's fairness across fronts), on the
fake encoder's device:

    flock /tmp/embedsvc-bench.lock .venv/bin/python bench/light_beside_heavy.py one
    flock /tmp/embedsvc-bench.lock .venv/bin/python bench/light_beside_heavy.py w2

`embedsvc serve` (``one``) or ``--workers 2`` (``w2``) of the checkout this runs from, with
MAX_QUEUE 64, a 1 s deadline and 10,000 padded tokens a device-second: 4 heavy clients send
64 inputs of 60 tokens (the whole room, about 0.4 s of device each), 8 light ones a single
short input, for 6 s. Prints each side's statuses and the light requests' p50 and p99. Run
it from another tree's checkout (its PYTHONPATH) to compare trees.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.getcwd())
from tests import loopback  # noqa: E402
from tests.integration.servers import FAKE_EMBEDSVC, running  # noqa: E402

SECONDS = 6.0


def client(url: str, stop: float, inputs: int, words: int, statuses: Counter,
           waits: list[float] | None) -> None:
    with loopback.Client(base_url=url, timeout=30) as c:
        while time.monotonic() < stop:
            began = time.monotonic()
            resp = c.post("/embed", json={"inputs": [" ".join(["w"] * words)] * inputs})
            statuses[resp.status_code] += 1
            if waits is not None and resp.status_code == 200:
                waits.append(time.monotonic() - began)
            if resp.status_code == 429:
                time.sleep(0.05)


def main(launch: str) -> None:
    cmd = [*FAKE_EMBEDSVC, "serve", "--port", "0", "--threads", "32", "--max-queue", "64",
           "--request-timeout-s", "1", *(["--workers", "2"] if launch == "w2" else [])]
    heavy: Counter = Counter()
    light: Counter = Counter()
    waits: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, running(
            cmd, Path(tmp) / "server.log", env={"FAKE_SERVE_PER_TOKEN_S": "1e-4"}) as server:
        for _ in range(10):
            loopback.post(server.url + "/embed", json={"inputs": ["warm up"] * 16}, timeout=30)
        stop = time.monotonic() + SECONDS
        threads = [threading.Thread(target=client, args=(server.url, stop, 64, 58, heavy, None))
                   for _ in range(4)]
        threads += [threading.Thread(target=client, args=(server.url, stop, 1, 3, light, waits))
                    for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    waits.sort()

    def ms(q: float) -> float:
        return waits[int(q * (len(waits) - 1))] * 1000 if waits else 0.0

    print(f"{launch}: heavy {dict(heavy)}, light {dict(light)}, light p50 {ms(0.5):.0f} ms, "
          f"p99 {ms(0.99):.0f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
