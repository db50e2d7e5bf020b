"""`embedsvc serve` as a real process: the openai client, concurrency and batching."""

import threading

import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

from .conftest import cosine

TEXTS = ["A dog runs in the park.", "Stock markets fell sharply today.", "I love pizza."]


def test_openai_client_default_encoding_is_base64_and_works(served, reference):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    result = client.embeddings.create(model="text-embedding-3-small", input=TEXTS)
    got = np.array([d.embedding for d in result.data])
    assert got.shape == (3, 384)
    assert (cosine(got, reference.encode(TEXTS)) > 0.9999).all()
    tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert result.usage.prompt_tokens == tokens
    assert result.model == "all-MiniLM-L6-v2"


def test_openai_client_float_encoding(served, reference):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    result = client.embeddings.create(model="x", input=TEXTS[0], encoding_format="float")
    assert cosine(result.data[0].embedding, reference.encode(TEXTS[0]))[0] > 0.9999
    short = client.embeddings.create(model="x", input=TEXTS[0], dimensions=64)
    assert len(short.data[0].embedding) == 64


def batch_histogram(client) -> tuple[float, float]:
    text = client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "embedsvc_batch_size":
            values = {s.name: s.value for s in family.samples}
            return values["embedsvc_batch_size_sum"], values["embedsvc_batch_size_count"]
    raise AssertionError("no embedsvc_batch_size in /metrics")


def test_256_concurrent_requests_each_get_their_own_vector(served_alone, reference):
    # Long inputs (about 80 tokens), so that computing one takes longer than a client takes to
    # send its next: requests pile up while the model runs, however busy the machine is, and
    # the batcher must coalesce them.
    words = ["the", "service", "takes", "every", "queued", "input", "into", "one", "batch",
             "while", "the", "model", "runs"]
    texts = [f"request number {i} talks about topic {i * 7 % 13}: "
             + " ".join(words[(i + k) % len(words)] for k in range(60)) for i in range(256)]
    expected = reference.encode(texts)
    results: dict[int, list[float]] = {}
    errors: list[str] = []
    with served_alone.client() as c:
        before = batch_histogram(c)

    def worker(start: int) -> None:
        with served_alone.client() as c:
            for i in range(start, 256, 64):
                resp = c.post("/v1/embeddings", json={"input": texts[i]})
                if resp.status_code != 200:
                    errors.append(resp.text)
                    continue
                results[i] = resp.json()["data"][0]["embedding"]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    got = np.array([results[i] for i in range(256)])
    assert (cosine(got, expected) > 0.9999).all()
    with served_alone.client() as c:
        after = batch_histogram(c)
    inputs, batches = after[0] - before[0], after[1] - before[1]
    assert inputs == 256
    assert inputs / batches > 2, f"mean batch size {inputs / batches:.2f}"
