"""wsgi.py: the one request pipeline (key, route, method, body, errors, metrics) and Flask."""

import io
import threading
import time

import numpy as np
import orjson
import pytest
from werkzeug.test import EnvironBuilder

from embedsvc.model.fake import FakeEncoder

from .conftest import assert_error, assert_route_error, assert_still_serving, make_app


def test_body_over_the_limit_is_413(fake, registry):
    client = make_app(fake, registry, max_body_bytes=1000).test_client()
    err = assert_error(client.post("/v1/embeddings", json={"input": "a" * 2000}), 413,
                       "invalid_request_error")
    assert "MAX_BODY_BYTES" in err["message"]
    assert_still_serving(client, fake)


def test_unknown_route_and_wrong_method(client, fake):
    assert_error(client.get("/v2/nothing"), 404, "invalid_request_error")
    assert_error(client.get("/v1/embeddings"), 405, "invalid_request_error")
    assert_still_serving(client, fake)


def test_api_key_guards_all_but_health_and_metrics(fake, registry):
    client = make_app(fake, registry, api_key="s3cret").test_client()
    assert_error(client.post("/embed", json={"inputs": "a"}), 401, "authentication_error")
    wrong = {"Authorization": "Bearer nope"}
    assert_error(client.get("/info", headers=wrong), 401, "authentication_error")
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    ok = {"Authorization": "Bearer s3cret"}
    assert client.post("/embed", json={"inputs": "a"}, headers=ok).status_code == 200


CONNECTION = {"REMOTE_ADDR": "10.0.0.1", "REMOTE_PORT": "5555"}  # one client's connection


def test_work_that_cannot_start_before_its_deadline_gets_429_with_retry_after(registry):
    """A client's own earlier work is ahead of its next request: past the deadline, 429."""
    fake = FakeEncoder(per_token_s=0.005)  # 200 tokens/s
    app = make_app(fake, registry, request_timeout_s=1, max_batch_size=4)
    client = app.test_client()
    assert client.post("/embed", json={"inputs": "warm up"}).status_code == 200  # a rate
    batcher = app.extensions["embedsvc"].runner.batcher
    done = []
    t = threading.Thread(target=lambda: done.append(  # 80 x 4 tokens: 1.6 s of work
        app.test_client().post("/embed", json={"inputs": ["x y"] * 80},
                               environ_base=CONNECTION)))
    t.start()
    deadline = time.monotonic() + 5
    while not batcher.depth and time.monotonic() < deadline:
        time.sleep(0.005)
    resp = client.post("/embed", json={"inputs": "z"}, environ_base=CONNECTION)
    assert_error(resp, 429, "rate_limit_error")
    assert int(resp.headers["Retry-After"]) >= 1
    other = client.post("/embed", json={"inputs": "z"},  # another client: about one batch
                        environ_base={**CONNECTION, "REMOTE_PORT": "6666"})
    assert other.status_code == 200 and float(other.headers["x-queue-time"]) < 500
    t.join(10)
    assert done[0].status_code == 200
    assert_still_serving(client, fake)
    assert registry.get_sample_value("embedsvc_rejections_total", {"reason": "overloaded"}) == 1


def test_a_failed_batch_is_500_server_error(registry):
    def fail(batch):  # inputs of five words fail
        return RuntimeError("/secret/path boom") if any(len(x) == 7 for x in batch) else None

    fake = FakeEncoder(fail=fail)
    client = make_app(fake, registry).test_client()
    err = assert_error(client.post("/v1/embeddings", json={"input": "a b c d e"}), 500,
                       "server_error")
    assert "/secret/path" not in err["message"]
    assert_still_serving(client, fake)


def test_waiting_past_the_deadline_is_504(fake, registry):
    app = make_app(fake, registry, request_timeout_s=0.2)
    fake.hold()
    t = threading.Thread(target=lambda: app.test_client().post("/embed", json={"inputs": "x"}))
    t.start()
    assert fake.entered.wait(5)
    resp = app.test_client().post("/embed", json={"inputs": "late"})
    assert_error(resp, 504, "timeout")
    fake.gate.set()
    t.join(5)
    assert all(fake.wrap(fake.tokenize(["late"])[0]) not in b for b in fake.batches)


def test_every_route_answers_other_methods_with_405_and_allow(client, fake):
    from embedsvc.api.routes import ROUTES

    allowed: dict[str, set[str]] = {}
    for route in ROUTES:
        allowed.setdefault(route.path, set()).add(route.method)
    for path, methods in allowed.items():
        for method in {"GET", "POST", "PUT", "DELETE", "PATCH"} - methods - {"HEAD"}:
            resp = client.open(path, method=method, json={"input": "x"})
            assert_route_error(resp, 405, "invalid_request_error", path)
            assert set(resp.headers["Allow"].split(", ")) == methods, path
    assert_still_serving(client, fake)


def test_every_route_refuses_a_body_over_the_limit_with_413(fake, registry):
    from embedsvc.api.routes import ROUTES

    client = make_app(fake, registry, max_body_bytes=64).test_client()
    for route in ROUTES:
        resp = client.open(route.path, method=route.method, data=b"x" * 65)
        message = assert_route_error(resp, 413, "invalid_request_error", route.path)
        assert "MAX_BODY_BYTES (64)" in message
        if not route.path.startswith("/api/"):
            assert resp.get_json()["error"]["code"] == "body_too_large"
    assert client.get("/health").status_code == 200
    client.application.extensions["embedsvc"].drain(timeout=1)


