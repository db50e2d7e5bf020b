"""Several models behind one port (issue 49): the bundled embedder, a tiny reranker and a tiny
SPLADE encoder in one service, in one process, under ``--workers 2`` and under ``gunicorn -w
2``. Every route of every kind answers what the run's one-model service of that model
answers; the request's ``model`` chooses, TEI's routes take their kind's first; each model
has one engine process of its own (the only process that maps ONNX Runtime for it), and one
model's engine killed under load leaves the others answering."""

from __future__ import annotations

import os
import re
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .. import loopback
from .conftest import SERVE, kind_server
from .servers import BIN, FAKE_EMBEDSVC, Server, running
from .test_engine_kinds import REQUESTS, same

EMBEDDER = "all-MiniLM-L6-v2"  # the names the one-model services answer with
KINDS = ("embedding", "reranker", "sparse")
# TEI's main route ("/") is the first model's: the sparse model's is left out
ROUTES = {kind: [(route, body) for route, body in REQUESTS[kind] if route != "/"]
          for kind in KINDS}


def models_setting(kind_dirs: dict[str, Path]) -> str:
    return (f"{EMBEDDER}=,reranker={kind_dirs['reranker']},sparse={kind_dirs['sparse']}")


LAUNCHES = {
    "one process": lambda models: [*SERVE, "--models", models],
    "workers 2": lambda models: [*SERVE, "--models", models, "--workers", "2"],
    "gunicorn -w 2": lambda models: [str(BIN / "gunicorn"), "-w", "2", "--threads", "8", "-b",
                                     "127.0.0.1:0", "embedsvc:app"],
}


@pytest.fixture(scope="module", params=list(LAUNCHES))
def several(request, shared, bundled, kind_dirs, tmp_path_factory
            ) -> Iterator[tuple[str, Server, dict[str, Server]]]:
    """(the launch, the three-model server, the run's one-model servers by kind)."""
    launch = request.param
    models = models_setting(kind_dirs)
    one = {"embedding": bundled, "reranker": kind_server(shared, kind_dirs, "reranker"),
           "sparse": kind_server(shared, kind_dirs, "sparse")}
    log = tmp_path_factory.mktemp("models") / "serve.log"
    with shared.use("bundled", "reranker", "sparse"), \
            running(LAUNCHES[launch](models), log,
                    env={"EMBEDSVC_MODELS": models}) as server:
        yield launch, server, one


@pytest.mark.parametrize("kind", KINDS)
def test_every_route_answers_as_the_one_model_service(several, kind):
    _, server, one = several
    for route, body in ROUTES[kind]:
        got = loopback.post(server.url + route, json=body, timeout=60)
        want = loopback.post(one[kind].url + route, json=body, timeout=60)
        assert got.status_code == want.status_code == 200, (route, got.text)
        same(got.json(), want.json(), f"{kind} {route}")


