"""The Cohere embed, Ollama and Voyage/Jina routes and /docs, on the fake encoder."""

import base64
import dataclasses
from importlib import resources

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from embedsvc.model import quantize

from .conftest import TEXTS, assert_error, assert_still_serving, make_app, vectors

PROMPTED = {"query": "query: ", "passage": "passage: "}


@pytest.fixture
def app(fake, registry, tmp_path):
    return make_app(fake, registry, cache_dir=str(tmp_path))


@pytest.fixture
def client(app):
    return app.test_client()


def scale(app, dimensions=None):
    engine = app.extensions["embedsvc"].ready(1.0)
    return engine.calibration().scale(dimensions=dimensions)


def test_cohere_v2_answers_every_type_from_one_pass(client, app, fake):
    types = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    resp = client.post("/v2/embed", json={"texts": TEXTS, "model": "embed-v4.0",
                                          "input_type": "search_document",
                                          "embedding_types": types})
    assert resp.status_code == 200, resp.get_data(as_text=True)
    body = resp.get_json()
    assert set(body["embeddings"]) == set(types) and body["texts"] == TEXTS
    assert body["response_type"] == "embeddings_by_type"
    want = np.array([fake.expected(t) for t in TEXTS], np.float32)
    by = body["embeddings"]
    np.testing.assert_allclose(by["float"], want, rtol=1e-6)
    b64 = [np.frombuffer(base64.b64decode(s), "<f4") for s in by["base64"]]
    np.testing.assert_allclose(b64, want, rtol=1e-6)
    r = scale(app)
    assert by["int8"] == quantize.quantize(want, "int8", r).tolist()
    assert by["uint8"] == quantize.quantize(want, "uint8", r).tolist()
    assert by["ubinary"] == np.packbits(want > 0, axis=1).tolist()
    assert (np.array(by["binary"]) == np.array(by["ubinary"]) - 128).all()
    assert body["meta"]["billed_units"]["input_tokens"] == sum(len(t.split()) + 2 for t in TEXTS)


def test_cohere_v1_floats_unless_types_and_output_dimension(client, app, fake):
    plain = client.post("/v1/embed", json={"texts": TEXTS}).get_json()
    assert plain["response_type"] == "embeddings_floats"
    np.testing.assert_allclose(plain["embeddings"], [fake.expected(t) for t in TEXTS], rtol=1e-6)
    typed_ = client.post("/v1/embed", json={"texts": TEXTS, "embedding_types": ["int8"],
                                           "output_dimension": 4}).get_json()
    assert typed_["response_type"] == "embeddings_by_type"
    cut = np.array([fake.expected(t)[:4] for t in TEXTS])
    cut /= np.linalg.norm(cut, axis=1, keepdims=True)
    assert typed_["embeddings"]["int8"] == quantize.quantize(cut, "int8", scale(app, 4)).tolist()


def test_cohere_refuses_what_it_cannot_honour(client, fake):
    for body, param in [({"texts": ["a"], "images": ["data:"]}, "images"),
                        ({"texts": ["a"], "max_tokens": 5}, "max_tokens"),
                        ({"texts": []}, "texts"),
                        ({"texts": ["a"], "input_type": "image"}, "input_type"),
                        ({"texts": ["a"], "embedding_types": ["int4"]}, "embedding_types"),
                        ({"texts": ["a"], "truncate": "MIDDLE"}, "truncate"),
                        ({"texts": ["a"], "output_dimension": 9999}, "output_dimension")]:
        assert_error(client.post("/v2/embed", json=body), 400, "invalid_request_error", param)
    named = assert_error(client.post("/v2/embed", json={"texts": ["a"], "output_dimension": 0}),
                         400, "invalid_request_error", "output_dimension")
    assert named["message"].startswith("'output_dimension' must be between 1 and"), named
    long = " ".join(["word"] * 40)  # past the fake's 16 tokens
    assert_error(client.post("/v2/embed", json={"texts": [long], "truncate": "NONE"}),
                 400, "invalid_request_error", "texts")  # the field it was sent in
    assert_still_serving(client, fake)


