"""The Ollama, Cohere embed and Voyage clients, unchanged, against live servers on the bundled
model: each float vector checked against the server's own ``/embed`` (cosine > 0.9999), each
int8 code against the code of that ``/embed`` vector on the scale this test calibrates itself
through ``/embed`` from the shipped calibration set, each bit against the float's sign.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest

from embedsvc.model import quantize

from .servers import FAKE_EMBEDSVC, Server, running
from .test_clients import REPO, TEXTS, assert_same, embed

ALL_TYPES = ["float", "int8", "uint8", "binary", "ubinary", "base64"]


@pytest.fixture(scope="module")
def scale(live):
    """The int8 scale, calibrated here through /embed as the server should calibrate them."""
    texts = quantize.calibration_texts()
    rows = np.concatenate([embed(live, texts[i:i + 64], normalize=False)
                           for i in range(0, len(texts), 64)])
    return quantize.Calibration(rows.astype(np.float32)).scale


def assert_codes(codes, server: Server, texts: list[str], dtype: str, scale,
                 dimensions: int | None = None) -> None:
    """``codes`` are the int8/uint8 codes of the server's /embed vectors of ``texts``."""
    want_rows = embed(server, texts, dimensions=dimensions).astype(np.float32)
    want = quantize.quantize(want_rows, dtype, scale(dimensions=dimensions))
    got = np.array(codes)
    assert got.shape == want.shape
    off = np.abs(got.astype(int) - want.astype(int))
    # /embed and the route may batch a text differently; a rounding edge may move one step
    assert off.max() <= 1 and (off == 0).mean() > 0.99, off.max()
    back = quantize.dequantize(got.astype(want.dtype), dtype, scale(dimensions=dimensions))
    # faithful: the worst seen is 'short', cut to 128 dimensions, at 0.988 (typical: 0.9999)
    assert (np.sum(back * want_rows, 1) / np.linalg.norm(back, axis=1) > 0.98).all()


def assert_bits(bits, floats, dtype: str) -> None:
    """``bits`` are the packed signs (> 0) of ``floats`` (binary: minus 128)."""
    want = np.packbits(np.array(floats) > 0, axis=1).astype(int)
    assert np.array_equal(np.array(bits), want if dtype == "ubinary" else want - 128)


# -- Ollama ------------------------------------------------------------------------------------


def test_ollama_client_embed_embeddings_and_list(live):
    import ollama

    client = ollama.Client(host=live.url)
    listed = client.list().models
    assert [m.model for m in listed] == ["all-MiniLM-L6-v2:latest"] and listed[0].size > 0
    out = client.embed(model="nomic-embed-text", input=TEXTS)
    assert_same(out.embeddings, live, TEXTS)
    assert out.prompt_eval_count > len(TEXTS) and out.model == "all-MiniLM-L6-v2:latest"
    assert_same(client.embed(model="x", input=TEXTS[0], dimensions=64).embeddings, live,
                TEXTS[:1], dimensions=64)
    legacy = [client.embeddings(model="all-minilm", prompt=t).embedding for t in TEXTS]
    assert_same(legacy, live, TEXTS, normalize=False)
    running = client.ps().models  # ollama ps: the model, loaded for as long as the service runs
    assert [(m.model, m.size, m.size_vram) for m in running] == [
        ("all-MiniLM-L6-v2:latest", listed[0].size, 0)]
    assert running[0].expires_at.year == 9999 and running[0].context_length == 256
    shown = client.show("all-MiniLM-L6-v2:latest")
    assert shown.capabilities == ["embedding"] and shown.details.parameter_size == "22.7M"
    with pytest.raises(ollama.ResponseError, match="embeds only") as refused:
        client.generate(model="llama3", prompt="hi")
    assert refused.value.status_code == 501


def test_langchain_ollama_embeddings_with_model_check(live):
    import ollama
    from langchain_ollama import OllamaEmbeddings

    name = ollama.Client(host=live.url).list().models[0].model
    embeddings = OllamaEmbeddings(model=name, base_url=live.url, validate_model_on_init=True)
    assert_same(embeddings.embed_documents(TEXTS), live, TEXTS)
    assert_same([embeddings.embed_query(TEXTS[1])], live, TEXTS[1:2])
    with pytest.raises(ValueError, match="not found"):
        OllamaEmbeddings(model="llama3", base_url=live.url, validate_model_on_init=True)


# -- Cohere ------------------------------------------------------------------------------------


