"""service.py: loading, readiness and failure as the routes see them."""

import logging
import threading
import time

import numpy as np
import pytest

from embedsvc.api.wsgi import create_app
from embedsvc.errors import Unavailable
from embedsvc.metrics import Metrics
from embedsvc.model.fake import FakeEncoder
from embedsvc.service import Service
from embedsvc.settings import Settings

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


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def service_log():
    logger = logging.getLogger("embedsvc.service")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(level)


def broken_loader():
    raise OSError("no such model: /models/x\nsee the documentation for more")


def test_a_load_failure_is_one_log_line_with_the_traceback_at_debug_only(registry, service_log):
    service = Service(Settings(), loader=broken_loader, metrics=Metrics(registry))
    service.start(background=True)
    with pytest.raises(Unavailable):
        service.ready(timeout=5)
    shown = [r for r in service_log if r.levelno >= logging.INFO]
    assert [r.getMessage() for r in shown] == [
        "the model failed to load: OSError: no such model: /models/x"]
    assert shown[0].exc_info is None
    assert [r.exc_info is not None for r in service_log if r.levelno == logging.DEBUG] == [True]


def test_a_foreground_load_failure_is_raised_to_the_caller_not_logged(registry, service_log):
    service = Service(Settings(), loader=broken_loader, metrics=Metrics(registry))
    with pytest.raises(RuntimeError, match="^the model failed to load: OSError: no such model"):
        service.start(background=False)
    assert not [r for r in service_log if r.levelno >= logging.INFO]
