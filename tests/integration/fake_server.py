"""A real waitress server on loopback port 0, in a thread, around a fake encoder."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry

from embedsvc.metrics import Metrics
from embedsvc.model.encoder import Encoder
from embedsvc.service import Service
from embedsvc.serving.server import Server
from embedsvc.settings import Settings

from .. import loopback


@contextmanager
def fake_server(encoder: Encoder, **settings) -> Iterator[Server]:
    s = Settings(port=0, **settings)
    registry = CollectorRegistry()
    service = Service(s, encoder=encoder, metrics=Metrics(registry))
    service.start(background=False)
    server = Server(s, service)
    server.url = f"http://127.0.0.1:{server.port}"  # type: ignore[attr-defined]
    server.registry = registry  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.run, args=(False,), name="test-waitress")
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(15)
        assert not thread.is_alive(), "the server did not stop"


def healthy_answer(server: Server, encoder, text: str = "still serving") -> None:
    import numpy as np

    resp = loopback.post(server.url + "/v1/embeddings", json={"input": text}, timeout=30)
    assert resp.status_code == 200, resp.text
    np.testing.assert_allclose(resp.json()["data"][0]["embedding"], encoder.expected(text),
                               rtol=1e-5)