def test_the_request_chooses_the_model_by_name(several):
    _, server, one = several
    body = {"input": ["a text"], "model": "sparse"}
    resp = loopback.post(server.url + "/v1/embeddings", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "wrong_model_kind"
    assert "'sparse' is a sparse model" in resp.json()["error"]["message"]
    resp = loopback.post(server.url + "/v1/embeddings",
                         json={"input": ["a text"], "model": "gpt-4"}, timeout=30)
    assert resp.status_code == 404, resp.text
    error = resp.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert f"{EMBEDDER}, reranker, sparse" in error["message"]
    resp = loopback.post(server.url + "/v2/rerank", json={
        "model": "reranker", "query": "q", "documents": ["a", "b"]}, timeout=30)
    want = loopback.post(one["reranker"].url + "/v2/rerank", json={
        "query": "q", "documents": ["a", "b"]}, timeout=30)
    same(resp.json(), want.json(), "/v2/rerank")
    resp = loopback.post(server.url + "/v2/rerank", json={
        "model": EMBEDDER, "query": "q", "documents": ["a"]}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "wrong_model_kind"


def test_the_models_routes_list_every_model(several):
    launch, server, _ = several
    listed = loopback.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["kind"]) for m in listed] == [
        (EMBEDDER, "embedding"), ("reranker", "reranker"), ("sparse", "sparse")]
    assert loopback.get(server.url + "/v1/models/reranker", timeout=30).json()["id"] == \
        "reranker"
    assert loopback.get(server.url + "/v1/models/nope", timeout=30).status_code == 404
    tags = loopback.get(server.url + "/api/tags", timeout=30).json()["models"]
    assert [m["name"] for m in tags] == [f"{EMBEDDER}:latest", "reranker:latest",
                                         "sparse:latest"]
    running = loopback.get(server.url + "/api/ps", timeout=30).json()["models"]
    assert [m["name"] for m in running] == [m["name"] for m in tags]
    shown = loopback.post(server.url + "/api/show", json={"model": "sparse:latest"}, timeout=30)
    assert shown.json()["model_info"]["general.architecture"] == "sparse", shown.text
    health = loopback.get(server.url + "/health", timeout=30).json()
    assert health == {"status": "ok", "models": dict.fromkeys(
        [EMBEDDER, "reranker", "sparse"], "ready")}
    about = loopback.get(server.url + "/info", timeout=30).json()
    engines = [m["engine_pid"] for m in about["models"]]
    if launch == "one process":
        assert engines == [server.pid] * 3
        assert maps_runtime(server.pid)
    else:  # one engine process per model, the only processes that map ONNX Runtime
        assert len(set(engines)) == 3 and not set(engines) & set(about["front_pids"])
        assert all(maps_runtime(pid) for pid in engines)
        assert not any(maps_runtime(pid) for pid in about["front_pids"])
    assert "models ready: all-MiniLM-L6-v2 (embedding, cpu, " in server.output()
    ranked = loopback.post(server.url + "/v2/rerank", json={
        "model": "reranker", "query": "q", "documents": ["a"]}, timeout=30)
    assert ranked.status_code == 200
    refused = loopback.post(server.url + "/v2/rerank", json={
        "model": "reranker", "query": "q", "documents": []}, timeout=30)
    assert refused.status_code == 400
    counted = 'embedsvc_model_requests_total{model="reranker",route="/v2/rerank",status="200"}'
    # refusals are the service's, by reason: they were all labelled the first model's
    rejected = 'embedsvc_rejections_total{reason="invalid"}'
    # the series of every process: each engine's, and each of the 2 fronts'
    processes = 1 if launch == "one process" else len(about["models"]) + 2
    deadline = time.monotonic() + 5  # another HTTP process's counts arrive within a second
    while True:
        metrics = loopback.get(server.url + "/metrics", timeout=30).text
        every = counted in metrics and rejected in metrics and \
            len(samples(metrics, "process_resident_memory_bytes")) >= processes
        if every or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert counted in metrics and rejected in metrics
    assert "embedsvc_rejections_total{model=" not in metrics
    assert 'embedsvc_model_request_duration_seconds_count{model="reranker",route="/v2/rerank"}' \
        in metrics
    for name in (EMBEDDER, "reranker", "sparse"):
        assert f'embedsvc_batcher_alive{{model="{name}"}} 1.0' in metrics
    memory = dict(samples(metrics, "process_resident_memory_bytes"))
    if launch == "one process":  # one process, counted once, labelled with no model
        assert list(memory) == [frozenset()]
    else:  # each engine's with its model; each of the 2 fronts' once, with its pid alone
        engines = {frozenset({("model", m["name"]), ("pid", str(m["engine_pid"]))})
                   for m in about["models"]}
        fronts = set(memory) - engines
        assert engines <= set(memory) and len(fronts) == 2, memory
        assert all(dict(labels).keys() == {"pid"} for labels in fronts), fronts
    assert all(value > 0 for value in memory.values())


