"""The floor under the simulated device: plain waitress and one precomputed answer.

    .venv/bin/python bench/bare_server.py --port 8092 --threads 64
    .venv/bin/python bench/bare_server.py --port 8092 --threads 64 --handoff
    .venv/bin/python bench/bare_server.py --port 8092 --threads 64 --handoff --python-us 100

A WSGI app that reads the body and answers every request with the same bytes: the body and
headers embedsvc answers for one 384-dimensional vector on /v1/embeddings (the simulated
device's vector of one input), built once at start. What this server costs per request is
waitress's share alone, so embedsvc's rate over the simulated device, divided by this one's
(same threads, same wrk), is the share of the HTTP server's pace that embedsvc keeps.

``--handoff``: each request thread also hands its request to one other thread and waits for
it, as embedsvc's request threads hand theirs to the batcher thread: a queue under a lock and
a condition, which that thread empties at each wake-up, and a held lock per request that it
releases. The same app otherwise: what the hand-off alone costs waitress, the part of
embedsvc's distance to the bare app that no leaner request path can win back while a batcher
thread computes.

``--adapter``: the same app served by embedsvc's own waitress adapter
(embedsvc/serving/waitress_adapter.py, as ``embedsvc serve`` serves): waitress with its
connection bounds, and an answer's head and body in one send where waitress sends two. Beside
the plain one, what embedsvc's HTTP layer alone changes.

``--python-us N``: each request also runs N microseconds of plain Python (a loop, its count
measured at start) before it answers, holding the interpreter lock as a request path's own
Python does: what that much of the interpreter's time a request costs waitress's pace, beside
embedsvc, whose own request path is about 100 us of Python in one thread
(bench/request_path.py, no HTTP).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import orjson
import waitress

from embedsvc.model.fake import FakeEncoder

TEXT = "the quick brown fox jumps over the lazy dog service 1"


def answer() -> tuple[bytes, list[tuple[str, str]]]:
    """The body and headers of embedsvc's answer to one input of TEXT (fake encoder)."""
    encoder = FakeEncoder(dimension=384, max_input_tokens=256, record=False)
    vector = encoder.expected(TEXT)
    tokens = len(encoder.wrap(encoder.tokenize([TEXT])[0]))
    body = orjson.dumps({
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": vector}],
        "model": encoder.info.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }, option=orjson.OPT_SERIALIZE_NUMPY)
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
               ("x-queue-time", "0.100"), ("x-tokenization-time", "0.010"),
               ("x-inference-time", "0.100"), ("x-total-time", "0.250"),
               ("x-compute-tokens", str(tokens))]
    return body, headers


def make_app(handoff: bool = False, python_us: float = 0.0) -> Callable[..., Iterable[bytes]]:
    body, headers = answer()
    hand = _handoff() if handoff else None
    loops = _loops_for(python_us) if python_us > 0 else 0

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        length = environ.get("CONTENT_LENGTH")
        environ["wsgi.input"].read(int(length) if length else -1)
        if loops:
            _spin(loops)
        if hand is not None:
            hand()
        start_response("200 OK", headers)
        return [body]

    return app


def _spin(loops: int) -> int:
    total = 0
    for i in range(loops):
        total += i
    return total


def _loops_for(us: float) -> int:
    """How many turns of ``_spin`` take ``us`` microseconds of this thread's CPU (the
    fastest of a few tries: the machine's other work only slows a try)."""
    trial = 200_000
    best = min(_timed(trial) for _ in range(5))
    return max(1, round(trial * us / (best * 1e6)))


def _timed(loops: int) -> float:
    started = time.thread_time()
    _spin(loops)
    return time.thread_time() - started


def _handoff() -> Callable[[], None]:
    """A call that returns once another thread has seen it (``--handoff``)."""
    lock = threading.Lock()
    wake = threading.Condition(lock)
    queued: deque[Any] = deque()

    def other() -> None:
        while True:
            with lock:
                while not queued:
                    wake.wait()
                taken = list(queued)
                queued.clear()
            for done in taken:
                done.release()

    def hand() -> None:
        done = threading.Lock()
        done.acquire()
        with lock:
            queued.append(done)
            wake.notify()
        done.acquire()

    threading.Thread(target=other, name="handoff", daemon=True).start()
    return hand


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8092)
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--handoff", action="store_true",
                        help="hand each request to one other thread and wait for it")
    parser.add_argument("--python-us", type=float, default=0.0, metavar="N",
                        help="run N microseconds of plain Python in each request")
    parser.add_argument("--adapter", action="store_true",
                        help="serve with embedsvc's waitress adapter instead of plain waitress")
    args = parser.parse_args()
    app = make_app(args.handoff, args.python_us)
    if not args.adapter:
        waitress.serve(app, host="127.0.0.1", port=args.port, threads=args.threads,
                       ident="bare")
        return
    from embedsvc.serving import waitress_adapter
    from embedsvc.settings import Settings

    s = Settings()
    bounds = waitress_adapter.Bounds(
        header_timeout_s=s.header_timeout_s, body_timeout_s=s.body_timeout_s,
        idle_timeout_s=s.idle_timeout_s, send_timeout_s=s.send_timeout_s,
        max_connections=s.max_connections, max_body_bytes=s.max_body_bytes)
    waitress_adapter.create(app, host="127.0.0.1", port=args.port, threads=args.threads,
                            bounds=bounds, ident="bare").run()


if __name__ == "__main__":
    main()
