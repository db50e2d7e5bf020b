"""Hostile input, overload, departed clients and shutdown, against real servers."""

import socket
import threading
import time

import httpx
import numpy as np

from embedsvc.model.fake import FakeEncoder

from .. import loopback
from ..fakes import GatedEncoder
from .fake_server import fake_server, healthy_answer
from .servers import running, stop

MiB = 1 << 20
LIMITS = {"max_inputs_per_request": 100, "max_queue": 200, "max_input_chars": 10_000}


def j(text: str) -> bytes:
    return text.encode()


# (route, body, expected status); each case runs against one live server, in order.
HOSTILE = [
    ("/v1/embeddings", j('{"input": "a"'), 400),  # truncated JSON
    ("/v1/embeddings", j('{"input": "a"} trailing'), 400),
    ("/v1/embeddings", b"", 400),
    ("/v1/embeddings", j("null"), 400),
    ("/v1/embeddings", j('"just a string"'), 400),
    ("/v1/embeddings", j("[1, 2]"), 400),
    ("/v1/embeddings", j('{"model": "m"}'), 400),  # input missing
    ("/v1/embeddings", j('{"input": null}'), 400),
    ("/v1/embeddings", j('{"input": 42}'), 400),
    ("/v1/embeddings", j('{"input": true}'), 400),
    ("/v1/embeddings", j('{"input": {"text": "a"}}'), 400),
    ("/v1/embeddings", j('{"input": ""}'), 400),
    ("/v1/embeddings", j('{"input": []}'), 400),
    ("/v1/embeddings", j('{"input": ["a", ""]}'), 400),
    ("/v1/embeddings", j('{"input": ["a", 1]}'), 400),
    ("/v1/embeddings", j('{"input": [[[1]]]}'), 400),
    ("/v1/embeddings", j('{"input": [5, -1]}'), 400),
    ("/v1/embeddings", j('{"input": [5, 100256]}'), 400),  # not an id of cl100k_base
    ("/embed", j('{"inputs": [5, 1000]}'), 400),  # past the fake's vocabulary
    ("/v1/embeddings", j('{"input": [5, 1.5]}'), 400),
    ("/v1/embeddings", j('{"input": [5, 1180591620717411303424]}'), 400),  # 2**70
    ("/v1/embeddings", j('{"input": [[5], []]}'), 400),
    ("/v1/embeddings", j('{"input": "a", "dimensions": 0}'), 400),
    ("/v1/embeddings", j('{"input": "a", "dimensions": -3}'), 400),
    ("/v1/embeddings", j('{"input": "a", "dimensions": 9}'), 400),
    ("/v1/embeddings", j('{"input": "a", "dimensions": "4"}'), 400),
    ("/v1/embeddings", j('{"input": "a", "dimensions": 4.0}'), 400),
    ("/v1/embeddings", j('{"input": "a", "encoding_format": "hex"}'), 400),
    ("/v1/embeddings", j('{"input": "a", "encoding_format": null}'), 400),
    ("/v1/embeddings", j('{"input": "a", "model": 7}'), 400),
    ("/v1/embeddings", j('{"input": ' + str(["x"] * 101).replace("'", '"') + "}"), 400),
    ("/v1/embeddings", j('{"input": "\\ud800 lone surrogate"}'), 400),
    ("/v1/embeddings", b'{"input": "\xff\xfe not utf-8"}', 400),
    ("/v1/embeddings", j("[" * 100_000 + "]" * 100_000), 400),  # deep nesting
    ("/v1/embeddings", j('{"input": "' + "x" * 10_001 + '"}'), 400),  # over MAX_INPUT_CHARS
    ("/v1/embeddings", j('{"input": "a\\u0000b NUL inside"}'), 200),
    ("/v1/embeddings", j('{"input": "emoji \\ud83d\\ude00 and \\u00e9"}'), 200),
    ("/v1/embeddings", j('{"input": "x", "user": "u", "unknown": [1, {"a": 2}]}'), 200),
    ("/v1/embeddings", b'{"input": "' + b"a" * (16 * MiB) + b'"}', 413),  # over 16 MiB
    ("/v1/embeddings", b"x" * (64 * MiB), 413),
    ("/embed", j('{"inputs": 3}'), 400),
    ("/embed", j('{"inputs": "a", "normalize": "yes"}'), 400),
    ("/embed", j('{"inputs": "a", "truncation_direction": "up"}'), 400),
    ("/embed", j('{"inputs": "a", "prompt_name": "nope"}'), 400),
    ("/embed", j('{"inputs": "a", "truncate": 1}'), 400),
    ("/tokenize", j('{"inputs": []}'), 400),
    ("/tokenize", j('{"inputs": [""]}'), 400),
    ("/info", j('{"x": 1}'), 405),  # POST on a GET route
    ("/nowhere", j("{}"), 404),
]


def test_hostile_bodies_get_the_contract_status_and_the_service_keeps_serving():
    assert len(HOSTILE) >= 30
    fake = FakeEncoder(max_input_tokens=64)
    with fake_server(fake, **LIMITS) as server, loopback.Client(base_url=server.url,
                                                                timeout=120) as c:
        for route, body, status in HOSTILE:
            resp = c.post(route, content=body, headers={"content-type": "application/json"})
            label = f"{route} {body[:60]!r}"
            assert resp.status_code == status, f"{label}: {resp.status_code} {resp.text[:300]}"
            if status != 200:
                err = resp.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, label
                assert err["type"] == "invalid_request_error", label
                assert "Traceback" not in err["message"], label
            healthy_answer(server, fake)


