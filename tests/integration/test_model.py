"""The real model behind the Flask app: vectors equal sentence-transformers' own."""

import base64

import numpy as np
from prometheus_client import CollectorRegistry

from embedsvc.api.wsgi import create_app
from embedsvc.metrics import Metrics
from embedsvc.service import Service
from embedsvc.settings import Settings

from .conftest import cosine

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors.",
    "Ein Satz auf Deutsch, mit Umlauten: äöü.",
    "short",
]


def post(app, route, body):
    resp = app.test_client().post(route, json=body)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return resp.get_json()


def rows(body) -> np.ndarray:
    return np.array([d["embedding"] for d in body["data"]])


def test_single_string_matches_sentence_transformers(real_app, reference):
    body = post(real_app, "/v1/embeddings", {"input": TEXTS[0]})
    got = rows(body)
    assert got.shape == (1, 384)
    assert cosine(got, reference.encode(TEXTS[0]))[0] > 0.9999


def test_list_keeps_order_and_index(real_app, reference):
    body = post(real_app, "/v1/embeddings", {"input": TEXTS})
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    assert (cosine(rows(body), reference.encode(TEXTS)) > 0.9999).all()
    assert body["model"] == "all-MiniLM-L6-v2"


def test_base64_decodes_to_the_same_vectors(real_app, reference):
    body = post(real_app, "/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"})
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in body["data"]])
    assert (cosine(got, reference.encode(TEXTS)) > 0.9999).all()


def test_openai_token_ids_give_the_vector_of_their_text(real_app, reference, tiktoken_cache):
    import tiktoken

    enc = tiktoken.get_encoding("cl100k_base")
    ids = [enc.encode_ordinary(t) for t in TEXTS]
    body = post(real_app, "/v1/embeddings", {"input": ids, "model": "text-embedding-3-small"})
    assert (cosine(rows(body), reference.encode(TEXTS)) > 0.9999).all()
    expected = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert body["usage"]["prompt_tokens"] == expected  # the served model's tokens


