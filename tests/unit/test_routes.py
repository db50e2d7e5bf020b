"""routes.py: each handler's request and response shapes, on the fake encoder."""

import base64
import dataclasses
from urllib.parse import urljoin

import numpy as np
import orjson
import pytest

from .conftest import TEXTS, assert_error, assert_still_serving, make_app, vectors


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
    client = make_app(fake, registry, token_ids="model").test_client()
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
    # the length given, counted on the refusal (as the contract asks), not "more tokens"
    assert "has 32 tokens, more than this model's limit of 16" in err["message"], err
    assert client.post("/embed", json={"inputs": text, "truncate": True}).status_code == 200


def test_a_refused_texts_length_is_counted_only_up_to_a_bound(fake, registry, monkeypatch):
    """A body of megabytes is not tokenized whole to say how far past the limit it is."""
    from embedsvc import engine_client

    monkeypatch.setattr(engine_client, "_COUNT_MOST", 20)
    client = make_app(fake, registry, auto_truncate=False).test_client()
    err = assert_error(client.post("/v1/embeddings", json={"input": " ".join(["w"] * 30)}),
                       400, "invalid_request_error", "input")
    assert "has at least 22 tokens, more than this model's limit of 16" in err["message"], err


def test_embed_can_refuse_truncation_per_request(client):
    text = " ".join(["w"] * 30)
    resp = client.post("/embed", json={"inputs": text, "truncate": False})
    assert_error(resp, 400, "invalid_request_error", "inputs")  # /embed's field


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
    assert info["backend"] == "torch"
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


@pytest.mark.parametrize(("path", "fields"), [
    ("/v1/embeddings", "'input'"), ("/embed", "'inputs'"), ("/v2/embed", "'texts'"),
    ("/api/embed", "'input'"), ("/decode", "'ids'")])
def test_a_body_that_is_not_json_is_told_the_routes_own_fields(client, path, fields):
    resp = client.post(path, data=b"{input: 1}", content_type="application/json")
    assert resp.status_code == 400
    message = resp.get_json()["error"]
    message = message if isinstance(message, str) else message["message"]
    assert message == f"the body is not valid JSON; send a JSON object with {fields}"


def test_too_many_inputs_is_400(fake, registry):
    client = make_app(fake, registry, max_inputs_per_request=3).test_client()
    err = assert_error(client.post("/v1/embeddings", json={"input": ["a"] * 4}), 400,
                       "invalid_request_error", "input")
    assert "MAX_INPUTS_PER_REQUEST" in err["message"]
    assert_still_serving(client, fake)


def test_timing_headers_add_up(client):
    resp = client.post("/v1/embeddings", json={"input": TEXTS})
    h = {k: float(resp.headers[k]) for k in
         ("x-queue-time", "x-tokenization-time", "x-inference-time", "x-total-time")}
    assert h["x-queue-time"] + h["x-inference-time"] <= h["x-total-time"] + 1e-3
    assert int(resp.headers["x-compute-tokens"]) == resp.get_json()["usage"]["prompt_tokens"]


def test_openapi_describes_every_route_of_the_table(client):
    from embedsvc.api.routes import ROUTES

    doc = client.get("/openapi.json").get_json()
    described = {(path, method.upper()) for path, ops in doc["paths"].items() for method in ops}
    listed = [r for r in ROUTES if r.listed]
    assert described == {(r.path, r.method) for r in listed}
    # only the /docs page's own files, and its address with a slash, are left out
    assert {r.path for r in ROUTES if not r.listed} == {
        "/docs/swagger-ui.css", "/docs/swagger-ui-bundle.js", "/docs/favicon-32x32.png",
        "/docs/"}
    for route in listed:
        op = doc["paths"][route.path][route.method.lower()]
        assert op["summary"] == route.summary and "200" in op["responses"]
        if route.request is not None:
            assert route.request.__name__ in doc["components"]["schemas"]
    fields = doc["components"]["schemas"]["TypedEmbeddingsRequest"]["properties"]
    assert set(fields) == {"input", "model", "encoding_format", "dimensions", "user",
                           "input_type", "task", "output_dimension", "output_dtype",
                           "embedding_type", "truncation", "normalized", "modality",
                           "messages"}
    assert orjson.loads(orjson.dumps(doc)) == doc


def test_the_docs_page_with_a_slash_redirects_to_it(client):
    for method in (client.get, client.head):
        resp = method("/docs/")
        assert resp.status_code == 308 and resp.headers["Location"] == "../docs"
    for prefix in ("", "/behind/a/proxy"):  # a relative reference, as the page's links
        target = urljoin(f"http://host{prefix}/docs/", resp.headers["Location"])
        assert target == f"http://host{prefix}/docs"