def test_an_overload_burst_gets_only_200_and_429_with_right_vectors():
    fake = FakeEncoder(delay_s=0.02)
    outcomes: list[tuple[int, str, object]] = []
    with fake_server(fake, max_queue=8, max_inputs_per_request=8, max_batch_size=4,
                     threads=48) as server:
        barrier = threading.Barrier(40)

        def client(t: int) -> None:
            texts = [f"client {t} text {k}" for k in range(2)]
            with loopback.Client(base_url=server.url, timeout=60) as c:
                barrier.wait()
                for _ in range(3):
                    resp = c.post("/v1/embeddings", json={"input": texts})
                    outcomes.append((resp.status_code, resp.headers.get("retry-after"),
                                     (texts, resp.json())))

        threads = [threading.Thread(target=client, args=(t,)) for t in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        statuses = {status for status, _, _ in outcomes}
        # MAX_QUEUE is 8 inputs: the rest wait their turn in FIFO order, since the device
        # starts them all well within REQUEST_TIMEOUT_S; 429 only for work that could not.
        assert statuses <= {200, 429} and 200 in statuses, statuses
        for status, retry_after, (texts, body) in outcomes:
            if status == 429:
                assert int(retry_after) >= 1 and body["error"]["type"] == "rate_limit_error"
            else:
                rows = [d["embedding"] for d in body["data"]]
                assert len(rows) == len(texts)
                for row, text in zip(rows, texts, strict=True):
                    np.testing.assert_allclose(row, fake.expected(text), rtol=1e-5)
        healthy_answer(server, fake)


def test_a_client_that_hangs_up_while_queued_is_never_computed():
    fake = GatedEncoder()
    with fake_server(fake) as server:
        fake.hold()
        first = threading.Thread(target=lambda: loopback.post(
            server.url + "/embed", json={"inputs": "holds the device"}, timeout=30))
        first.start()
        assert fake.entered.wait(5)
        body = b'{"inputs": "goodbye"}'
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        batcher = server.service.runner.batcher
        deadline = time.monotonic() + 5
        while batcher.depth == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batcher.depth == 1
        sock.close()
        while batcher.depth == 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batcher.depth == 0, "the departed client's input is still queued"
        fake.gate.set()
        first.join(10)
        goodbye = fake.wrap(fake.tokenize(["goodbye"])[0])
        assert all(goodbye not in batch for batch in fake.batches)
        dropped = server.registry.get_sample_value("embedsvc_dropped_inputs_total",
                                                   {"reason": "disconnected"})
        assert dropped == 1
        healthy_answer(server, fake)


class Die(BaseException):
    """Escapes the batch's error handling and ends the batcher thread."""


def kills_on_marker(batch):
    return Die() if any(len(ids) == 6 for ids in batch) else None  # four-word inputs


def test_a_dead_batcher_reports_unhealthy_and_is_restarted(monkeypatch):
    from embedsvc import service as service_module

    monkeypatch.setattr(service_module, "_WATCH_S", 0.05)
    fake = FakeEncoder(fail=kills_on_marker)
    with fake_server(fake) as server, loopback.Client(base_url=server.url, timeout=30) as c:
        resp = c.post("/embed", json={"inputs": "one two three four"})
        assert resp.status_code == 500 and resp.json()["error"]["code"] == "batcher_died"
        deadline = time.monotonic() + 5
        while c.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.get("/health").status_code == 200
        assert server.registry.get_sample_value("embedsvc_batcher_restarts_total") == 1
        healthy_answer(server, fake)


def test_health_says_unhealthy_while_the_batcher_is_down(monkeypatch):
    from embedsvc import service as service_module

    monkeypatch.setattr(service_module, "_WATCH_S", 3600)  # no restart during this test
    fake = FakeEncoder(fail=kills_on_marker)
    with fake_server(fake) as server, loopback.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/embed", json={"inputs": "one two three four"}).status_code == 500
        resp = c.get("/health")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "unhealthy"
        assert server.registry.get_sample_value("embedsvc_batcher_alive") == 0
        assert server.service.runner.batcher.restart()
        healthy_answer(server, fake)


def test_sigterm_under_load_finishes_or_refuses_every_request(tmp_path):
    outcomes: list[str] = []
    stop_at = time.monotonic() + 60
    with running(["embedsvc", "serve", "--port", "0", "--threads", "40"],
                 tmp_path / "serve.log") as server:

        def client(t: int) -> None:
            text = f"steady load from client {t}"
            with loopback.Client(base_url=server.url, timeout=60) as c:
                while time.monotonic() < stop_at:
                    try:
                        resp = c.post("/embed", json={"inputs": text})
                    except httpx.ConnectError:
                        outcomes.append("refused")
                        return
                    except httpx.HTTPError as exc:
                        outcomes.append(f"cut off: {exc!r}")
                        return
                    if resp.status_code == 503:
                        outcomes.append("503")
                        return
                    ok = resp.status_code == 200 and len(resp.json()[0]) == 384
                    outcomes.append("200" if ok else f"bad {resp.status_code}")

        threads = [threading.Thread(target=client, args=(t,)) for t in range(32)]
        for t in threads:
            t.start()
        time.sleep(3)
        before = outcomes.count("200")
        code = stop(server.proc, timeout=60)
        for t in threads:
            t.join(60)
        assert code == 0, server.output()[-3000:]
    bad = [o for o in outcomes if o not in ("200", "503", "refused")]
    assert not bad, bad[:5]
    assert before > 0 and outcomes.count("refused") + outcomes.count("503") == 32
    assert "drained in" in server.output()
