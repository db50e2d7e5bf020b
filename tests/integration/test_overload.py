"""Overload on `embedsvc serve` processes (issue 45): a burst past what the deadline allows is
refused at once with 429 and Retry-After, not left to wait into a 504, in one process and
with an engine process behind two fronts. The device is the fake encoder's sleep per padded
token (tests/integration/fake_serve.py), so the rate is known."""

import re
import threading
import time
from collections import Counter

import pytest

from .. import loopback
from .servers import FAKE_EMBEDSVC, running

LAUNCHES = {"one process": [], "workers 2": ["--workers", "2"]}
TEXTS = [f"burst input {k} of a large request" for k in range(300)]  # ~9 tokens each


def warm(url: str) -> None:
    """Back-to-back batches, from each front, so that admission has learned the rate."""
    deadline = time.monotonic() + 60
    ok = 0
    while ok < 6 and time.monotonic() < deadline:
        ok += loopback.post(url + "/embed", json={"inputs": TEXTS[:64]},
                            timeout=30).status_code == 200


def tokenized(url: str) -> float:
    """Requests tokenized so far, in every process (a front's count reaches a scrape within
    its snapshot's second)."""
    time.sleep(1.5)
    text = loopback.get(url + "/metrics").text
    found = re.search(r"^embedsvc_tokenization_seconds_count(?:\{[^}]*\})? (\S+)$", text, re.M)
    assert found is not None, text[:2000]
    return float(found.group(1))


@pytest.mark.alone  # the deadline's 429s are predicted from the device's best recent rate
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_a_burst_past_the_deadline_gets_429_at_once_not_504(tmp_path, launch):
    """48 clients x 300 inputs at once, about 6 s of device work, with a 2 s deadline: the
    work that cannot reach the model in time is refused at once with Retry-After; before,
    it waited into a 504: batches of same-length inputs were filled in submission order, not
    in the fair queue's, and a request waiting for room in admission's FIFO was admitted on
    the queue's wait alone."""
    cmd = [*FAKE_EMBEDSVC, "serve", "--port", "0", "--threads", "64",
           "--request-timeout-s", "2", "--max-batch-tokens", "2048", *LAUNCHES[launch]]
    env = {"FAKE_SERVE_PER_TOKEN_S": "4e-5"}
    results: list = []
    with running(cmd, tmp_path / "server.log", env=env) as server:
        warm(server.url)
        before = tokenized(server.url)
        start = threading.Barrier(48)

        def client() -> None:
            with loopback.Client(base_url=server.url, timeout=60) as c:
                start.wait()
                began = time.monotonic()
                resp = c.post("/embed", json={"inputs": TEXTS})
                results.append((resp.status_code, time.monotonic() - began,
                                resp.headers.get("Retry-After")))

        threads = [threading.Thread(target=client) for _ in range(48)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        spent = tokenized(server.url) - before
        assert loopback.post(server.url + "/embed", json={"inputs": "after"}).status_code == 200
    counts = Counter(s for s, _, _ in results)
    assert sum(counts.values()) == 48 and counts[200] > 0, counts
    # On 56f566e: {200: 19, 504: 29}, not one 429. At 9bbf30d most refusals were 429s, but
    # up to 11 of 25 were 504s: a batch given to the oldest started request (the batcher's
    # floor) moved the virtual time to its own tags, so the requests admitted from the FIFO
    # started behind every other client's queued work and never ran in time; then one did
    # still, granted from the FIFO 80 ms before its deadline with a batch of 0.12 s ahead.
    # Now: at least 80% of the refusals are immediate 429s (issue 45), here 15 of 15.
    refused = [(took, retry) for s, took, retry in results if s == 429]
    assert len(refused) >= 10 and len(refused) >= 0.8 * (len(refused) + counts[504]), counts
    # at once: before any admitted request could have waited out the deadline
    assert all(retry is not None and int(retry) >= 1 for _, retry in refused), refused
    assert all(took < 1.0 for took, _ in refused), sorted(took for took, _ in refused)[-3:]
    # A refusal costs no tokenizing, in one process and under --workers: room is reserved
    # in the engine's admission before a request is tokenized (docs/batching.md). Under
    # --workers the fronts used to tokenize first and the engine to admit: all 48 were
    # tokenized there (bench/RESULTS.md, 2026-12-06).
    assert spent <= counts[200] + counts[504] + 3, (spent, counts)
