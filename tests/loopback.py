"""httpx for the suite's own requests to servers on loopback, without a TLS context.

httpx builds an SSL context, loading certifi's CA bundle, for every client it makes, and
``httpx.get`` makes one per call: about 30-60 ms of CPU each, which the suite paid 1,400
times (45 CPU-s of a run) for plain HTTP to 127.0.0.1. These make the same clients with
``verify=False``, which builds none (under a millisecond). The client libraries under test
(openai, huggingface_hub ...) make their own clients as their users get them.
"""

from __future__ import annotations

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
