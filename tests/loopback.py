"""httpx for the suite's own requests to servers on loopback, without a TLS context.

httpx builds an SSL context, loading certifi's CA bundle, for every client it makes, and
``httpx.get`` makes one per call: about 30-60 ms of CPU each, which the suite paid 1,400
times (45 CPU-s of a run) for plain HTTP to 127.0.0.1. These make the same clients with
``verify=False``, which builds none (under a millisecond). The client libraries under test
(openai, huggingface_hub ...) make their own clients as their users get them.
"""

from __future__ import annotations

import os
import random
import socket
from typing import Any

import httpx


def Client(**kwargs: Any) -> httpx.Client:  # noqa: N802 (it stands for httpx.Client)
    return httpx.Client(verify=False, **kwargs)


def get(url: str, **kwargs: Any) -> httpx.Response:
    with Client() as client:
        return client.get(url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    with Client() as client:
        return client.post(url, **kwargs)


def request(method: str, url: str, **kwargs: Any) -> httpx.Response:
    with Client() as client:
        return client.request(method, url, **kwargs)


_GIVEN: set[int] = set()


def fixed_port() -> int:
    """A free port for a server that must be told its port before it starts (nginx, make serve).

    A port from ``bind(0)`` comes out of the kernel's ephemeral range, where any client's
    outgoing connection in the suite can take it between the choice and the server's bind:
    nginx once failed so ("Address already in use"). These come from below that range, and
    each xdist worker draws from its own thousand, so only a process outside the suite that
    asks for this very port can collide.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = 20000 + 1000 * (int(worker) % 12 if worker.isdigit() else 0)
    for port in random.sample(range(base, base + 1000), 1000):
        if port in _GIVEN:  # given to a server of this process that may not listen yet
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _GIVEN.add(port)
            return port
    raise AssertionError(f"no free port in {base}-{base + 999}")
