"""The clients users already run, unchanged and with their defaults, against live servers.

Each vector a client gets is checked against the server's own ``/embed`` for the same text
(cosine > 0.9999), under ``embedsvc serve`` and under ``waitress-serve``. The TEI clients
run in a subprocess (tests/clients/tei_clients.py): huggingface_hub refuses every request
while HF_HUB_OFFLINE is set, as it is in this process, and the huggingface_hub 1.x clients
live in their own environment (.venv-hub1, built by ``make setup``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest

from .conftest import cosine
from .servers import Server

REPO = Path(__file__).parents[2]
HUB1_PYTHON = REPO / ".venv-hub1" / "bin" / "python"
CLIENT_SCRIPT = REPO / "tests" / "clients" / "tei_clients.py"
TEXTS = [
    "A dog runs in the park.",
    "Stock markets fell sharply today.",
    "Ein Satz auf Deutsch, mit Umlauten: äöü.",
    "short",
]
LENGTHS = (1, 2, 3, 10, 50, 120, 255, 400, 600)  # words


def embed(server: Server, texts: list, **options) -> np.ndarray:
    with server.client() as c:
        resp = c.post("/embed", json={"inputs": texts, **options})
    assert resp.status_code == 200, resp.text
    return np.array(resp.json(), dtype=np.float64)


def assert_same(got, server: Server, texts: list[str], **options) -> None:
    """``got`` are the server's own /embed vectors for ``texts`` (cosine > 0.9999)."""
    got = np.array(got, dtype=np.float64)
    want = embed(server, texts, **options)
    assert got.shape == want.shape, (got.shape, want.shape)
    similarity = cosine(got, want)
    assert (similarity > 0.9999).all(), similarity


# -- OpenAI-shaped clients --------------------------------------------------------------------


def test_openai_client_base64_float_and_dimensions(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    default = client.embeddings.create(model="text-embedding-3-small", input=TEXTS)  # base64
    assert_same([d.embedding for d in default.data], live, TEXTS)
    floats = client.embeddings.create(model="text-embedding-3-small", input=TEXTS,
                                      encoding_format="float")
    assert_same([d.embedding for d in floats.data], live, TEXTS)
    short = client.embeddings.create(model="text-embedding-3-small", input=TEXTS, dimensions=64)
    assert {len(d.embedding) for d in short.data} == {64}
    assert_same([d.embedding for d in short.data], live, TEXTS, dimensions=64)
    assert default.model == "all-MiniLM-L6-v2" and default.usage.prompt_tokens > len(TEXTS)


def test_async_openai_client(live):
    async def run():
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        results = await asyncio.gather(
            client.embeddings.create(model="text-embedding-3-large", input=TEXTS),
            client.embeddings.create(model="x", input=TEXTS[0], encoding_format="float"),
            client.embeddings.create(model="x", input=TEXTS, dimensions=32),
        )
        await client.close()
        return results

    default, floats, short = asyncio.run(run())
    assert_same([d.embedding for d in default.data], live, TEXTS)
    assert_same([floats.data[0].embedding], live, TEXTS[:1])
    assert_same([d.embedding for d in short.data], live, TEXTS, dimensions=32)


@pytest.fixture(scope="module")
def word_texts(reference, tiktoken_cache):
    """Texts of 1 to 600 words; the ``inside`` ones have only cl100k ids below the served
    model's vocabulary size, so a server reading them as its own ids could not tell."""
    import tiktoken

    enc = tiktoken.get_encoding("cl100k_base")
    vocab_size = reference.tokenizer.vocab_size
    words = sorted(w for w in reference.tokenizer.get_vocab() if w.isalpha() and len(w) > 2)
    inside = [w for w in words
              if max(enc.encode_ordinary(w) + enc.encode_ordinary(" " + w)) < vocab_size]
    rng = np.random.default_rng(11)
    mixed = [" ".join(rng.choice(words, n)) for n in LENGTHS]
    low = [" ".join(rng.choice(inside, n)) for n in LENGTHS]
    assert all(max(enc.encode_ordinary(t)) < vocab_size for t in low)
    assert any(max(enc.encode_ordinary(t)) >= vocab_size for t in mixed)
    return {"mixed": mixed, "inside": low}


def test_langchain_openai_defaults_send_tiktoken_ids_and_get_the_right_vectors(live, word_texts):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    assert embeddings.check_embedding_ctx_length and embeddings.tiktoken_enabled  # the defaults
    for texts in word_texts.values():
        assert_same(embeddings.embed_documents(texts), live, texts)
    assert_same([embeddings.embed_query(TEXTS[2])], live, TEXTS[2:3])
    texts = word_texts["inside"]
    assert_same(asyncio.run(embeddings.aembed_documents(texts)), live, texts)
    # What a server that took these ids as its own would have answered: far from the text's.
    import tiktoken

    ids = tiktoken.get_encoding("cl100k_base").encode_ordinary(texts[4])  # 50 words
    assert cosine(embed(live, [ids]), embed(live, texts[4:5]))[0] < 0.9


def test_langchain_openai_sending_text(live, word_texts):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                                  check_embedding_ctx_length=False)
    texts = word_texts["mixed"] + TEXTS
    assert_same(embeddings.embed_documents(texts), live, texts)


