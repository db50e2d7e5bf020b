"""Every answer matches its route's published schema, and says nothing the schema does not.

Each route of the table goes through the pipeline once per model kind (the bundled embedding
model and the tiny reranker, classifier and sparse encoder of tests/models.py): a 200 is
validated against the route's response schema, anything else against the error schema, with
every object closed (``additionalProperties: false``), so a key an answer carries that its
schema lacks fails here.
"""

from __future__ import annotations

import copy

import jsonschema
import orjson
import pytest
from prometheus_client import CollectorRegistry

from embedsvc.api.routes import ROUTES
from embedsvc.api.schemas import ERROR, OLLAMA_ERROR
from embedsvc.api.wsgi import create_app
from embedsvc.metrics import Metrics
from embedsvc.service import Service
from embedsvc.settings import Settings

# One valid body per POST route, for the kind that serves it; the other kinds answer an error.
PAIR = {"query": "what is a cat", "texts": ["a cat is an animal", "rain falls"]}
BODIES = {
    "/v1/embeddings": {"input": ["hello world", "a cat"], "model": "any"},
    "/embeddings": {"input": "hello world", "encoding_format": "base64"},
    "/embed": {"inputs": ["hello world", "a cat"]},
    "/similarity": {"inputs": {"source_sentence": "a cat", "sentences": ["a dog", "rain"]}},
    "/rerank": {**PAIR, "return_text": True},
    "/v1/rerank": {"query": "q", "documents": ["a", "b"], "top_n": 1, "return_documents": True},
    "/v2/rerank": {"query": "q", "documents": [{"text": "a"}, "b"]},
    "/predict": {"inputs": [["a cat", "an animal"], ["rain", "sun"]]},
    "/embed_sparse": {"inputs": ["hello world"]},
    "/tokenize": {"inputs": ["hello world"]},
    "/embed_all": {"inputs": "hello world"},
    "/decode": {"ids": [[101, 7592, 2088, 102]]},
    "/": {"inputs": "hello world"},
    "/invocations": {"inputs": "hello world"},
    "/v2/embed": {"texts": ["hello world"], "input_type": "search_query",
                  "embedding_types": ["float", "int8", "uint8", "binary", "ubinary", "base64"]},
    "/v1/embed": {"texts": ["hello world"], "embedding_types": ["float", "int8"]},
    "/api/embed": {"model": "nomic-embed-text", "input": ["hello world", "a cat"]},
    "/api/embeddings": {"model": "nomic-embed-text", "prompt": "hello world"},
    "/api/show": None,  # the name /api/tags lists, per app (below)
    **{path: {"model": "llama3", "prompt": "hi"} for path in (
        "/api/generate", "/api/chat", "/api/pull", "/api/push", "/api/create", "/api/copy",
        "/api/delete")},
}
EMBEDS_ONLY = 501  # Ollama's routes for other work: Ollama's error shape, this status only
ROOT_BODIES = {  # POST / and /invocations take the served kind's own body
    "reranker": PAIR, "classifier": {"inputs": "a cat"}, "sparse": {"inputs": "hello"},
}


def closed(schema):
    """``schema`` with every object that lists its properties closed to other keys."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.fixture(scope="module")
def apps(kind_dirs):
    built, services = {}, []
    for kind, model in [("embedding", ""), *((k, str(v)) for k, v in kind_dirs.items())]:
        settings = Settings(model=model, device="cpu", backend="torch")
        service = Service(settings, metrics=Metrics(CollectorRegistry()))
        service.start(background=False)
        services.append(service)
        built[kind] = create_app(settings, service=service).test_client()
    yield built
    for service in services:
        service.drain(timeout=5)


def answer(client, route, kind):
    if route.parameter == "model":  # the served model, by the name the list gives
        return client.get(f"/v1/models/{client.get('/v1/models').get_json()['data'][0]['id']}")
    if route.method == "GET":
        return client.get(route.path)
    body = BODIES[route.path]
    if route.path in ("/", "/invocations"):
        body = ROOT_BODIES.get(kind, body)
    if route.path == "/api/show":
        body = {"model": client.get("/api/tags").get_json()["models"][0]["name"]}
    return client.open(route.path, method=route.method, data=orjson.dumps(body),
                       content_type="application/json")


def test_every_post_route_has_a_body_here():
    posts = {r.path for r in ROUTES if r.method in ("POST", "DELETE")}
    assert posts <= set(BODIES), f"add a body for {sorted(posts - set(BODIES))}"


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r.method} {r.path}")
def test_every_answer_matches_its_routes_schema(apps, route):
    served_by = []
    for kind, client in apps.items():
        got = answer(client, route, kind)
        if route.path == "/docs/":  # a redirect to /docs
            assert got.status_code == 308 and got.headers["Location"] == "../docs"
            served_by.append(kind)
            continue
        if route.response is None:  # /metrics, /docs and its assets: not JSON
            assert got.status_code == 200 and got.mimetype != "application/json", got.data
            served_by.append(kind)
            continue
        body = orjson.loads(got.data)
        if got.status_code in (200, EMBEDS_ONLY):
            jsonschema.validate(body, closed(route.response))
            served_by.append(kind)
        else:
            assert 400 <= got.status_code < 500, (kind, got.status_code, body)
            jsonschema.validate(body, closed(OLLAMA_ERROR if route.path.startswith("/api/")
                                             else ERROR))
    expected = set(apps) if not route.kinds else set(route.kinds) & set(apps)
    assert set(served_by) == expected, f"served by {served_by}, expected {sorted(expected)}"


def test_the_check_fails_on_an_unpublished_key():
    with pytest.raises(jsonschema.ValidationError, match="extra"):
        jsonschema.validate({"status": "ok", "extra": 1}, closed(
            next(r for r in ROUTES if r.path == "/health").response))
