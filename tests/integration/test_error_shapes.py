"""Every route of every family answers its errors in its family's shape (issue 41): Ollama's
routes (under /api/) ``{"error": "..."}``, every other route OpenAI's ``{"error": {message,
type, param, code}}``, whichever step refused the request: the HTTP server (413), the pipeline
(401, 404, 405, the kind check's 400), the handler (400), admission or the service (429, 503).

One table, built from the route table, drives every status. 400, 401, 404, 405 and 413 go to
real server processes on the fake encoder (`embedsvc serve` and gunicorn with
deploy/gunicorn.conf.py): the HTTP server writes 413 itself, and its answer must follow the
path too. 429 and 503 are raised inside the app (admission, the body lane, the service's
state) and written by the pipeline, which the HTTP server only carries, so a Flask test client
makes them on every route at once: a service still loading (503), and one whose admission
refuses (429, injected: what refuses is admission's own policy, tested in test_admission).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from prometheus_client import CollectorRegistry

from embedsvc.api.routes import ROUTES
from embedsvc.api.wsgi import create_app
from embedsvc.errors import Overloaded
from embedsvc.metrics import Metrics
from embedsvc.service import Service
from embedsvc.settings import Settings

from .. import loopback
from .servers import FAKE_EMBEDSVC, Server, running
from .test_route_schemas import BODIES

REPO = Path(__file__).parents[2]
KEY = "shape-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 4096
LAUNCHERS = {
    "serve": [*FAKE_EMBEDSVC, "serve", "--port", "0"],
    "gunicorn": ["gunicorn", "-b", "127.0.0.1:0", "--no-control-socket", "-c",
                 str(REPO / "deploy" / "gunicorn.conf.py"), "tests.integration.fake_app:app"],
}
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH")


def family_shape(path: str) -> str:
    """The contract (README, docs/api.md): Ollama's routes, under /api/, answer Ollama's
    shape; every other route OpenAI's."""
    return "ollama" if path.startswith("/api/") else "openai"


def assert_shape(status: int, body: dict, path: str) -> None:
    assert set(body) == {"error"}, (path, body)
    if family_shape(path) == "ollama":
        assert isinstance(body["error"], str) and body["error"], (path, status, body)
    else:
        error = body["error"]
        assert isinstance(error, dict), (path, status, body)
        assert set(error) == {"message", "type", "param", "code"}, (path, status, body)
        assert error["message"] and isinstance(error["type"], str), (path, status, body)


def allowed() -> dict[str, set[str]]:
    methods: dict[str, set[str]] = {}
    for route in ROUTES:
        methods.setdefault(route.path, set()).add(route.method)
    return methods


def unknown_paths() -> list[str]:
    """A path the table lacks under each family's prefix (/api/, /v1/, /v2/, /docs/) and at
    the root, where TEI's routes live."""
    prefixes = {"/" + r.path.split("/")[1] + "/" for r in ROUTES if r.path.count("/") > 1}
    return [*(p + "no-such-route" for p in sorted(prefixes)), "/no-such-route"]


def table() -> Iterator[tuple[int, str, str, bytes, dict[str, str]]]:
    """(status, method, path, body, headers) for every route and every status a client can
    make it answer from outside: 401, 404, 405, 413 and 400."""
    for route in ROUTES:
        if not route.open:  # no key
            yield 401, route.method, route.path, b"{}", {}
        # over MAX_BODY_BYTES, on any route and method
        yield 413, route.method, route.path, b"x" * (MAX_BODY + 1), AUTH
        takes_body = route.request is not None or route.path in ("/", "/invocations")
        if route.method == "POST" and takes_body:  # not JSON, or a route of another kind
            yield 400, "POST", route.path, b"{", AUTH
    for path, methods in allowed().items():
        for method in sorted(set(METHODS) - methods):
            yield 405, method, path, b"{}", AUTH
    for path in unknown_paths():
        yield 401, "GET", path, b"", {}
        yield 404, "GET", path, b"", AUTH
    yield 404, "POST", "/api/show", b'{"model": "no-such-model"}', AUTH  # the handler's


@pytest.fixture(scope="module", params=sorted(LAUNCHERS))
def launched(request, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp(request.param) / "server.log"
    env = {"EMBEDSVC_API_KEY": KEY, "EMBEDSVC_MAX_BODY_BYTES": str(MAX_BODY)}
    with running(LAUNCHERS[request.param], log, env=env, cwd=str(REPO)) as server:
        yield server


def test_every_route_answers_401_404_405_413_and_400_in_its_familys_shape(launched):
    wrong = []
    with loopback.Client(base_url=launched.url, timeout=30) as client:
        for status, method, path, body, headers in table():
            resp = client.request(method, path, content=body,
                                  headers={"Content-Type": "application/json", **headers})
            try:
                assert resp.status_code == status, resp.text
                assert_shape(status, resp.json(), path)
                if status == 405:
                    assert set(resp.headers["Allow"].split(", ")) == allowed()[path]
            except (AssertionError, ValueError) as exc:
                wrong.append(f"{method} {path} {status}: {exc}")
    assert not wrong, "\n".join(wrong)


# the routes without a kind that ask for the model (the others with one all do)
ASKS_THE_MODEL = {("POST", "/"), ("POST", "/invocations"), ("POST", "/tokenize"),
                  ("POST", "/decode"), ("GET", "/api/tags"), ("POST", "/api/show")}


class Refusing(Service):
    """A service whose admission refuses every request, as a full queue does."""

    def ready(self, timeout: float | None = None):
        raise Overloaded("the queue is full; retry after the time in Retry-After",
                         retry_after_s=7)


@pytest.mark.parametrize(("status", "service"), [
    (503, Service),  # never started: the model is still loading
    (429, Refusing),
])
def test_errors_raised_in_the_app_answer_in_every_routes_familys_shape(status, service):
    settings = Settings(request_timeout_s=0.01)
    app = create_app(settings, service=service(settings, metrics=Metrics(CollectorRegistry())))
    client = app.test_client()
    for route in ROUTES:
        body = BODIES.get(route.path) or {"model": "any"}  # /api/show: any name
        resp = client.open(route.path, method=route.method, data=orjson.dumps(body),
                           content_type="application/json")
        if resp.status_code >= 400:  # /health's 503 too; /api/generate's 501
            assert_shape(resp.status_code, resp.get_json(), route.path)
        # every route that asks for the model gets the status, Ollama's among them
        if route.kinds or (route.method, route.path) in ASKS_THE_MODEL:
            assert resp.status_code == status, (route.path, resp.get_json())
            assert resp.headers["Retry-After"] == ("7" if status == 429 else "1")