def test_cohere_truncate_start_keeps_the_end(client, fake):
    words = [f"w{i}" for i in range(30)]
    resp = client.post("/v2/embed", json={"texts": [" ".join(words)], "truncate": "START"})
    want = fake.expected(" ".join(words[-14:]))  # 16 tokens less the 2 special ones
    np.testing.assert_allclose(resp.get_json()["embeddings"]["float"][0], want, rtol=1e-6)


def test_input_roles_use_the_models_prompts(fake, registry, tmp_path):
    fake.info = dataclasses.replace(fake.info, prompts=PROMPTED)
    client = make_app(fake, registry, cache_dir=str(tmp_path)).test_client()
    cases = [("/v2/embed", {"texts": ["hi there"], "input_type": "search_query"}, "query: "),
             ("/v2/embed", {"texts": ["hi there"], "input_type": "search_document"}, "passage: "),
             ("/v2/embed", {"texts": ["hi there"], "input_type": "clustering"}, ""),
             ("/v1/embeddings", {"input": ["hi there"], "input_type": "query"}, "query: "),
             ("/v1/embeddings", {"input": ["hi there"], "task": "retrieval.passage"}, "passage: ")]
    for path, body, prefix in cases:
        out = client.post(path, json=body).get_json()
        got = out["embeddings"]["float"][0] if "texts" in body else out["data"][0]["embedding"]
        np.testing.assert_allclose(got, fake.expected(prefix + "hi there"), rtol=1e-6)
    # OpenAI token ids become text first, and take the prompt; the model's own ids cannot
    ids = client.post("/v1/embeddings", json={"input": [[15339, 1917]], "input_type": "query"})
    np.testing.assert_allclose(vectors(ids)[0], fake.expected("query: hello world"), rtol=1e-6)
    own = make_app(fake, CollectorRegistry(), cache_dir=str(tmp_path), token_ids="model")
    own = own.test_client()
    assert_error(own.post("/v1/embeddings", json={"input": [[5, 6]], "input_type": "query"}),
                 400, "invalid_request_error", "input_type")


def test_voyage_output_dtype_and_dimension(client, app, fake):
    resp = client.post("/v1/embeddings", json={"input": TEXTS, "output_dtype": "int8",
                                               "output_dimension": 4, "encoding_format": "base64"})
    assert resp.status_code == 200, resp.get_data(as_text=True)
    got = [np.frombuffer(base64.b64decode(d["embedding"]), np.int8) for d in
           resp.get_json()["data"]]
    cut = np.array([fake.expected(t)[:4] for t in TEXTS])
    cut /= np.linalg.norm(cut, axis=1, keepdims=True)
    assert np.array_equal(got, quantize.quantize(cut, "int8", scale(app, 4)))
    bits = client.post("/v1/embeddings", json={"input": TEXTS, "embedding_type": "ubinary"})
    assert vectors(bits).tolist() == np.packbits(
        np.array([fake.expected(t) for t in TEXTS]) > 0, axis=1).tolist()


def test_voyage_and_jina_fields_refused_when_they_disagree_or_are_unknown(client, fake):
    for body, param in [({"output_dtype": "int4"}, "output_dtype"),
                        ({"dimensions": 4, "output_dimension": 5}, "output_dimension"),
                        ({"output_dtype": "int8", "embedding_type": "binary"}, "embedding_type"),
                        ({"input_type": "question"}, "input_type"),
                        ({"task": "retrieval.query", "input_type": "query"}, "task"),
                        ({"output_dimension": 99}, "output_dimension"),
                        ({"dimensions": 99}, "dimensions")]:
        assert_error(client.post("/v1/embeddings", json={"input": "a b", **body}), 400,
                     "invalid_request_error", param)
    long = " ".join(["word"] * 40)
    assert_error(client.post("/v1/embeddings", json={"input": long, "truncation": False}),
                 400, "invalid_request_error", "input")
    assert_still_serving(client, fake)


