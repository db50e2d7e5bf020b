"""Every model kind served by a real `embedsvc serve`: answers equal sentence-transformers'
under 32 concurrent clients, each route refuses the other kinds, real rerank clients work."""

import threading

import numpy as np
import pytest

from .. import loopback
from .conftest import kind_server
from .servers import running
from .test_kinds import DOCS, PAIRS, QUERY, TEXTS, TOL, identity, reference_sparse

CLIENTS = 32
BODIES = {
    "/embed": {"inputs": "hello"},
    "/v1/embeddings": {"input": "hello"},
    "/embeddings": {"input": "hello"},
    "/similarity": {"inputs": {"source_sentence": "a", "sentences": ["b"]}},
    "/rerank": {"query": "q", "texts": ["a"]},
    "/v1/rerank": {"query": "q", "documents": ["a"]},
    "/v2/rerank": {"query": "q", "documents": ["a"]},
    "/predict": {"inputs": "hello"},
    "/embed_sparse": {"inputs": "hello"},
}
SERVES = {
    "embedding": {"/embed", "/v1/embeddings", "/embeddings", "/similarity"},
    "reranker": {"/rerank", "/v1/rerank", "/v2/rerank", "/predict"},
    "classifier": {"/predict"},
    "sparse": {"/embed_sparse"},
}


@pytest.fixture
def servers(kind_dirs, shared, bundled):
    """The run's `embedsvc serve` of each kind (the embedding one serves the bundled model)."""
    started = {"embedding": bundled}
    for kind in kind_dirs:
        started[kind] = kind_server(shared, kind_dirs, kind)
    with shared.use("bundled", *kind_dirs):
        yield started


@pytest.fixture(scope="module")
def refs(kind_dirs):
    from sentence_transformers import CrossEncoder, SparseEncoder

    return {
        "reranker": CrossEncoder(str(kind_dirs["reranker"]), device="cpu"),
        "classifier": CrossEncoder(str(kind_dirs["classifier"]), device="cpu"),
        "sparse": SparseEncoder(str(kind_dirs["sparse"]), device="cpu"),
    }


def post(server, route, body, status=200):
    resp = loopback.post(server.url + route, json=body, timeout=60)
    assert resp.status_code == status, resp.text
    return resp.json()


def in_parallel(work, n=CLIENTS):
    """Run ``work(i)`` for i in range(n) on n threads at once; their results in order."""
    results, errors = [None] * n, []
    barrier = threading.Barrier(n)

    def run(i):
        try:
            barrier.wait(30)
            results[i] = work(i)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    return results


def picks(i, pool, k=5):
    rng = np.random.default_rng(i)
    return [int(x) for x in rng.choice(len(pool), size=int(rng.integers(1, k + 1)),
                                       replace=False)]


# -- /rerank ----------------------------------------------------------------------------------


def test_rerank_equals_cross_encoder_under_32_clients(servers, refs):
    ref = refs["reranker"]
    docs = [d for _, d in PAIRS[:6]]
    activated = ref.predict([(QUERY, d) for d in docs])
    raw = ref.predict([(QUERY, d) for d in docs], activation_fn=identity())

    def client(i):
        chosen = picks(i, docs)
        body = {"query": QUERY, "texts": [docs[j] for j in chosen], "raw_scores": i % 2 == 1,
                "return_text": i % 3 == 0}
        return chosen, body, post(servers["reranker"], "/rerank", body)

    for chosen, body, ranks in in_parallel(client):
        want = (raw if body["raw_scores"] else activated)[chosen]
        assert sorted(r["index"] for r in ranks) == list(range(len(chosen)))
        assert [r["score"] for r in ranks] == sorted((r["score"] for r in ranks), reverse=True)
        for r in ranks:
            assert abs(r["score"] - want[r["index"]]) <= TOL
            assert r.get("text") == (body["texts"][r["index"]] if body["return_text"] else None)


def test_rerank_truncates_or_refuses_long_pairs(servers, refs):
    long_doc = DOCS[5]
    server = servers["reranker"]
    [rank] = post(server, "/rerank", {"query": QUERY, "texts": [long_doc]})
    assert abs(rank["score"] - refs["reranker"].predict([(QUERY, long_doc)])[0]) <= TOL
    err = post(server, "/rerank", {"query": QUERY, "texts": [long_doc], "truncate": False}, 400)
    assert err["error"]["code"] == "input_too_long" and "128" in err["error"]["message"]
    ref = refs["reranker"]
    ref.tokenizer.truncation_side = "left"
    try:
        want = ref.predict([(QUERY, long_doc)])[0]
    finally:
        ref.tokenizer.truncation_side = "right"
    [left] = post(server, "/rerank", {"query": QUERY, "texts": [long_doc],
                                      "truncation_direction": "Left"})
    assert abs(left["score"] - want) <= TOL and abs(left["score"] - rank["score"]) > TOL