def test_the_api_key_is_checked_before_the_route_and_method(fake, registry):
    client = make_app(fake, registry, api_key="k").test_client()
    for method, path in [("GET", "/v1/embeddings"), ("POST", "/info"), ("GET", "/nowhere"),
                         ("POST", "/embed")]:
        assert_error(client.open(path, method=method), 401, "authentication_error")
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    assert_error(client.get("/nowhere", headers={"Authorization": "Bearer k"}), 404,
                 "invalid_request_error")
    client.application.extensions["embedsvc"].drain(timeout=1)


def test_user_routes_added_to_the_flask_app_share_the_pipeline(fake, registry):
    app = make_app(fake, registry, api_key="k")

    @app.get("/mine")
    def mine():
        return {"mine": True}

    @app.get("/broken")
    def broken():
        raise RuntimeError("a bug in user code")

    client, key = app.test_client(), {"Authorization": "Bearer k"}
    assert client.get("/mine", headers=key).get_json() == {"mine": True}
    assert_error(client.get("/mine"), 401, "authentication_error")
    assert_error(client.post("/mine", headers=key), 405, "invalid_request_error")
    assert_error(client.get("/broken", headers=key), 500, "server_error")
    assert registry.get_sample_value("embedsvc_requests_total",
                                     {"route": "other", "status": "200"}) == 1
    app.extensions["embedsvc"].drain(timeout=1)


def test_the_wsgi_front_reads_a_body_without_content_length(fake, registry):
    # A chunked upload reaches the app without CONTENT_LENGTH; the body runs to the stream's end.
    app = make_app(fake, registry, max_body_bytes=1000)
    seen = {}

    def call(body: bytes, length: str | None):
        environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/embed",
                   "wsgi.input": io.BytesIO(body)}
        if length is not None:
            environ["CONTENT_LENGTH"] = length
        out = b"".join(app.wsgi_app(environ, lambda status, headers: seen.update(s=status)))
        return int(seen["s"].split()[0]), orjson.loads(out)

    status, rows = call(b'{"inputs": ["hello world"]}', None)
    assert status == 200
    np.testing.assert_allclose(rows[0], fake.expected("hello world"), rtol=1e-6)
    status, err = call(b'{"inputs": "' + b"a" * 2000 + b'"}', None)
    assert status == 413 and err["error"]["code"] == "body_too_large"
    status, err = call(b'{"inputs": "x"}', "-5")
    assert status == 400 and err["error"]["code"] == "invalid_content_length"


def test_a_waiting_client_that_hangs_up_is_dropped_before_compute(fake, registry):
    app = make_app(fake, registry)
    batcher = app.extensions["embedsvc"].runner.batcher
    fake.hold()
    first = threading.Thread(target=lambda: app.test_client().post("/embed",
                                                                   json={"inputs": "first"}))
    first.start()
    assert fake.entered.wait(5)
    gone = threading.Event()
    replies = []

    def orphan():
        environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/embed",
                   "wsgi.input": io.BytesIO(b'{"inputs": "orphan words"}'),
                   "CONTENT_LENGTH": "26", "waitress.client_disconnected": gone.is_set}
        replies.append(b"".join(app.wsgi_app(environ, lambda status, headers: None)))

    t = threading.Thread(target=orphan)
    t.start()
    deadline = time.monotonic() + 5
    while batcher.depth == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    gone.set()  # the watchdog notices within its 100 ms tick
    t.join(5)
    assert orjson.loads(replies[0])["error"]["code"] == "client_disconnected"
    fake.gate.set()
    first.join(5)
    assert all(fake.wrap(fake.tokenize(["orphan words"])[0]) not in b for b in fake.batches)
    assert registry.get_sample_value("embedsvc_dropped_inputs_total",
                                     {"reason": "disconnected"}) == 1


def test_head_answers_carry_the_get_headers_and_no_body(fake, registry):
    from embedsvc.api.routes import ROUTES

    app = make_app(fake, registry)

    def call(method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        seen = {}
        environ = EnvironBuilder(path=path, method=method).get_environ()
        out = b"".join(app.wsgi_app(environ, lambda status, headers, exc_info=None: seen.update(
            status=status, headers=dict(headers))))
        return int(seen["status"].split()[0]), seen["headers"], out

    gets = sorted({r.path for r in ROUTES if r.method == "GET"} - {"/metrics"})
    assert "/health" in gets and "/info" in gets
    for path in [*gets, "/nowhere"]:  # every GET route, and a path of none (Flask's 404)
        status, headers, body = call("HEAD", path)
        get_status, _, get_body = call("GET", path)
        assert (status, body) == (get_status, b""), path
        assert headers["Content-Length"] == str(len(get_body)), path
    status, headers, body = call("HEAD", "/embed")  # a 405 names the method: its own length
    assert status == 405 and body == b"" and int(headers["Content-Length"]) > 0
    status, headers, body = call("HEAD", "/metrics")  # its length changes between calls
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


def test_flask_host_gives_a_serving_apps_flask_and_refuses_create_apps_pipeline(fake, registry):
    from embedsvc.api.wsgi import flask_host, serving_app

    app = make_app(fake, registry)
    with pytest.raises(TypeError, match="create_app"):
        flask_host(app.wsgi_app)
    served = serving_app(app.extensions["embedsvc"])
    host = flask_host(served)
    assert host is flask_host(served) and host.wsgi_app is served