def test_ollama_embed_embeddings_tags_show_version(client, fake):
    resp = client.post("/api/embed", json={"model": "nomic-embed-text", "input": TEXTS,
                                           "options": {"num_ctx": 8}, "keep_alive": "5m"})
    body = resp.get_json()
    np.testing.assert_allclose(body["embeddings"], [fake.expected(t) for t in TEXTS], rtol=1e-6)
    assert body["model"] == "fake:latest" and body["load_duration"] == 0
    assert body["prompt_eval_count"] == sum(len(t.split()) + 2 for t in TEXTS)
    assert body["total_duration"] > 0
    assert client.post("/api/embed", json={"input": []}).get_json()["embeddings"] == []
    one = client.post("/api/embeddings", json={"model": "x", "prompt": "hello world"}).get_json()
    v = fake.vector(fake.wrap(fake.tokenize(["hello world"])[0]))  # raw, as Ollama's legacy
    np.testing.assert_allclose(one["embedding"], v, rtol=1e-6)
    model = client.get("/api/tags").get_json()["models"][0]
    assert model["model"] == model["name"] == "fake:latest"
    assert len(model["digest"]) == 64 and model["details"]["family"] == "embedding"
    show = client.post("/api/show", json={"model": "fake"}).get_json()
    assert show["capabilities"] == ["embedding"]
    assert show["model_info"]["embedding.embedding_length"] == 8
    assert client.get("/api/version").get_json()["version"]


def test_ollama_errors_in_ollamas_shape(client, fake):
    for resp, status in [(client.post("/api/generate", json={"model": "m", "prompt": "p"}), 501),
                         (client.post("/api/chat", json={}), 501),
                         (client.delete("/api/delete"), 501),
                         (client.post("/api/show", json={"model": "llama3"}), 404),
                         (client.post("/api/embed", json={"input": 5}), 400),
                         (client.post("/api/embed", json={"input": [], "dimensions": 0}), 400),
                         (client.post("/api/embeddings", json={}), 400),
                         (client.post("/api/embed", data=b"{"), 400)]:
        assert resp.status_code == status, resp.get_data(as_text=True)
        body = resp.get_json()
        assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    assert "embeds only" in client.post("/api/pull", json={}).get_json()["error"]
    empty = client.post("/api/embed", json={"input": [], "dimensions": 2})
    assert empty.status_code == 200 and empty.get_json()["embeddings"] == []
    assert_still_serving(client, fake)


def test_docs_page_and_its_files_are_open_and_local(fake, registry, tmp_path):
    client = make_app(fake, registry, api_key="k", cache_dir=str(tmp_path)).test_client()
    page = client.get("/docs")
    assert page.status_code == 200 and page.content_type.startswith("text/html")
    html = page.get_data(as_text=True)
    assert "http" not in html.replace("<!doctype html>", "")  # no other host named
    release = resources.files("flask_swagger_ui") / "dist"
    for name in ("swagger-ui.css", "swagger-ui-bundle.js", "favicon-32x32.png"):
        assert f'"docs/{name}"' in html
        asset = client.get(f"/docs/{name}")
        assert asset.status_code == 200 and asset.data == (release / name).read_bytes()
        # the files themselves: Swagger UI's bundle and style (hundreds of KB), a real PNG
        assert len(asset.data) > 100_000 or asset.data.startswith(b"\x89PNG\r\n\x1a\n")
    assert client.get("/openapi.json").status_code == 401  # the document keeps its key


def test_an_empty_messages_list_is_named_as_sent(client, fake):
    """vLLM's ``messages`` empty: refused as an empty ``input`` is, naming the field sent."""
    error = assert_error(client.post("/v1/embeddings", json={"messages": []}), 400,
                         "invalid_request_error", "messages")
    assert error["code"] == "empty_input" and "'messages' must not be empty" in error["message"]
    assert_still_serving(client, fake)


def test_token_ids_sent_as_images_are_refused_not_embedded_as_text(client, fake):
    """Infinity's ``modality: image`` says every item of ``input`` is an image: token ids
    there are a 400, as a string that is no image is, not a text vector of those ids."""
    for ids in ([5, 6], [[5, 6]], [[5], [6]]):
        error = assert_error(client.post("/v1/embeddings",
                                         json={"input": ids, "modality": "image"}),
                             400, "invalid_request_error", "input")
        assert error["code"] == "invalid_input" and "not token ids" in error["message"]
    assert client.post("/v1/embeddings", json={"input": [5, 6]}).status_code == 200
    assert_still_serving(client, fake)
