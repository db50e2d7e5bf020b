"""TEI's routes on an embedding model: the shapes TEI answers with (TEI_SHAPES in the notes)."""

import numpy as np
import pytest

from .conftest import assert_error, make_app


@pytest.mark.parametrize("path", ["/", "/invocations"])
def test_post_root_and_invocations_answer_as_embed(client, fake, path):
    one = client.post(path, json={"inputs": "hello world"})
    assert one.status_code == 200
    assert one.get_json() == client.post("/embed", json={"inputs": "hello world"}).get_json()
    body = client.post(path, json={"inputs": ["a b", "c"], "normalize": False}).get_json()
    assert len(body) == 2 and len(body[0]) == 8
    np.testing.assert_allclose(body[0], fake.vector(fake.wrap(fake.tokenize(["a b"])[0])),
                               rtol=1e-6)
    assert_error(client.post(path, json={"input": "openai field"}), 400, "invalid_request_error",
                 "inputs")


@pytest.mark.parametrize("path", ["/", "/ping", "/health"])
def test_get_root_and_ping_are_health_checks_open_without_the_key(fake, registry, path):
    client = make_app(fake, registry, api_key="k").test_client()
    resp = client.get(path)
    assert resp.status_code == 200 and resp.get_json() == {"status": "ok"}
    assert_error(client.post("/", json={"inputs": "x"}), 401, "authentication_error")
    ok = client.post("/", json={"inputs": "x"}, headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200


def test_health_aliases_say_503_while_draining(fake, registry):
    app = make_app(fake, registry)
    app.extensions["embedsvc"].drain(timeout=1)
    for path in ("/", "/ping"):
        err = assert_error(app.test_client().get(path), 503, "service_unavailable")
        assert err["code"] == "draining"


def test_embed_takes_the_models_token_ids_with_or_without_special_tokens(client, fake):
    bare = fake.tokenize(["hello world"])[0]
    wrapped = fake.wrap(bare)
    want = fake.expected("hello world")
    for inputs in (bare, [bare], wrapped, [wrapped]):
        body = client.post("/embed", json={"inputs": inputs}).get_json()
        assert len(body) == 1
        np.testing.assert_allclose(body[0], want, rtol=1e-6)
    assert fake.batches[-1] == [wrapped]  # the special tokens were not added twice
    two = client.post("/embed", json={"inputs": [bare, fake.tokenize(["a"])[0]]}).get_json()
    np.testing.assert_allclose(two[1], fake.expected("a"), rtol=1e-6)


def test_embed_token_id_errors(client):
    err = assert_error(client.post("/embed", json={"inputs": [[5, 1000]]}), 400,
                       "invalid_request_error", "inputs")  # the route's field, as below
    assert err["code"] == "invalid_token_id"
    err = assert_error(client.post("/embed", json={"inputs": ["a", [5]]}), 400,
                       "invalid_request_error", "inputs")
    assert "token ids" in err["message"]
    assert_error(client.post("/embed", json={"inputs": [[5], []]}), 400,
                 "invalid_request_error", "inputs")
    err = assert_error(client.post("/embed", json={"inputs": [5], "prompt_name": "query"}), 400,
                       "invalid_request_error", "prompt_name")


def test_embed_all_gives_one_raw_vector_per_token(client, fake):
    resp = client.post("/embed_all", json={"inputs": ["hello big world", "a"]})
    assert resp.status_code == 200
    body = resp.get_json()
    assert [np.array(rows).shape for rows in body] == [(5, 8), (3, 8)]  # [CLS] ... [SEP]
    for rows, text in zip(body, ["hello big world", "a"], strict=True):
        ids = fake.wrap(fake.tokenize([text])[0])
        np.testing.assert_allclose(np.sum(rows, axis=0), fake.vector(ids), rtol=1e-5)
    assert resp.headers["x-compute-tokens"] == "8"
    single = client.post("/embed_all", json={"inputs": "one", "truncation_direction": "Left"})
    assert np.array(single.get_json()).shape == (1, 3, 8)
    ids = client.post("/embed_all", json={"inputs": fake.tokenize(["one"])[0]}).get_json()
    assert ids == single.get_json()


def test_embed_all_truncates_like_embed(client):
    words = " ".join(f"w{i}" for i in range(40))  # the fake's limit is 16 tokens
    body = client.post("/embed_all", json={"inputs": words}).get_json()
    assert np.array(body).shape == (1, 16, 8)
    err = assert_error(client.post("/embed_all", json={"inputs": words, "truncate": False}),
                       400, "invalid_request_error", "inputs")
    assert err["code"] == "input_too_long"


def test_decode_gives_one_text_per_id_list(client):
    assert client.post("/decode", json={"ids": [1, 7, 2]}).get_json() == ["w7"]
    body = client.post("/decode", json={"ids": [[1, 7, 2], [9]], "skip_special_tokens": False})
    assert body.get_json() == ["[CLS] w7 [SEP]", "w9"]
    assert_error(client.post("/decode", json={"ids": []}), 400, "invalid_request_error")
    assert_error(client.post("/decode", json={"ids": [[1], [1000]]}), 400,
                 "invalid_request_error")
    assert_error(client.post("/decode", json={"ids": "1 2"}), 400, "invalid_request_error", "ids")


def test_info_has_teis_fields_beside_embedsvcs(client):
    info = client.get("/info").get_json()
    tei = {"model_id", "model_sha", "model_dtype", "served_model_name", "model_type",
           "max_concurrent_requests", "max_input_length", "max_batch_tokens",
           "max_batch_requests", "max_client_batch_size", "auto_truncate",
           "tokenization_workers", "version", "sha", "docker_label"}
    assert tei <= set(info)
    assert info["model_type"] == {"embedding": {}}  # the fake has no pooling module
    assert info["model_dtype"] == "float32" and info["served_model_name"] == "fake"
    assert info["max_concurrent_requests"] == info["max_queue"] == 2048
    assert info["kind"] == "embedding" and info["dimension"] == 8 and info["pid"] > 0