def test_llama_index_openai_embedding(live):
    from llama_index.embeddings.openai import OpenAIEmbedding

    model = OpenAIEmbedding(api_base=live.url + "/v1", api_key="unused", max_retries=0)
    assert_same(model.get_text_embedding_batch(TEXTS), live, TEXTS)
    assert_same([model.get_query_embedding(TEXTS[1])], live, TEXTS[1:2])
    assert_same(asyncio.run(model.aget_text_embedding_batch(TEXTS)), live, TEXTS)


def test_haystack_openai_embedders(live):
    from haystack import Document
    from haystack.components.embedders import OpenAIDocumentEmbedder, OpenAITextEmbedder
    from haystack.utils import Secret

    key = Secret.from_token("unused")
    text = OpenAITextEmbedder(api_key=key, api_base_url=live.url + "/v1")
    assert_same([text.run(text=t)["embedding"] for t in TEXTS], live, TEXTS)
    documents = OpenAIDocumentEmbedder(api_key=key, api_base_url=live.url + "/v1")
    out = documents.run(documents=[Document(content=t) for t in TEXTS])["documents"]
    assert_same([d.embedding for d in out], live, TEXTS)


# -- TEI clients, in a subprocess --------------------------------------------------------------


def run_tei_clients(python: Path, server: Server, clients: list[str]) -> dict:
    assert python.exists(), f"{python} is missing: run `make setup`"
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    env.update(HF_HUB_DISABLE_TELEMETRY="1", HAYSTACK_TELEMETRY_ENABLED="False")
    done = subprocess.run([str(python), str(CLIENT_SCRIPT), server.url, *clients],
                          input=json.dumps(TEXTS), capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def check_hub_client(out: dict, server: Server) -> None:
    assert_same(out["vectors"], server, TEXTS)
    assert_same(out["endpoint_vectors"], server, TEXTS)
    assert out["healthy"] is True
    info = out["info"]
    assert info["model_id"] == "all-MiniLM-L6-v2"
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 256 and info["model_dtype"] == "float32"


# The TEI clients, one launcher each: what they send is the same to both (the OpenAI
# clients above run against each), and each run of them costs a few CPU-seconds of imports.
@pytest.mark.parametrize("live", ["waitress-serve"], indirect=True)
def test_huggingface_hub_2_and_haystack_tei_clients(live):
    out = run_tei_clients(Path(sys.executable), live,
                          ["hub", "hub-async", "haystack-text", "haystack-document"])
    assert out["huggingface_hub"].startswith("2.")
    check_hub_client(out["hub"], live)
    check_hub_client(out["hub-async"], live)
    # haystack's Hugging Face API embedders ask for normalize=False by default
    assert_same(out["haystack-text"]["vectors"], live, TEXTS, normalize=False)
    assert_same(out["haystack-document"]["vectors"], live, TEXTS, normalize=False)


@pytest.mark.parametrize("live", ["embedsvc-serve"], indirect=True)
def test_huggingface_hub_1_and_langchain_huggingface(live):
    out = run_tei_clients(HUB1_PYTHON, live, ["hub", "hub-async", "langchain-huggingface"])
    assert out["huggingface_hub"].startswith("1.")
    check_hub_client(out["hub"], live)
    check_hub_client(out["hub-async"], live)
    lc = out["langchain-huggingface"]
    assert_same(lc["vectors"], live, TEXTS)
    assert_same(lc["async_vectors"], live, TEXTS)
    assert_same([lc["query"]], live, TEXTS[:1])
