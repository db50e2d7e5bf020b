"""service.py: loading, readiness and failure as the routes see them."""

import threading
import time

import numpy as np

from embedsvc.encoder import FakeEncoder
from embedsvc.metrics import Metrics
from embedsvc.service import Service
from embedsvc.settings import Settings
from embedsvc.wsgi import create_app

from .conftest import assert_error


def test_requests_wait_for_the_model_to_load_then_succeed(registry):
    release = threading.Event()
    fake = FakeEncoder()

    def slow_loader():
        release.wait(5)
        return fake

    service = Service(Settings(), loader=slow_loader, metrics=Metrics(registry))
    app = create_app(service.settings, service=service)
    service.start(background=True)
    client = app.test_client()
    err = assert_error(client.get("/health"), 503, "service_unavailable")
    assert err["code"] == "loading"
    result = []
    t = threading.Thread(target=lambda: result.append(
        app.test_client().post("/embed", json={"inputs": "early"})))
    t.start()
    time.sleep(0.1)
    release.set()
    t.join(5)
    assert result[0].status_code == 200
    np.testing.assert_allclose(result[0].get_json()[0], fake.expected("early"), rtol=1e-6)
    assert client.get("/health").status_code == 200
    service.drain(timeout=1)


def test_a_model_that_never_loads_gives_503(registry):
    def broken():
        raise OSError("no such model: /srv/private/models/x")

    service = Service(Settings(request_timeout_s=1), loader=broken, metrics=Metrics(registry))
    app = create_app(service.settings, service=service)
    service.start(background=True)
    client = app.test_client()
    err = assert_error(client.post("/embed", json={"inputs": "x"}), 503, "service_unavailable")
    assert "failed to load" in err["message"] and "/srv/private" not in err["message"]
    assert assert_error(client.get("/health"), 503, "service_unavailable")["code"] == "unhealthy"
    assert "/srv/private" in service.failure  # the log and `embedsvc serve` say why
