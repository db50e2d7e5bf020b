"""The floor under the simulated device: plain waitress and one precomputed answer.

    .venv/bin/python bench/bare_server.py --port 8092 --threads 64

A WSGI app that reads the body and answers every request with the same bytes: the body and
headers embedsvc answers for one 384-dimensional vector on /v1/embeddings (the simulated
device's vector of one input), built once at start. What this server costs per request is
waitress's share alone, so embedsvc's rate over the simulated device, divided by this one's
(same threads, same wrk), is the share of the HTTP server's pace that embedsvc keeps.
"""

from __future__ import annotations

import argparse
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


def make_app() -> Callable[..., Iterable[bytes]]:
    body, headers = answer()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        length = environ.get("CONTENT_LENGTH")
        environ["wsgi.input"].read(int(length) if length else -1)
        start_response("200 OK", headers)
        return [body]

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8092)
    parser.add_argument("--threads", type=int, default=64)
    args = parser.parse_args()
    waitress.serve(make_app(), host="127.0.0.1", port=args.port, threads=args.threads,
                   ident="bare")


if __name__ == "__main__":
    main()
