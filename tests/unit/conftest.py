import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from embedsvc.metrics import Metrics
from embedsvc.service import Service
from embedsvc.settings import Settings
from embedsvc.wsgi import create_app

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



@pytest.fixture(scope="session", autouse=True)
def no_thread_outlives_the_unit_tests():
    """Every service, batcher and watchdog a unit test starts is gone when the tests end."""
    yield
    deadline = time.monotonic() + 2
    for thread in embedsvc_threads():
        thread.join(max(0.0, deadline - time.monotonic()))
    leaked = sorted(t.name for t in embedsvc_threads())
    assert not leaked, f"threads left running after the unit tests: {leaked}"
