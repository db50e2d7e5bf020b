import base64
import io
import threading
import time

import numpy as np
import orjson
import pytest

from embedsvc.encoder import FakeEncoder
from embedsvc.metrics import Metrics
from embedsvc.service import Service
from embedsvc.settings import Settings
from embedsvc.wsgi import create_app

from .conftest import make_app

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


def assert_still_serving(client, fake) -> None:
    resp = client.post("/v1/embeddings", json={"input": "still here"})
    assert resp.status_code == 200
    np.testing.assert_allclose(vectors(resp)[0], fake.expected("still here"), rtol=1e-6)


def test_list_input_keeps_order_index_and_counts_real_tokens(client, fake):
    resp = client.post("/v1/embeddings", json={"input": TEXTS, "model": "text-embedding-3-small"})
    body = resp.get_json()
    assert resp.status_code == 200
    assert body["object"] == "list" and body["model"] == "fake"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in body["data"])
    for row, text in zip(vectors(resp), TEXTS, strict=True):
        np.testing.assert_allclose(row, fake.expected(text), rtol=1e-6)
    tokens = sum(len(t.split()) + 2 for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_embeddings_alias_and_single_string(client, fake):
    resp = client.post("/embeddings", json={"input": "hello world", "user": "u1", "extra": 1})
    assert resp.status_code == 200
    np.testing.assert_allclose(vectors(resp)[0], fake.expected("hello world"), rtol=1e-6)


def test_base64_is_little_endian_float32(client, fake):
    resp = client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"})
    for d, text in zip(resp.get_json()["data"], TEXTS, strict=True):
        row = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        np.testing.assert_allclose(row, fake.expected(text), rtol=1e-6)


def test_token_ids_are_openai_ids_by_default(client, fake):
    # cl100k_base ids of "hello world", both inside the fake's vocabulary range (1000 ids)
    # would be read as the fake's ids by a server that did not decode them.
    resp = client.post("/v1/embeddings", json={"input": [[15339, 1917], [64, 65]]})
    assert resp.status_code == 200, resp.get_data(as_text=True)
    for row, text in zip(vectors(resp), ["hello world", "ab"], strict=True):
        np.testing.assert_allclose(row, fake.expected(text), rtol=1e-6)
    assert resp.get_json()["usage"]["prompt_tokens"] == (2 + 2) + (1 + 2)  # the fake's tokens
    four_o = client.post("/v1/embeddings", json={"input": [24912, 2375], "model": "gpt-4o"})
    np.testing.assert_allclose(vectors(four_o)[0], fake.expected("hello world"), rtol=1e-6)
    err = assert_error(client.post("/v1/embeddings", json={"input": [[1], [100256]]}),
                       400, "invalid_request_error", "input")
    assert err["code"] == "invalid_token_id" and "input 1" in err["message"]


def test_token_ids_of_the_served_model_with_token_ids_model(fake, registry):
    app = make_app(fake, registry, token_ids="model")
    client = app.test_client()
    one = fake.tokenize(["hello world"])[0]
    resp = client.post("/v1/embeddings", json={"input": one})
    np.testing.assert_allclose(vectors(resp)[0], fake.expected("hello world"), rtol=1e-6)
    many = fake.tokenize(TEXTS)
    resp = client.post("/v1/embeddings", json={"input": many, "model": "text-embedding-3-small"})
    for row, text in zip(vectors(resp), TEXTS, strict=True):
        np.testing.assert_allclose(row, fake.expected(text), rtol=1e-6)
    err = assert_error(client.post("/v1/embeddings", json={"input": [[5, 1000]]}),
                       400, "invalid_request_error", "input")
    assert "outside this model's vocabulary" in err["message"]


def test_dimensions_keeps_a_renormalised_prefix(client, fake):
    resp = client.post("/v1/embeddings", json={"input": "hello world", "dimensions": 4})
    row = vectors(resp)[0]
    raw = fake.vector(fake.wrap(fake.tokenize(["hello world"])[0]))[:4]
    np.testing.assert_allclose(row, raw / np.linalg.norm(raw), rtol=1e-6)
    assert row.shape == (4,)


def test_embed_route_tei_shape_and_options(client, fake):
    resp = client.post("/embed", json={"inputs": "hello world"})
    assert resp.status_code == 200
    body = resp.get_json()
    assert len(body) == 1 and len(body[0]) == 8
    raw = client.post("/embed", json={"inputs": ["hello world"], "normalize": False}).get_json()
    np.testing.assert_allclose(raw[0], fake.vector(fake.wrap(fake.tokenize(["hello world"])[0])),
                               rtol=1e-6)
    cut = client.post("/embed", json={"inputs": "hello world", "dimensions": 3}).get_json()
    assert len(cut[0]) == 3 and abs(np.linalg.norm(cut[0]) - 1) < 1e-6


def test_over_long_inputs_truncate_by_default_and_left_when_asked(client, fake):
    words = [f"w{i}" for i in range(40)]  # the fake's limit is 16 tokens, 14 of them words
    text = " ".join(words)
    resp = client.post("/v1/embeddings", json={"input": text})
    assert resp.get_json()["usage"]["prompt_tokens"] == 16
    np.testing.assert_allclose(vectors(resp)[0], fake.expected(" ".join(words[:14])), rtol=1e-6)
    left = client.post("/embed", json={"inputs": text, "truncation_direction": "Left"})
    np.testing.assert_allclose(left.get_json()[0], fake.expected(" ".join(words[-14:])), rtol=1e-6)


def test_over_long_inputs_are_400_when_truncation_is_off(fake, registry):
    client = make_app(fake, registry, auto_truncate=False).test_client()
    text = " ".join(["w"] * 30)
    err = assert_error(client.post("/v1/embeddings", json={"input": text}), 400,
                       "invalid_request_error", "input")
    assert "32 tokens" in err["message"] and "16" in err["message"]
    assert client.post("/embed", json={"inputs": text, "truncate": True}).status_code == 200


def test_embed_can_refuse_truncation_per_request(client):
    text = " ".join(["w"] * 30)
    resp = client.post("/embed", json={"inputs": text, "truncate": False})
    assert_error(resp, 400, "invalid_request_error", "input")


def test_tokenize_gives_ids_text_and_offsets(client):
    body = client.post("/tokenize", json={"inputs": ["hi  there"]}).get_json()
    assert body == [[
        {"id": 1, "text": "[CLS]", "special": True, "start": None, "stop": None},
        {"id": body[0][1]["id"], "text": "hi", "special": False, "start": 0, "stop": 2},
        {"id": body[0][2]["id"], "text": "there", "special": False, "start": 4, "stop": 9},
        {"id": 2, "text": "[SEP]", "special": True, "start": None, "stop": None},
    ]]


def test_info_and_health(client):
    info = client.get("/info").get_json()
    assert info["dimension"] == 8 and info["model_id"] == "fake" and info["state"] == "ready"
    assert info["max_batch_tokens"] == 16384 and isinstance(info["pid"], int)
    assert client.get("/health").get_json() == {"status": "ok"}


BAD_BODIES = [
    ("not json", b"{input: 1}", "application/json", 400),
    ("not an object", b"[1, 2]", "application/json", 400),
    ("input missing", b'{"model": "m"}', "application/json", 400),
    ("input a number", b'{"input": 3}', "application/json", 400),
    ("input mixed", b'{"input": ["a", 1]}', "application/json", 400),
    ("empty string", b'{"input": ""}', "application/json", 400),
    ("empty list", b'{"input": []}', "application/json", 400),
    ("empty string in list", b'{"input": ["a", ""]}', "application/json", 400),
    ("empty token list", b'{"input": [[1], []]}', "application/json", 400),
    ("negative token id", b'{"input": [5, -1]}', "application/json", 400),
    ("token id not in cl100k", b'{"input": [[5, 100256]]}', "application/json", 400),
    ("ids of an encoding not shipped", b'{"input": [5], "model": "davinci"}', "application/json",
     400),
    ("float token id", b'{"input": [5, 1.5]}', "application/json", 400),
    ("bad encoding_format", b'{"input": "a", "encoding_format": "hex"}', "application/json", 400),
    ("dimensions zero", b'{"input": "a", "dimensions": 0}', "application/json", 400),
    ("dimensions too big", b'{"input": "a", "dimensions": 9}', "application/json", 400),
    ("dimensions a string", b'{"input": "a", "dimensions": "4"}', "application/json", 400),
    ("dimensions a bool", b'{"input": "a", "dimensions": true}', "application/json", 400),
    ("model a number", b'{"input": "a", "model": 3}', "application/json", 400),
    ("lone surrogate", b'{"input": "\\ud800"}', "application/json", 400),
    ("non-UTF-8 bytes", b'{"input": "\xff\xfe"}', "application/json", 400),
    ("no content type", b'{"input": "fine"}', "", 200),
]


@pytest.mark.parametrize(
    ("name", "body", "ctype", "status"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES]
)
def test_bad_bodies_get_400_in_the_contract_shape(client, fake, name, body, ctype, status):
    resp = client.post("/v1/embeddings", data=body, content_type=ctype or None)
    if status == 200:
        assert resp.status_code == 200
    else:
        assert_error(resp, status, "invalid_request_error")
    assert_still_serving(client, fake)


def test_too_many_inputs_is_400(fake, registry):
    client = make_app(fake, registry, max_inputs_per_request=3).test_client()
    err = assert_error(client.post("/v1/embeddings", json={"input": ["a"] * 4}), 400,
                       "invalid_request_error", "input")
    assert "MAX_INPUTS_PER_REQUEST" in err["message"]
    assert_still_serving(client, fake)


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


def test_full_admission_gives_429_with_retry_after(fake, registry):
    app = make_app(fake, registry, max_queue=2, max_inputs_per_request=2, max_batch_size=2)
    client = app.test_client()
    fake.hold()
    done = []
    t = threading.Thread(target=lambda: done.append(
        app.test_client().post("/v1/embeddings", json={"input": ["x", "y"]})))
    t.start()
    assert fake.entered.wait(5)
    resp = client.post("/v1/embeddings", json={"input": "z"})
    assert_error(resp, 429, "rate_limit_error")
    assert int(resp.headers["Retry-After"]) >= 1
    fake.gate.set()
    t.join(5)
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
        raise OSError("no such model")

    service = Service(Settings(request_timeout_s=1), loader=broken, metrics=Metrics(registry))
    app = create_app(service.settings, service=service)
    service.start(background=True)
    client = app.test_client()
    err = assert_error(client.post("/embed", json={"inputs": "x"}), 503, "service_unavailable")
    assert "failed to load" in err["message"]
    assert assert_error(client.get("/health"), 503, "service_unavailable")["code"] == "unhealthy"


def test_timing_headers_add_up(client):
    resp = client.post("/v1/embeddings", json={"input": TEXTS})
    h = {k: float(resp.headers[k]) for k in
         ("x-queue-time", "x-tokenization-time", "x-inference-time", "x-total-time")}
    assert h["x-queue-time"] + h["x-inference-time"] <= h["x-total-time"] + 1e-3
    assert int(resp.headers["x-compute-tokens"]) == resp.get_json()["usage"]["prompt_tokens"]


def test_openapi_describes_every_route_of_the_table(client):
    from embedsvc.routes import ROUTES

    doc = client.get("/openapi.json").get_json()
    described = {(path, method.upper()) for path, ops in doc["paths"].items() for method in ops}
    assert described == {(r.path, r.method) for r in ROUTES}
    for route in ROUTES:
        op = doc["paths"][route.path][route.method.lower()]
        assert op["summary"] == route.summary and "200" in op["responses"]
        if route.request is not None:
            assert route.request.__name__ in doc["components"]["schemas"]
    fields = doc["components"]["schemas"]["EmbeddingsRequest"]["properties"]
    assert set(fields) == {"input", "model", "encoding_format", "dimensions", "user"}
    assert orjson.loads(orjson.dumps(doc)) == doc


def test_every_route_answers_other_methods_with_405_and_allow(client, fake):
    from embedsvc.routes import ROUTES

    allowed: dict[str, set[str]] = {}
    for route in ROUTES:
        allowed.setdefault(route.path, set()).add(route.method)
    for path, methods in allowed.items():
        for method in {"GET", "POST", "PUT", "DELETE", "PATCH"} - methods - {"HEAD"}:
            resp = client.open(path, method=method, json={"input": "x"})
            assert_error(resp, 405, "invalid_request_error")
            assert set(resp.headers["Allow"].split(", ")) == methods, path
    assert_still_serving(client, fake)


def test_every_route_refuses_a_body_over_the_limit_with_413(fake, registry):
    from embedsvc.routes import ROUTES

    client = make_app(fake, registry, max_body_bytes=64).test_client()
    for route in ROUTES:
        resp = client.open(route.path, method=route.method, data=b"x" * 65)
        assert assert_error(resp, 413, "invalid_request_error")["code"] == "body_too_large"
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
    engine = app.extensions["embedsvc"].ready()
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
    while engine.batcher.depth == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    gone.set()  # the watchdog notices within its 100 ms tick
    t.join(5)
    assert orjson.loads(replies[0])["error"]["code"] == "client_disconnected"
    fake.gate.set()
    first.join(5)
    assert all(fake.wrap(fake.tokenize(["orphan words"])[0]) not in b for b in fake.batches)
    assert registry.get_sample_value("embedsvc_dropped_inputs_total",
                                     {"reason": "disconnected"}) == 1
