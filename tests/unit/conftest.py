import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from embedsvc.api.wsgi import create_app
from embedsvc.metrics import Metrics
from embedsvc.service import Service
from embedsvc.settings import Settings

from ..fakes import GatedEncoder


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def fake():
    return GatedEncoder(dimension=8, max_input_tokens=16)


_services: list[Service] = []


def build_app(encoder, registry, **settings):
    """A started app whose service the caller drains."""
    service = Service(Settings(**settings), encoder=encoder, metrics=Metrics(registry))
    app = create_app(service.settings, service=service)
    service.start(background=False)
    return app


def make_app(encoder, registry, **settings):
    """A started app, drained when the test ends."""
    app = build_app(encoder, registry, **settings)
    _services.append(app.extensions["embedsvc"])
    return app


def embedsvc_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("embedsvc") and t.is_alive()]


@pytest.fixture(autouse=True)
def drain_what_the_test_started():
    """Drain the services made with make_app; fail a test that leaves other threads running."""
    before = set(embedsvc_threads())
    yield
    while _services:
        _services.pop().drain(timeout=1)
    deadline = time.monotonic() + 1
    for thread in set(embedsvc_threads()) - before:
        thread.join(max(0.0, deadline - time.monotonic()))
    leaked = sorted(t.name for t in set(embedsvc_threads()) - before)
    assert not leaked, f"the test left threads running: {leaked}"


@pytest.fixture
def client(fake, registry):
    app = make_app(fake, registry)
    yield app.test_client()
    app.extensions["embedsvc"].drain(timeout=1)



@pytest.fixture(scope="package", autouse=True)
def no_thread_outlives_the_unit_tests():
    """Every service, batcher and watchdog a unit test starts is gone when the tests end."""
    before = set(embedsvc_threads())  # an integration test's session-wide server, if any
    yield
    deadline = time.monotonic() + 2
    for thread in set(embedsvc_threads()) - before:
        thread.join(max(0.0, deadline - time.monotonic()))
    leaked = sorted(t.name for t in set(embedsvc_threads()) - before)
    assert not leaked, f"threads left running after the unit tests: {leaked}"


TEXTS = ["hello world", "the quick brown fox", "a"]


def vectors(resp) -> np.ndarray:
    return np.array([d["embedding"] for d in resp.get_json()["data"]], dtype=np.float32)


def assert_error(resp, status: int, type_: str, param=None) -> dict:
    assert resp.status_code == status, resp.get_data(as_text=True)
    assert resp.content_type == "application/json"
    body = resp.get_json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_ and err["message"]
    assert err["code"] is None or isinstance(err["code"], str)
    if param is not None:
        assert err["param"] == param
    assert "Traceback" not in err["message"] and "/embedsvc/" not in err["message"]
    return err


def assert_route_error(resp, status: int, type_: str, path: str) -> str:
    """An error in the shape of ``path``'s API family: Ollama's routes (/api/) answer
    ``{"error": "..."}``, every other route OpenAI's shape (``assert_error``); its message."""
    if not path.startswith("/api/"):
        return assert_error(resp, status, type_)["message"]
    assert resp.status_code == status, resp.get_data(as_text=True)
    assert resp.content_type == "application/json"
    body = resp.get_json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    return body["error"]


def assert_still_serving(client, fake) -> None:
    resp = client.post("/v1/embeddings", json={"input": "still here"})
    assert resp.status_code == 200
    np.testing.assert_allclose(vectors(resp)[0], fake.expected("still here"), rtol=1e-6)