def test_rerank_refuses_empty_texts(servers):
    err = post(servers["reranker"], "/rerank", {"query": QUERY, "texts": []}, 400)
    assert err["error"]["param"] == "texts"
    err = post(servers["reranker"], "/rerank", {"query": QUERY, "texts": ["a", ""]}, 400)
    assert err["error"]["code"] == "empty_input"
    for path, body in (("/rerank", {"query": "", "texts": ["a"]}),
                       ("/v1/rerank", {"query": "", "documents": ["a"]})):
        assert post(servers["reranker"], path, body, 400)["error"]["param"] == "query"
    err = post(servers["reranker"], "/v1/rerank", {"query": "q", "documents": []}, 400)
    assert err["error"]["param"] == "documents"


# -- /v1/rerank and the clients that call it --------------------------------------------------


def test_cohere_shape_on_every_rerank_path(servers, refs, kind_dirs):
    docs = [d for _, d in PAIRS[:4]]
    want = refs["reranker"].predict([(QUERY, d) for d in docs])
    best = np.argsort(-want)
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        body = post(servers["reranker"], path, {
            "query": QUERY, "documents": [docs[0], {"text": docs[1]}, *docs[2:]],
            "top_n": 2, "return_documents": True, "model": "rerank-english-v3.0"})
        assert [r["index"] for r in body["results"]] == best[:2].tolist()
        for r in body["results"]:
            assert abs(r["relevance_score"] - want[r["index"]]) <= TOL
            assert r["document"] == {"text": docs[r["index"]]}
        assert body["model"] == kind_dirs["reranker"].name
        assert body["usage"]["total_tokens"] > 0 and body["id"]


def test_cohere_client_reranks_against_embedsvc(servers, refs):
    import cohere

    docs = [d for _, d in PAIRS[:5]]
    want = refs["reranker"].predict([(QUERY, d) for d in docs])
    url = servers["reranker"].url
    v1 = cohere.Client(api_key="unused", base_url=url)
    got = v1.rerank(query=QUERY, documents=docs, top_n=3, model="rerank-v3.5",
                    return_documents=True)
    assert [r.index for r in got.results] == np.argsort(-want)[:3].tolist()
    assert all(abs(r.relevance_score - want[r.index]) <= TOL for r in got.results)
    assert got.results[0].document.text == docs[got.results[0].index]
    v2 = cohere.ClientV2(api_key="unused", base_url=url)
    got = v2.rerank(query=QUERY, documents=docs, model="rerank-v3.5")
    assert [r.index for r in got.results] == np.argsort(-want).tolist()


def test_langchain_cohere_rerank_against_embedsvc(servers, refs):
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    docs = [d for _, d in PAIRS[:5]]
    want = refs["reranker"].predict([(QUERY, d) for d in docs])
    reranker = CohereRerank(model="rerank-v3.5", cohere_api_key="unused",
                            base_url=servers["reranker"].url, top_n=2)
    out = reranker.compress_documents([Document(page_content=d) for d in docs], QUERY)
    assert [d.page_content for d in out] == [docs[i] for i in np.argsort(-want)[:2]]
    for d in out:
        assert abs(d.metadata["relevance_score"] - want[docs.index(d.page_content)]) <= TOL


# -- /predict ---------------------------------------------------------------------------------


def predictions(ref, item, raw):
    labels = ref.config.id2label
    if raw:
        scores = ref.predict(item, activation_fn=identity())
    else:
        scores = ref.predict(item, apply_softmax=True)
    scores = np.atleast_1d(scores)
    return {labels[j]: float(s) for j, s in enumerate(scores)}


def assert_predicted(got, want):
    assert [p["score"] for p in got] == sorted((p["score"] for p in got), reverse=True)
    assert {p["label"] for p in got} == set(want)
    for p in got:
        assert abs(p["score"] - want[p["label"]]) <= TOL