def check_by_type(by_type, server: Server, scale, dimensions: int | None = None) -> None:
    floats = by_type.float_
    assert_same(floats, server, TEXTS, dimensions=dimensions)
    b64 = [np.frombuffer(base64.b64decode(s), "<f4") for s in by_type.base64]
    assert_same(b64, server, TEXTS, dimensions=dimensions)
    assert_codes(by_type.int8, server, TEXTS, "int8", scale, dimensions)
    assert_codes(by_type.uint8, server, TEXTS, "uint8", scale, dimensions)
    assert_bits(by_type.binary, floats, "binary")
    assert_bits(by_type.ubinary, floats, "ubinary")


def test_cohere_client_v2_every_embedding_type_in_one_request(live, scale):
    import cohere

    client = cohere.ClientV2(api_key="unused", base_url=live.url)
    out = client.embed(texts=TEXTS, model="embed-v4.0", input_type="search_document",
                       embedding_types=ALL_TYPES)
    check_by_type(out.embeddings, live, scale)
    assert out.meta.billed_units.input_tokens > len(TEXTS)
    cut = client.embed(texts=TEXTS, model="embed-v4.0", input_type="search_query",
                       embedding_types=ALL_TYPES, output_dimension=128)
    check_by_type(cut.embeddings, live, scale, dimensions=128)


def test_cohere_client_v1_floats_and_every_type(live, scale):
    import cohere

    client = cohere.Client(api_key="unused", base_url=live.url)
    floats = client.embed(texts=TEXTS, model="embed-english-v3.0", input_type="search_query")
    assert floats.response_type == "embeddings_floats"
    assert_same(floats.embeddings, live, TEXTS)
    typed = client.embed(texts=TEXTS, model="embed-english-v3.0", input_type="classification",
                         embedding_types=ALL_TYPES)
    assert typed.response_type == "embeddings_by_type"
    check_by_type(typed.embeddings, live, scale)


def test_langchain_cohere_embeddings(live):
    from langchain_cohere import CohereEmbeddings

    embeddings = CohereEmbeddings(cohere_api_key="unused", base_url=live.url,
                                  model="embed-english-v3.0")
    assert_same(embeddings.embed_documents(TEXTS), live, TEXTS)
    assert_same([embeddings.embed_query(TEXTS[0])], live, TEXTS[:1])


# -- Voyage ------------------------------------------------------------------------------------


def test_voyage_client_float_and_int8(live, scale):
    import voyageai

    client = voyageai.Client(api_key="unused", base_url=live.url + "/v1", max_retries=0)
    floats = client.embed(TEXTS, model="voyage-3.5", input_type="document")
    assert_same(floats.embeddings, live, TEXTS)
    codes = client.embed(TEXTS, model="voyage-3.5", input_type="query", output_dtype="int8")
    assert all(len(row) == 384 for row in codes.embeddings)  # codes, not float32 bytes
    assert_codes(codes.embeddings, live, TEXTS, "int8", scale)
    short = client.embed(TEXTS, model="voyage-3.5", output_dtype="uint8", output_dimension=256)
    assert_codes(short.embeddings, live, TEXTS, "uint8", scale, dimensions=256)
    bits = client.embed(TEXTS, model="voyage-3.5", output_dtype="ubinary")
    assert_bits(bits.embeddings, embed(live, TEXTS), "ubinary")


# -- stability ---------------------------------------------------------------------------------


def test_int8_codes_do_not_depend_on_batch_mates(live):
    others = quantize.calibration_texts()[:40]
    fresh = ["An unusual sentence about violet giraffes tap-dancing on Neptune.", *TEXTS]
    with live.client() as c:
        for text in fresh:
            alone = c.post("/v2/embed", json={"texts": [text], "embedding_types": ["int8"]})
            crowd = c.post("/v2/embed", json={"texts": [*others[:20], text, *others[20:]],
                                              "embedding_types": ["int8"]})
            assert alone.status_code == crowd.status_code == 200, alone.text
            assert alone.json()["embeddings"]["int8"][0] == crowd.json()["embeddings"]["int8"][20]


def test_a_cache_it_cannot_write_costs_one_calibration_and_every_request_answers(tmp_path):
    """``.locks`` a file in CACHE_DIR (a full disk fails the same way): the first int8 request
    calibrates, with one warning; later ones are answered from memory, never a 500."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / ".locks").write_text("a file where the lock directory should be")
    cmd = [*FAKE_EMBEDSVC, "serve", "--port", "0", "--cache-dir", str(cache)]
    with running(cmd, tmp_path / "serve.log", cwd=str(REPO)) as server, server.client() as c:
        for dtypes in (["int8"], ["uint8"], ["int8", "uint8"]):
            r = c.post("/v2/embed", json={"texts": TEXTS, "embedding_types": dtypes})
            assert r.status_code == 200, r.text
        log = server.output()
    assert log.count("calibrating int8") == 1, log
    assert log.count("cannot write the calibration") == 1, log
