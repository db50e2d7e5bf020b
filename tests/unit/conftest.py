import threading

import pytest
from prometheus_client import CollectorRegistry

from embedsvc.api import create_app
from embedsvc.encoder import FakeEncoder
from embedsvc.engine import Engine
from embedsvc.metrics import Metrics
from embedsvc.settings import Settings


class GatedEncoder(FakeEncoder):
    """A fake whose device stays busy with a batch until the test opens the gate."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def hold(self):
        self.gate.clear()
        self.entered.clear()

    def encode(self, batch):
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return super().encode(batch)


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def fake():
    return GatedEncoder(dimension=8, max_input_tokens=16)


def make_app(encoder, registry, **settings):
    engine = Engine(Settings(**settings), encoder=encoder, metrics=Metrics(registry))
    app = create_app(engine.settings, engine=engine)
    engine.start(background=False)
    return app


@pytest.fixture
def client(fake, registry):
    app = make_app(fake, registry)
    yield app.test_client()
    app.extensions["embedsvc"].drain(timeout=1)