def samples(metrics: str, name: str) -> list[tuple[frozenset[tuple[str, str]], float]]:
    """The (labels, value) of a family's samples in a text exposition."""
    found = []
    for line in metrics.splitlines():
        if line.startswith(name) and line[len(name)] in "{ ":
            labels, _, value = line[len(name):].rpartition(" ")
            found.append((frozenset(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return found


def maps_runtime(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "onnxruntime" in f.read()


# The bound on the others' latency is asserted under --workers 2 only. bench/models_kill.py
# measures it for both launches (RESULTS 12-05 19:39 and 20:08): it holds in every kill under a
# load that leaves the 2 cores idle part of the time, and under a load that keeps them busy
# most kills put some request past twice the p99 of the 3 s before, gunicorn's more often
# (the replacement's start, 0.4 s of CPU, has no core to spare). So the test's load is the
# light one (one client a model, 20 ms between requests): with two clients a model back to
# back, beside another test file on the other core, the bound failed 1 run in 2, at this
# tree and at b54ebf3 alike.
@pytest.mark.alone  # the bound is claimed with cores to spare for the new engine's start
@pytest.mark.parametrize("several", ["workers 2", "gunicorn -w 2"], indirect=True)
def test_one_models_engine_killed_under_load_leaves_the_others_answering(several):
    launch, server, _ = several
    about = loopback.get(server.url + "/info", timeout=30).json()
    victim = next(m["engine_pid"] for m in about["models"] if m["name"] == "reranker")
    others = {EMBEDDER: ("/v1/embeddings", {"input": ["a light text"], "model": EMBEDDER}),
              "sparse": ("/embed_sparse", {"inputs": ["a light text"]})}
    results: dict[str, list[tuple[int, float, float]]] = {name: [] for name in others}
    stop = threading.Event()

    def load(name: str) -> None:
        while not stop.is_set():
            results[name].append((*timed(server, *others[name]), time.monotonic()))
            time.sleep(0.02)  # the light load under which the bound is claimed (RESULTS 20:08)

    threads = [threading.Thread(target=load, args=(n,)) for n in others]
    for t in threads:
        t.start()
    time.sleep(3.0)  # the same load before the kill: what "unloaded" by the failure means
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    statuses = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, _ = timed(server, "/rerank", {"query": "q", "texts": ["a"]})
        statuses.append(status)
        if status == 200 and 503 in statuses:
            break
        time.sleep(0.1)
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join()
    assert 503 in statuses and statuses[-1] == 200, statuses
    for name, seen in results.items():
        assert all(status == 200 for status, _, _ in seen), (name, seen)
        before = p99([s for _, s, at in seen if at < killed - 0.5])  # past the warm-up
        after = [s for _, s, at in seen if at >= killed]
        assert after
        if launch == "workers 2":
            assert max(after) < 2 * before, (name, before, max(after))


@pytest.mark.parametrize("several", ["one process", "workers 2"], indirect=True)
def test_a_flood_on_one_model_leaves_the_others_light_requests_in_time(several):
    """Each model has its own admission and batcher: a reranker flooded with large requests
    does not take the embedder's light ones past their deadline (REQUEST_TIMEOUT_S, 30 s)."""
    _, server, _ = several
    flood = {"query": "q", "texts": ["a document of some length " * 20] * 64}
    stop = threading.Event()
    refused: list[int] = []

    def flooding() -> None:
        while not stop.is_set():
            status, _ = timed(server, "/rerank", flood)
            if status != 200:
                refused.append(status)

    threads = [threading.Thread(target=flooding) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    light = [timed(server, "/embed", {"inputs": "a light text"}) for _ in range(20)]
    stop.set()
    for t in threads:
        t.join()
    assert all(status == 200 for status, _ in light), light
    assert all(status in (429, 503, 504) for status in refused), refused


def timed(server: Server, route: str, body: dict) -> tuple[int, float]:
    started = time.monotonic()
    resp = loopback.post(server.url + route, json=body, timeout=60)
    return resp.status_code, time.monotonic() - started


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


@pytest.mark.parametrize("several", ["workers 2"], indirect=True)
def test_the_clients_of_a_retrieval_pipeline_name_their_models(several):
    """The OpenAI and Cohere clients, as docs/deployment.md's recipe calls them."""
    cohere = pytest.importorskip("cohere")
    openai = pytest.importorskip("openai")
    _, server, one = several
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    got = client.embeddings.create(model=EMBEDDER, input=["a text"]).data[0].embedding
    want = loopback.post(one["embedding"].url + "/v1/embeddings", json={"input": ["a text"]},
                         timeout=30).json()["data"][0]["embedding"]
    same(got, want, "openai client")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input=["a text"])
    v2 = cohere.ClientV2(api_key="unused", base_url=server.url)
    ranked = v2.rerank(model="reranker", query="q", documents=["a", "b"])
    want = loopback.post(one["reranker"].url + "/v2/rerank",
                         json={"query": "q", "documents": ["a", "b"]}, timeout=30).json()
    same([r.relevance_score for r in ranked.results],
         [r["relevance_score"] for r in want["results"]], "cohere client")


@pytest.mark.parametrize("workers", ["2", "1"])
def test_models_that_do_not_fit_stop_gunicorn_in_one_line(tmp_path, workers):
    """Before, only `embedsvc serve` weighed the models: under gunicorn the models loaded
    (-w 1, in the worker; -w 2, in their engines), each to fail or be killed as it loaded.
    Now the first worker weighs them before any loads, and gunicorn stops as for a model that
    cannot load. The weights are sparse files larger than any machine's memory."""
    sources = {}
    for name in ("big", "bigger"):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "pytorch_model.bin", "wb") as f:
            f.truncate(1 << 42)
        sources[name] = str(tmp_path / name)
    models = ",".join(f"{name}={source}" for name, source in sources.items())
    runtime = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # room for a socket's path
    runtime.chmod(0o700)
    env = {"EMBEDSVC_MODELS": models, "EMBEDSVC_DEVICE": "cpu", "XDG_RUNTIME_DIR": str(runtime)}
    log = tmp_path / "gunicorn.log"
    try:
        cmd = ["gunicorn", "-w", workers, "-b", "127.0.0.1:0", "embedsvc:app"]
        with running(cmd, log, env=env, healthy=False) as server:
            code = server.exit_after_first_request()
        output = log.read_text()
        assert code == 3, output[-3000:]
        said = [line for line in output.splitlines() if "the models' weights take" in line]
        assert len(said) == 1, output[-3000:]
        assert ("8388608 MiB (big 4194304 MiB float32, bigger 4194304 MiB float32), more "
                "than the ") in said[0]
        assert "Traceback" not in output and "started the engine process" not in output
        assert not list(runtime.glob(f"embedsvc-{os.getuid()}/engine-*")), output[-3000:]
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


# two models cheaply: the fake encoder under --workers 2, the bundled model under gunicorn
TWO = {"workers 2": [*FAKE_EMBEDSVC, "serve", "--port", "0", "--workers", "2"],
       "gunicorn -w 2": LAUNCHES["gunicorn -w 2"]("")}


@pytest.mark.parametrize("launch", list(TWO))
def test_metrics_are_served_while_one_models_engine_does_not_answer(tmp_path, launch):
    """The second model's engine stopped (SIGSTOP: hung): /metrics still answers valid
    Prometheus text, the first model's families as before, the hung one's batcher not
    alive; the first model still answers requests."""
    with running(TWO[launch], tmp_path / "serve.log", env={"EMBEDSVC_MODELS": "a=,b="}) as server:
        body = {"model": "a", "input": "a text"}
        for model in "ab":
            server.wait_healthy()
            assert loopback.post(server.url + "/v1/embeddings", json={**body, "model": model},
                                 timeout=60).status_code == 200
        about = loopback.get(server.url + "/info", timeout=30).json()
        hung = next(m["engine_pid"] for m in about["models"] if m["name"] == "b")
        os.kill(hung, signal.SIGSTOP)
        try:
            scrape = loopback.get(server.url + "/metrics", timeout=30)
            answered = loopback.post(server.url + "/v1/embeddings", json=body, timeout=30)
        finally:
            os.kill(hung, signal.SIGCONT)
    assert scrape.status_code == 200, scrape.text[:300]
    alive = {s.labels["model"]: s.value for f in text_string_to_metric_families(scrape.text)
             if f.name == "embedsvc_batcher_alive" for s in f.samples}
    assert alive == {"a": 1.0, "b": 0.0}
    assert answered.status_code == 200


EDITED = {  # the fake encoder under embedsvc serve; the bundled model twice under gunicorn
    "workers 2": [*FAKE_EMBEDSVC, "serve", "--port", "0", "--workers", "2"],
    "gunicorn -w 2": LAUNCHES["gunicorn -w 2"](""),
}


@pytest.mark.parametrize("launch", list(EDITED))
def test_an_engine_replaced_after_the_models_file_was_edited_serves_its_model(tmp_path, launch):
    """MODELS_FILE is read as the run found it: edited while the service runs (a model
    dropped), a killed engine's replacement still serves the model it replaces, instead of
    reading a list where its index names another model or none (it crashed over and over)."""
    listed = tmp_path / "models.toml"
    listed.write_text('[[models]]\nname = "a"\nsource = ""\n\n'
                      '[[models]]\nname = "b"\nsource = ""\n')
    with running(EDITED[launch], tmp_path / "serve.log",
                 env={"EMBEDSVC_MODELS_FILE": str(listed)}) as server:
        listed.write_text('[[models]]\nname = "a"\nsource = ""\n')
        about = loopback.get(server.url + "/info", timeout=30).json()
        victim = next(m["engine_pid"] for m in about["models"] if m["name"] == "b")
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            resp = loopback.post(server.url + "/v1/embeddings",
                                 json={"model": "b", "input": "x"}, timeout=30)
            about = loopback.get(server.url + "/info", timeout=30).json()
            replaced = {m["name"]: m["engine_pid"] for m in about["models"]}["b"] != victim
            if resp.status_code == 200 and replaced:
                break
            time.sleep(0.2)
        assert resp.status_code == 200 and replaced, (resp.text, server.output()[-2000:])
        assert "IndexError" not in server.output()
