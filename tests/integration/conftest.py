import os

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from embedsvc.api.wsgi import create_app
from embedsvc.metrics import Metrics
from embedsvc.service import Service
from embedsvc.settings import Settings

from .servers import running


@pytest.fixture(scope="session")
def reference():
    """sentence-transformers itself, on the bundled model: the answers to compare with."""
    from sentence_transformers import SentenceTransformer

    from embedsvc.model.encoder import bundled_model_path

    return SentenceTransformer(bundled_model_path(), device="cpu")


@pytest.fixture(scope="session", params=["torch", "onnx"])
def real_app(request):
    """The Flask app on the real model, in this process, on each backend."""
    registry = CollectorRegistry()
    settings = Settings.from_env(os.environ, device="cpu", backend=request.param)
    service = Service(settings, metrics=Metrics(registry))
    service.start(background=False)
    app = create_app(service.settings, service=service)
    yield app
    service.drain(timeout=5)


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    """One `embedsvc serve` process on a free loopback port, shared by the tests that need it."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running(["embedsvc", "serve", "--port", "0", "--threads", "64"], log) as server:
        yield server


def cosine(a, b) -> np.ndarray:
    a, b = np.atleast_2d(a), np.atleast_2d(b)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="session")
def kind_dirs(tmp_path_factory):
    """Directories of a tiny reranker, classifier and sparse encoder (tests/models.py)."""
    from ..models import build_classifier, build_reranker, build_sparse

    base = tmp_path_factory.mktemp("kinds")
    return {
        "reranker": build_reranker(base / "reranker"),
        "classifier": build_classifier(base / "classifier"),
        "sparse": build_sparse(base / "sparse"),
    }