def test_a_path_parameter_takes_the_rest_of_the_path_and_is_counted_by_its_route(client):
    assert client.get("/v1/models/fake").get_json()["id"] == "fake"
    for other in ("/v1/models/org/fake", "/v1/models/fake/"):
        assert assert_error(client.get(other), 404, "invalid_request_error",
                            "model")["code"] == "model_not_found"
    assert client.post("/v1/models/fake").status_code == 405
    assert client.get("/v1/models/").status_code == 404  # no id: no such route
    metrics = client.get("/metrics").get_data(as_text=True)
    assert 'route="/v1/models/{model}",status="404"} 2.0' in metrics
    doc = client.get("/openapi.json").get_json()
    [param] = doc["paths"]["/v1/models/{model}"]["get"]["parameters"]
    assert param == {"name": "model", "in": "path", "required": True,
                     "schema": {"type": "string"}}


def test_tokenize_takes_teis_add_special_tokens_and_prompt_name(fake, registry, tmp_path):
    """TEI's /tokenize options: ``add_special_tokens: false`` gives the text's own tokens
    only, ``prompt_name`` the tokens of the prompted text (as /embed prompts it); an unknown
    prompt is a 400. Both were accepted and ignored: the special tokens always came."""
    fake.info = dataclasses.replace(fake.info, prompts={"query": "query: "})
    client = make_app(fake, registry, cache_dir=str(tmp_path)).test_client()
    bare = client.post("/tokenize", json={"inputs": "hi there",
                                          "add_special_tokens": False}).get_json()
    assert [(t["text"], t["special"], t["start"]) for t in bare[0]] == \
        [("hi", False, 0), ("there", False, 3)]
    both = client.post("/tokenize", json={"inputs": ["hi", "a b"], "prompt_name": "query",
                                          "add_special_tokens": True}).get_json()
    assert [[t["text"] for t in row] for row in both] == \
        [["[CLS]", "query:", "hi", "[SEP]"], ["[CLS]", "query:", "a", "b", "[SEP]"]]
    assert both[0][2]["start"] == len("query: ")
    assert_error(client.post("/tokenize", json={"inputs": "hi", "prompt_name": "nope"}), 400,
                 "invalid_request_error", "prompt_name")
    assert_error(client.post("/tokenize", json={"inputs": "hi", "add_special_tokens": "no"}),
                 400, "invalid_request_error", "add_special_tokens")


def test_a_nested_fields_error_names_its_whole_path(client):
    """'inputs' was sent; what is missing is inside it. The message named the top field."""
    err = assert_error(client.post("/similarity", json={"inputs": {"source_sentence": "a"}}),
                       400, "invalid_request_error", "inputs")
    assert err["message"] == "'inputs.sentences' is required", err
    err = assert_error(client.post("/similarity", json={
        "inputs": {"source_sentence": 1, "sentences": ["b"]}}), 400, "invalid_request_error",
        "inputs")
    assert err["message"].startswith("'inputs.source_sentence': "), err
    # pydantic's names of a union's members are no field of the client's; an item, [i]
    refused = client.post("/api/embed", json={"model": "m", "input": "a", "keep_alive": []})
    assert refused.status_code == 400
    assert refused.get_json()["error"].startswith("'keep_alive': "), refused.get_json()
    err = assert_error(client.post("/v2/embed", json={
        "texts": ["a"], "input_type": "search_query", "embedding_types": ["x"]}), 400,
        "invalid_request_error", "embedding_types")
    assert err["message"].startswith("'embedding_types[0]': "), err


@pytest.mark.parametrize("route, body, field", [
    ("/embed", {"inputs": []}, "inputs"),
    ("/embed", {"inputs": ["ok", ""]}, "inputs"),
    ("/embed_all", {"inputs": [""]}, "inputs"),
    ("/v2/embed", {"texts": ["ok", ""], "input_type": "search_query"}, "texts"),
    ("/v1/embeddings", {"input": ["ok", ""]}, "input"),
])
def test_a_refused_input_names_the_routes_own_field(client, route, body, field):
    """The rules name every list 'input', as OpenAI's route calls it; TEI's routes call it
    'inputs' and Cohere's 'texts', and a client's error named a field it never sent."""
    resp = client.post(route, json=body)
    assert resp.status_code == 400 and resp.get_json()["error"]["param"] == field, \
        resp.get_json()