def test_predict_single_text_pair_and_batch(servers, refs):
    server, ref = servers["classifier"], refs["classifier"]
    got = post(server, "/predict", {"inputs": TEXTS[0]})
    assert_predicted(got, predictions(ref, TEXTS[0], raw=False))
    got = post(server, "/predict", {"inputs": list(PAIRS[0])})
    assert_predicted(got, predictions(ref, PAIRS[0], raw=False))
    got = post(server, "/predict", {"inputs": [TEXTS[1]]})
    assert_predicted(got, predictions(ref, TEXTS[1], raw=False))
    batch = [[TEXTS[0]], list(PAIRS[1]), [TEXTS[2]]]
    got = post(server, "/predict", {"inputs": batch, "raw_scores": True})
    assert len(got) == 3
    for row, item in zip(got, [TEXTS[0], PAIRS[1], TEXTS[2]], strict=True):
        assert_predicted(row, predictions(ref, item, raw=True))
    err = post(server, "/predict", {"inputs": [["a", "b", "c"]]}, 400)
    assert err["error"]["param"] == "inputs"


def test_predict_equals_cross_encoder_under_32_clients(servers, refs):
    server, ref = servers["classifier"], refs["classifier"]
    pool = [*TEXTS, *PAIRS]
    want = {raw: [predictions(ref, item, raw) for item in pool] for raw in (False, True)}

    def client(i):
        chosen = picks(i, pool)
        batch = [[pool[j]] if isinstance(pool[j], str) else list(pool[j]) for j in chosen]
        return chosen, i % 2 == 1, post(server, "/predict", {"inputs": batch,
                                                             "raw_scores": i % 2 == 1})

    for chosen, raw, rows in in_parallel(client):
        assert len(rows) == len(chosen)
        for j, row in zip(chosen, rows, strict=True):
            assert_predicted(row, want[raw][j])


def test_predict_on_a_reranker_scores_with_sigmoid(servers, refs):
    got = post(servers["reranker"], "/predict", {"inputs": list(PAIRS[0])})
    assert got == [{"score": pytest.approx(float(refs["reranker"].predict([PAIRS[0]])[0]),
                                           abs=TOL), "label": "score"}]


# -- /embed_sparse ----------------------------------------------------------------------------


def test_embed_sparse_equals_sparse_encoder_under_32_clients(servers, refs):
    from .test_kinds import assert_sparse_equal

    pool = [*TEXTS, *DOCS]
    want = reference_sparse(refs["sparse"], pool)

    def client(i):
        chosen = picks(i, pool)
        return chosen, post(servers["sparse"], "/embed_sparse",
                            {"inputs": [pool[j] for j in chosen]})

    for chosen, vectors in in_parallel(client):
        got = [(np.array([e["index"] for e in v]), np.array([e["value"] for e in v]))
               for v in vectors]
        assert all(np.all(np.diff(i) > 0) for i, _ in got)  # indices ascending
        assert_sparse_equal(got, [want[j] for j in chosen])
    [one] = post(servers["sparse"], "/embed_sparse", {"inputs": TEXTS[0]})
    assert len(one) == len(want[0][0])


# -- /similarity ------------------------------------------------------------------------------


def test_similarity_equals_sentence_transformers_cosine(servers, reference):
    from sentence_transformers import util

    sentences = [TEXTS[0], DOCS[0], DOCS[1]]
    want = util.cos_sim(reference.encode(QUERY), reference.encode(sentences))[0].numpy()

    def client(i):
        return post(servers["embedding"], "/similarity",
                    {"inputs": {"source_sentence": QUERY, "sentences": sentences}})

    # the route's own arithmetic, exactly: the cosines of the vectors this server gives
    rows = np.array(post(servers["embedding"], "/embed", {"inputs": [QUERY, *sentences]}))
    served = rows[1:] @ rows[0] / np.linalg.norm(rows[1:], axis=1) / np.linalg.norm(rows[0])
    for got in in_parallel(client, 8):
        np.testing.assert_allclose(got, served, atol=1e-6)
        # and PyTorch's: the record's weights are stored as float16 and computed in float32
        # (export.py's half_weights), so its vectors keep a cosine of 0.9999996 to PyTorch's
        # and a cosine between two of them moves by up to 5e-5 (bench/RESULTS.md, the
        # float16 record): 1e-4 bounds that, far under the gaps between these scores
        np.testing.assert_allclose(got, want, atol=1e-4)


# -- kinds: one per process -------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(SERVES))
def test_each_route_refuses_the_kinds_it_does_not_serve(servers, kind):
    for route, body in BODIES.items():
        resp = loopback.post(servers[kind].url + route, json=body, timeout=60)
        if route in SERVES[kind]:
            assert resp.status_code == 200, (kind, route, resp.text)
        else:
            assert 400 <= resp.status_code < 500, (kind, route, resp.status_code)
            error = resp.json()["error"]
            assert error["code"] == "wrong_model_kind", (kind, route, error)
            article = "an" if kind[0] in "aeiou" else "a"  # an embedding, a reranker
            assert f"serves {article} {kind} model" in error["message"], (kind, route, error)