def test_model_token_ids_with_token_ids_model(reference):
    service = Service(Settings(device="cpu", token_ids="model"),
                      metrics=Metrics(CollectorRegistry()))
    service.start(background=False)
    app = create_app(service.settings, service=service)
    try:
        ids = [reference.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
        body = post(app, "/v1/embeddings", {"input": ids})
        assert (cosine(rows(body), reference.encode(TEXTS)) > 0.9999).all()
        single = post(app, "/v1/embeddings", {"input": ids[1]})
        assert cosine(rows(single), reference.encode(TEXTS[1]))[0] > 0.9999
    finally:
        service.drain(timeout=5)


def test_embed_route(real_app, reference):
    body = post(real_app, "/embed", {"inputs": TEXTS})
    assert (cosine(np.array(body), reference.encode(TEXTS)) > 0.9999).all()
    one = post(real_app, "/embed", {"inputs": TEXTS[2]})
    assert len(one) == 1 and len(one[0]) == 384


def test_usage_counts_the_tokenizers_tokens(real_app, reference):
    body = post(real_app, "/v1/embeddings", {"input": TEXTS})
    expected = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": expected, "total_tokens": expected}


def test_long_input_is_truncated_like_sentence_transformers(real_app, reference):
    text = " ".join(f"word{i}" for i in range(600))
    body = post(real_app, "/v1/embeddings", {"input": text})
    assert body["usage"]["prompt_tokens"] == reference.max_seq_length == 256
    assert cosine(rows(body), reference.encode(text))[0] > 0.9999


def test_embed_truncates_left_or_right_like_the_cut_text(real_app, reference):
    words = ["apple", "river", "green", "house", "music", "table", "water", "light"]
    text = " ".join(words[i % len(words)] + ("" if i % 3 else " and") for i in range(400))
    ids = reference.tokenizer(text, add_special_tokens=False)["input_ids"]
    keep = reference.max_seq_length - 2
    for direction, kept in (("right", ids[:keep]), ("left", ids[-keep:])):
        body = post(real_app, "/embed", {"inputs": text, "truncate": True,
                                          "truncation_direction": direction})
        expected = reference.encode(reference.tokenizer.decode(kept))
        assert cosine(np.array(body), expected)[0] > 0.9999, direction


def test_the_backend_asked_for_is_the_one_serving(real_app):
    info = real_app.extensions["embedsvc"].model
    assert info.backend == real_app.extensions["embedsvc"].settings.backend
    assert real_app.test_client().get("/info").get_json()["backend"] == info.backend
    # ONNX Runtime holds the whole pipeline (lean.py): the encoder keeps no PyTorch module
    encoder = real_app.extensions["embedsvc"].runner.encoder
    if info.backend == "onnx":
        assert not hasattr(encoder, "input_module")
    else:
        assert {p.device.type for p in encoder.input_module.parameters()} == {"cpu"}
    assert info.parameters == 22_713_216  # counted at export, from PyTorch's model


def test_dimensions_64_is_a_renormalised_prefix(real_app, reference):
    body = post(real_app, "/v1/embeddings", {"input": TEXTS[0], "dimensions": 64})
    got = rows(body)[0]
    full = reference.encode(TEXTS[0])[:64]
    assert got.shape == (64,)
    assert abs(np.linalg.norm(got) - 1) < 1e-5
    assert cosine(got, full)[0] > 0.9999


def test_tokenize_matches_the_tokenizer(real_app, reference):
    body = post(real_app, "/tokenize", {"inputs": "Hello, wörld"})
    assert [p["id"] for p in body[0]] == reference.tokenizer("Hello, wörld")["input_ids"]
    assert [p["text"] for p in body[0][1:-1]] == ["Hello", ",", "wörld"]
    assert body[0][3]["start"] == 7 and body[0][3]["stop"] == 12


LONG = "Tokenizers cut 😀 中文 e\u0301t\u00e9 [MASK]   long   " * 400 + "!" * 5000


def test_long_inputs_are_cut_exactly_as_the_tokenizer_truncates(real_app, reference):
    """The engine tokenizes only a window of LONG; the answer is the tokenizer's own."""
    tok = reference.tokenizer
    body = post(real_app, "/tokenize", {"inputs": LONG})
    want = tok(LONG, truncation=True, max_length=256, return_offsets_mapping=True)
    assert [p["id"] for p in body[0]] == want["input_ids"]
    assert [(p["start"], p["stop"]) for p in body[0][1:-1]] == want["offset_mapping"][1:-1]
    for side in ("right", "left"):
        tok.truncation_side = side
        try:
            ids = tok(LONG, truncation=True, max_length=256)["input_ids"]
        finally:
            tok.truncation_side = "right"
        engine = real_app.extensions["embedsvc"].ready()
        assert engine.tokens([LONG], direction=side) == [ids]


def test_info_describes_the_model(real_app):
    info = real_app.test_client().get("/info").get_json()
    assert (info["dimension"], info["max_input_length"], info["device"], info["dtype"]) == (
        384, 256, "cpu", "float32")


def test_tei_token_ids_on_embed_with_and_without_special_tokens(real_app, reference):
    pieces = post(real_app, "/tokenize", {"inputs": TEXTS})
    wrapped = [[p["id"] for p in row] for row in pieces]  # [CLS] ... [SEP], as TEI gives them
    bare = [reference.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    want = reference.encode(TEXTS)
    for ids in (wrapped, bare):
        assert (cosine(np.array(post(real_app, "/embed", {"inputs": ids})), want) > 0.9999).all()


def test_embed_all_token_vectors_mean_to_the_pooled_vector(real_app, reference):
    body = post(real_app, "/embed_all", {"inputs": TEXTS})
    for rows, text in zip(body, TEXTS, strict=True):
        rows = np.array(rows)
        assert rows.shape == (len(reference.tokenizer(text)["input_ids"]), 384)
        # all-MiniLM-L6-v2 pools by the mean of its token vectors, special tokens included
        assert cosine(rows.mean(axis=0), reference.encode(text))[0] > 0.9999


def test_decode_matches_the_tokenizer(real_app, reference):
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS]
    assert post(real_app, "/decode", {"ids": ids}) == [
        reference.tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    kept = post(real_app, "/decode", {"ids": ids[0], "skip_special_tokens": False})
    assert kept == [reference.tokenizer.decode(ids[0])]
    assert kept[0].startswith("[CLS]") and kept[0].endswith("[SEP]")


def test_info_model_type_names_the_pooling(real_app):
    info = real_app.test_client().get("/info").get_json()
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["model_dtype"] == "float32" and info["max_input_length"] == 256
