import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from embedsvc.api.wsgi import create_app
from embedsvc.metrics import Metrics
from embedsvc.service import Service
from embedsvc.settings import Settings

from .servers import SHARED_DIR, Server, Shared


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
def shared(tmp_path_factory) -> Iterator[Shared]:
    """The run's shared servers (tests/conftest.py stops them); without that controlling
    process's directory, this session's own."""
    if SHARED_DIR in os.environ:
        yield Shared(Path(os.environ[SHARED_DIR]))
        return
    own = Shared(tmp_path_factory.mktemp("shared"))
    yield own
    own.stop_all()


SERVE = ["embedsvc", "serve", "--port", "0", "--threads", "64"]


@pytest.fixture(scope="session")
def bundled(shared) -> Server:
    """One `embedsvc serve` of the bundled model for the whole run; tests take it through
    ``served`` or ``served_alone``."""
    return shared.get("bundled", SERVE)


@pytest.fixture
def served(shared, bundled) -> Iterator[Server]:
    """The run's `embedsvc serve`, beside the other tests that use it."""
    with shared.use("bundled"):
        yield bundled


@pytest.fixture
def served_alone(shared, bundled) -> Iterator[Server]:
    """The run's `embedsvc serve`, with no other test's traffic while this one runs (for
    exact counts of its metrics)."""
    with shared.use("bundled", exclusive=True):
        yield bundled


LAUNCHED = {  # how users start the bundled model: the name of its shared server, the command
    "embedsvc-serve": ("bundled", SERVE),
    "waitress-serve": ("waitress", ["waitress-serve", "--threads=16", "--host=127.0.0.1",
                                    "--port=0", "embedsvc:app"]),
}


@pytest.fixture(scope="module", params=sorted(LAUNCHED))
def live(request, shared) -> Iterator[Server]:
    """The bundled model as each launcher serves it: the run's shared servers, beside the
    other tests that use them."""
    name, cmd = LAUNCHED[request.param]
    server = shared.get(name, cmd)
    with shared.use(name):
        yield server


def kind_server(shared: Shared, kind_dirs: dict[str, Path], kind: str) -> Server:
    """The run's `embedsvc serve` of the tiny model of ``kind``, with a probe port."""
    return shared.get(kind, [*SERVE, "--model", str(kind_dirs[kind])],
                      env={"EMBEDSVC_HEALTH_PORT": "0"})


def cosine(a, b) -> np.ndarray:
    a, b = np.atleast_2d(a), np.atleast_2d(b)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="session")
def kind_dirs(shared):
    """Directories of a tiny reranker, classifier and sparse encoder (tests/models.py), built
    once for the run, beside its shared servers."""
    from ..models import build_classifier, build_reranker, build_sparse

    base = shared.root / "kinds"
    dirs = {"reranker": base / "reranker", "classifier": base / "classifier",
            "sparse": base / "sparse"}
    with shared.building("kinds"):
        if not (base / "built").exists():
            build_reranker(dirs["reranker"])
            build_classifier(dirs["classifier"])
            build_sparse(dirs["sparse"])
            for path in dirs.values():
                pin_mtimes(path)
            export_records(dirs)
            (base / "built").touch()
    return dirs


def export_records(dirs: dict[str, Path]) -> None:
    """Export the tiny models' records in the process that built them, where PyTorch is
    loaded already, as `embedsvc export` would ahead of a deployment: every server of them
    then starts without PyTorch (about 8 CPU-seconds a start less). A first start's own
    export is what test_lean, test_onnx and test_readme test, on the bundled model."""
    from embedsvc.model.backend import export

    for path in dirs.values():
        export(Settings.from_env(os.environ, model=str(path)))
    # the reranker served as a classifier (test_kind_routes: KIND overrides the detection)
    export(Settings.from_env(os.environ, model=str(dirs["reranker"]), kind="classifier"))


def pin_mtimes(directory: Path) -> None:
    """Give every file of a built model one mtime derived from the files' contents. An export
    record's key includes mtimes (model/record.py), so a model rebuilt the same in the next
    run finds the record the last run exported in the graph cache, instead of exporting again
    (and piling records up); a build that changes gets a new key."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.relative_to(directory)}\n".encode())
        digest.update(path.read_bytes())
    stamp = 10**9 + int(digest.hexdigest()[:7], 16)  # a second between 2001 and 2009
    for path in files:
        os.utime(path, (stamp, stamp))
