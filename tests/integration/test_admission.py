"""Expensive requests on live servers: bounded tokenizing, fair admission, departed clients
(issue 17, findings 2, 4 and 5). A Retry-After that says when a retry gets in:
test_fair_admission.py."""

import os
import re
import socket
import threading
import time
from pathlib import Path

import numpy as np

from embedsvc.model.fake import FakeEncoder

from .. import loopback
from ..fakes import BundledTokenizerFake
from .fake_server import fake_server, healthy_answer

GiB = 1 << 30


def memory(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) * 1024


def test_four_maximal_bodies_of_bangs_stay_small_and_answer_in_time():
    """80 inputs x 200,000 '!' (one token each) used to be tokenized in full: 2.7 GB and
    11.6 s each, and four at once all got 504. The real tokenizer, a fake device."""
    fake = BundledTokenizerFake(per_token_s=1e-4, record=False)  # ~2 s of device per body
    body = b'{"inputs": [' + b",".join([b'"' + b"!" * 200_000 + b'"'] * 80) + b"]}"
    assert len(body) < 16 << 20
    statuses: list[int] = []
    with fake_server(fake) as server:
        before = memory(os.getpid(), "VmRSS")

        def client() -> None:
            with loopback.Client(base_url=server.url, timeout=60) as c:
                resp = c.post("/embed", content=body,
                              headers={"content-type": "application/json"})
                statuses.append(resp.status_code)
                assert resp.status_code != 200 or len(resp.json()) == 80

        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        growth = memory(os.getpid(), "VmHWM") - before  # the peak: an upper bound
        assert statuses == [200] * 4  # each within REQUEST_TIMEOUT_S (30 s)
        assert server.registry.get_sample_value("embedsvc_input_tokens_total") == 4 * 80 * 256
    assert growth < 1.5 * GiB, f"resident memory grew by {growth / GiB:.2f} GiB"


def busy_clients(url: str, stop: threading.Event, statuses: list[int], n: int = 16) -> list:
    def run(t: int) -> None:
        rng = np.random.default_rng(t)
        with loopback.Client(base_url=url, timeout=60) as c:
            while not stop.is_set():
                texts = [f"busy {t} text {k}" for k in range(int(rng.integers(1, 17)))]
                statuses.append(c.post("/embed", json={"inputs": texts}).status_code)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for t in threads:
        t.start()
    return threads


def test_a_2048_input_request_is_admitted_beside_16_busy_clients():
    """With MAX_QUEUE = MAX_INPUTS_PER_REQUEST = 2048 it used to get 429 until the queue
    was empty, which 16 busy clients never allow."""
    fake = FakeEncoder(per_token_s=1e-4, record=False)  # ~10k tokens/s, a CPU's order
    stop, statuses = threading.Event(), []
    with fake_server(fake, max_queue=2048, threads=40) as server:
        clients = busy_clients(server.url, stop, statuses)
        try:
            time.sleep(1.0)
            texts = [f"large request input {i}" for i in range(2048)]
            resp = loopback.post(server.url + "/embed", json={"inputs": texts}, timeout=60)
        finally:
            stop.set()
            for t in clients:
                t.join(30)
        assert resp.status_code == 200, resp.text[:300]  # the first try, within 60 s
        rows = resp.json()
        for i in (0, 1000, 2047):
            np.testing.assert_allclose(rows[i], fake.expected(texts[i]), rtol=1e-5)
        assert statuses and set(statuses) == {200}
        healthy_answer(server, fake)


def test_a_departed_2048_input_client_has_most_of_its_inputs_dropped():
    fake = FakeEncoder(per_token_s=2e-4, record=False)  # ~0.3 s per batch of 256
    with fake_server(fake) as server:
        body = ('{"inputs": [' + ",".join(f'"departing input {i}"' for i in range(2048))
                + "]}").encode()
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        get = server.registry.get_sample_value
        deadline = time.monotonic() + 30
        while (get("embedsvc_inputs_total") or 0) < 256 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert get("embedsvc_inputs_total") >= 256  # its first batch was computed
        sock.close()
        batcher = server.service.runner.batcher
        while batcher.admitted and time.monotonic() < deadline:
            time.sleep(0.01)
        dropped = get("embedsvc_dropped_inputs_total", {"reason": "disconnected"}) or 0
        assert dropped >= 1024, f"only {dropped} of 2048 inputs were dropped"
        assert get("embedsvc_inputs_total") + dropped == 2048
        healthy_answer(server, fake)