@pytest.mark.parametrize(("kind", "body", "shape"), [
    ("embedding", {"inputs": "hello"}, "vectors"),
    ("reranker", {"query": "q", "texts": ["a", "b"]}, "ranks"),
    ("classifier", {"inputs": "hello"}, "predictions"),
    ("sparse", {"inputs": "hello"}, "sparse"),
])
def test_root_and_invocations_serve_the_kinds_main_route(servers, kind, body, shape):
    for path in ("/", "/invocations"):
        got = post(servers[kind], path, body)
        if shape == "vectors":
            assert len(got) == 1 and len(got[0]) == 384
        elif shape == "ranks":
            assert sorted(r["index"] for r in got) == [0, 1]
        elif shape == "predictions":
            assert {p["label"] for p in got} == {"negative", "neutral", "positive"}
        else:
            assert len(got) == 1 and {"index", "value"} <= set(got[0][0])


def test_info_and_startup_line_name_the_kind(servers):
    for kind, server in servers.items():
        info = loopback.get(server.url + "/info", timeout=10).json()
        assert info["kind"] == kind
        assert f"kind={kind}" in server.output()
        # every kind serves on ONNX Runtime without PyTorch, its whole pipeline in the graph
        out = server.output()
        assert "on the CPU without PyTorch" in out and f"{kind} pipeline from" in out, out
    info = loopback.get(servers["classifier"].url + "/info", timeout=10).json()
    assert info["labels"] == ["negative", "neutral", "positive"]
    assert "classifier" in info["model_type"]


def test_metrics_count_the_new_routes(servers):
    post(servers["reranker"], "/rerank", {"query": "q", "texts": ["a"]})
    text = loopback.get(servers["reranker"].url + "/metrics", timeout=10).text
    assert 'embedsvc_requests_total{route="/rerank",status="200"}' in text
    assert 'kind="reranker"' in text


def test_openapi_describes_every_new_route(servers):
    doc = loopback.get(servers["reranker"].url + "/openapi.json", timeout=10).json()
    for route in ("/rerank", "/v1/rerank", "/v2/rerank", "/predict", "/embed_sparse",
                  "/similarity", "/", "/invocations"):
        assert "post" in doc["paths"][route], route
    schemas = doc["components"]["schemas"]
    assert {"RerankRequest", "CohereRerankRequest", "PredictRequest", "EmbedSparseRequest",
            "SimilarityRequest"} <= set(schemas)


def test_kind_setting_overrides_detection_in_a_server(kind_dirs, tmp_path, refs):
    cmd = ["embedsvc", "serve", "--model", str(kind_dirs["reranker"]), "--port", "0"]
    with running(cmd, tmp_path / "serve.log", env={"EMBEDSVC_KIND": "classifier"}) as server:
        assert loopback.get(server.url + "/info", timeout=10).json()["kind"] == "classifier"
        err = post(server, "/rerank", BODIES["/rerank"], 400)["error"]
        assert err["code"] == "wrong_model_kind" and "classifier" in err["message"]
        got = post(server, "/predict", {"inputs": list(PAIRS[0])})
        assert got[0]["score"] == pytest.approx(float(refs["reranker"].predict([PAIRS[0]])[0]),
                                                abs=TOL)
        assert "kind=classifier" in server.output()


def test_gunicorn_preload_serves_a_reranker(kind_dirs, tmp_path, refs):
    from .test_launchers import GUNICORN

    env = {"EMBEDSVC_MODEL": str(kind_dirs["reranker"])}
    cmd = [*GUNICORN, "-w", "2", "--threads", "4", "--preload", "embedsvc:app"]
    with running(cmd, tmp_path / "gunicorn.log", env=env, cwd=str(tmp_path)) as server:
        # a reranker, too, serves from its export record: the master holds no model
        assert "preloads nothing" in server.output() or (
            "preloads the weights on the CPU" in server.output())  # its first start: no record
        ranks = post(server, "/rerank", {"query": QUERY, "texts": DOCS[:3]})
        want = refs["reranker"].predict([(QUERY, d) for d in DOCS[:3]])
        for r in ranks:
            assert abs(r["score"] - want[r["index"]]) <= TOL
