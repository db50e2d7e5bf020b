"""Every kind and route through the engine process answers what one process answers (issue
38): the bundled embedding model behind two fronts, and the tiny reranker, classifier and
sparse models behind one front with ENGINE=process, against the run's one-process servers of
the same models, request by request."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import numpy as np
import pytest

from .. import loopback
from .conftest import SERVE, kind_server
from .servers import Server, running
from .test_kinds import DOCS, PAIRS, QUERY, TEXTS

WORDS = ["the engine process", "answers what one process answers", "Terrible. " * 80, "ok"]
REQUESTS = {
    "embedding": [
        ("/embed", {"inputs": WORDS}),
        ("/embed", {"inputs": WORDS, "dimensions": 64, "normalize": False,
                    "truncation_direction": "left"}),
        ("/", {"inputs": WORDS[0]}),
        ("/v1/embeddings", {"input": WORDS, "encoding_format": "base64"}),
        ("/v1/embeddings", {"input": [[1820, 4817, 1920]], "dimensions": 128}),
        ("/v2/embed", {"texts": WORDS, "input_type": "search_query",
                       "embedding_types": ["float", "int8", "uint8", "binary", "ubinary"]}),
        ("/v1/embed", {"texts": WORDS}),
        ("/api/embed", {"input": WORDS}),
        ("/api/embeddings", {"prompt": WORDS[0]}),
        ("/similarity", {"inputs": {"source_sentence": WORDS[0], "sentences": WORDS[1:]}}),
        ("/embed_all", {"inputs": WORDS[:2]}),
        ("/tokenize", {"inputs": WORDS}),
        ("/decode", {"ids": [[101, 1996, 3194, 2832, 102]]}),
    ],
    "reranker": [
        ("/rerank", {"query": QUERY, "texts": DOCS}),
        ("/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True}),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2}),
        ("/v2/rerank", {"query": QUERY, "documents": DOCS}),
        ("/predict", {"inputs": [list(p) for p in PAIRS]}),
    ],
    "classifier": [
        ("/predict", {"inputs": [[t] for t in TEXTS]}),
        ("/predict", {"inputs": [["a premise", "a hypothesis"]], "raw_scores": True}),
        ("/", {"inputs": TEXTS[0]}),
    ],
    "sparse": [
        ("/embed_sparse", {"inputs": TEXTS}),
        ("/", {"inputs": TEXTS[1]}),
    ],
}
_VARYING = {"id", "total_duration", "load_duration"}


@pytest.fixture(scope="module")
def pairs(shared, bundled, kind_dirs, tmp_path_factory) -> Iterator[dict]:
    """For each kind: (the engine-process server, the run's one-process server)."""
    logs = tmp_path_factory.mktemp("engine-kinds")
    commands = {"embedding": [*SERVE, "--workers", "2"]}
    for kind in kind_dirs:
        commands[kind] = [*SERVE, "--model", str(kind_dirs[kind]), "--engine", "process"]
    one = {"embedding": bundled, **{k: kind_server(shared, kind_dirs, k) for k in kind_dirs}}
    with shared.use("bundled", *kind_dirs), \
            running(commands["embedding"], logs / "embedding.log") as emb, \
            running(commands["reranker"], logs / "reranker.log") as rer, \
            running(commands["classifier"], logs / "classifier.log") as cls, \
            running(commands["sparse"], logs / "sparse.log") as spa:
        yield {"embedding": (emb, one["embedding"]), "reranker": (rer, one["reranker"]),
               "classifier": (cls, one["classifier"]), "sparse": (spa, one["sparse"])}


def same(got, want, where: str) -> None:
    """Equal answers: floats within what two batches' padding can change, int8/uint8 codes
    within one step, everything else exactly."""
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            if key not in _VARYING:
                same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        if want and all(isinstance(x, int | float) and not isinstance(x, bool) for x in want):
            atol = 1 if all(isinstance(x, int) for x in want) else 1e-5
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol, err_msg=where)
            return
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            same(g, w, f"{where}[{i}]")
    elif isinstance(want, str) and where.endswith(".embedding"):  # OpenAI's base64
        np.testing.assert_allclose(np.frombuffer(base64.b64decode(got), "<f4"),
                                   np.frombuffer(base64.b64decode(want), "<f4"), atol=1e-5)
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5), where
    else:
        assert got == want, where


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_every_route_answers_as_one_process_does(pairs, kind):
    engine_server, one_server = pairs[kind]
    for route, body in REQUESTS[kind]:
        got = loopback.post(engine_server.url + route, json=body, timeout=60)
        want = loopback.post(one_server.url + route, json=body, timeout=60)
        assert got.status_code == want.status_code == 200, (route, got.text[:300])
        same(got.json(), want.json(), f"{kind} {route}")


def test_the_engine_process_is_the_only_one_with_the_model(pairs):
    server: Server = pairs["embedding"][0]
    about = loopback.get(server.url + "/info", timeout=10).json()
    assert about["engine_pid"] not in about["front_pids"] and about["device"] == "cpu"
