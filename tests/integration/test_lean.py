"""The PyTorch-free CPU path on real models: PyTorch's outputs, tampered records rebuilt, a live
server with torch unimportable."""

import json
import logging
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from embedsvc.model import lean
from embedsvc.model.backend import load_encoder
from embedsvc.model.kinds import load_model
from embedsvc.model.record import GRAPH, PROBE, RECORD, TOKENIZER
from embedsvc.model.sparse import active
from embedsvc.settings import Settings

from .. import loopback
from ..models import POOLING_MODES, build_classifier, build_embedding, build_reranker, build_sparse
from .conftest import cosine
from .servers import running
from .test_launchers import GUNICORN, answering_pids, workers_of

TEXTS = ["The quick brown fox jumps over the lazy dog.", "short", "x",
         "Ein Satz auf Deutsch, mit Umlauten: äöü, und 東京は日本の首都です。",
         " ".join(["A long input that repeats itself past the truncation limit."] * 40)]
PAIRS = [("what is a fox", "The quick brown fox jumps over the lazy dog."),
         "a text alone", ("short", " ".join(["a long document"] * 100))]
BLOCKED = ("torch", "transformers", "sentence_transformers", "sklearn", "scipy", "pandas")
PARITY = 0.9999

MODELS = {
    **{f"pool-{m if isinstance(m, str) else '+'.join(m)}": partial(build_embedding, pooling=m)
       for m in POOLING_MODES},
    "mean-dense": partial(build_embedding, dense=True),
    "max-dense-unnormalised": partial(build_embedding, pooling="max", dense=True,
                                      normalize=False),
    "cls-unnormalised": partial(build_embedding, pooling="cls", normalize=False),
    "reranker": build_reranker,
    "classifier": build_classifier,
    "sparse": build_sparse,
}


def settings_for(model: str, cache: Path, **extra) -> Settings:
    return Settings.from_env(os.environ, model=model, device="cpu", cache_dir=str(cache),
                             **extra)


@pytest.fixture(scope="module")
def bundled():
    """The bundled model's record in the run's shared cache, exported there if no server of
    the run has yet: (settings, record path)."""
    settings = settings_for("", Path(os.environ["EMBEDSVC_CACHE_DIR"]))
    served = load_encoder(settings)
    assert isinstance(served, lean.LeanEncoder)
    return settings, lean.record_path(settings)[0]


@pytest.mark.parametrize("name", MODELS)
def test_each_model_kind_and_pooling_mode_serves_pytorchs_outputs(name, tmp_path):
    path = MODELS[name](tmp_path / name)
    reference = load_model(str(path))
    reference.place("cpu", "float32")
    settings = settings_for(str(path), tmp_path / "cache")
    first = load_encoder(settings)  # exports, then serves from the record
    warm = lean.warm_start(settings).encoder  # a later start: the record alone
    for served in (first, warm):
        assert isinstance(served, lean.LeanEncoder), served
        assert served.info == reference.info.__class__(**{
            **reference.info.__dict__, "backend": "onnx"})
        if reference.kind in ("reranker", "classifier"):
            _same_scores(served, reference)
        elif reference.kind == "sparse":
            _same_sparse(served, reference)
        else:
            _same_embeddings(served, reference)


def _same_embeddings(served, reference):
    room = reference.info.max_input_tokens - reference.special_tokens
    ids = reference.tokenize(TEXTS, limit=room)
    assert served.tokenize(TEXTS, limit=room) == ids
    assert served.tokenize(TEXTS, limit=3, direction="left") == reference.tokenize(
        TEXTS, limit=3, direction="left")
    assert served.pieces(TEXTS) == reference.pieces(TEXTS)
    batch = [reference.wrap(i) for i in ids]
    assert [served.wrap(i) for i in ids] == batch
    assert (cosine(served.encode(batch), reference.encode(batch)) > PARITY).all()
    for got, want in zip(served.encode_tokens(batch), reference.encode_tokens(batch),
                         strict=True):
        assert got.shape == want.shape and (cosine(got, want) > PARITY).all()
    assert served.decode(batch) == reference.decode(batch)
    assert served.decode(batch, False) == reference.decode(batch, False)


def _same_scores(served, reference):
    for side in ("right", "left"):
        sequences = reference.tokenize_sequences(PAIRS, side)
        assert served.tokenize_sequences(PAIRS, side) == sequences
        assert [p.second for p in served.tokenize_sequences(PAIRS, side)] == [
            p.second for p in sequences]
    logits = reference.encode(sequences)
    got = served.encode(sequences)
    np.testing.assert_allclose(got, logits, rtol=1e-4, atol=1e-4)
    for raw in (True, False):
        np.testing.assert_allclose(served.activate(got, raw), reference.activate(logits, raw),
                                   rtol=1e-4, atol=1e-5)


def _same_sparse(served, reference):
    batch = [reference.wrap(i) for i in reference.tokenize(TEXTS, limit=100)]
    rows, want = served.encode(batch), reference.encode(batch)
    np.testing.assert_allclose(rows, want, rtol=1e-4, atol=1e-4)
    assert (cosine(rows, want) > PARITY).all()
    for (got_at, _), (want_at, _) in zip(active(rows, 50), active(want, 50), strict=True):
        assert len(got_at) == len(want_at) == 50
        assert len(set(got_at) ^ set(want_at)) <= 2  # a near-tie at the 50th value may swap


def test_a_model_the_graph_cannot_express_takes_pytorchs_path_and_says_why(tmp_path, caplog):
    import torch
    from sentence_transformers import CrossEncoder

    path = build_reranker(tmp_path / "softplus")
    model = CrossEncoder(str(path), device="cpu", activation_fn=torch.nn.Softplus())
    model.save_pretrained(str(path))
    caplog.set_level(logging.INFO, logger="embedsvc")
    settings = settings_for(str(path), tmp_path / "cache")
    served = load_encoder(settings)
    assert not isinstance(served, lean.LeanEncoder) and served.info.backend == "torch"
    assert "not the PyTorch-free path (its activation is Softplus" in caplog.text
    caplog.clear()
    assert lean.warm_start(settings).reason.startswith("its activation is Softplus")


def test_weights_float16_cannot_hold_are_stored_as_float32(tiny, tmp_path, caplog):
    """Word vectors 100 off zero and about 0.3 apart: float16, 0.06 apart there, rounds each
    by a few hundredths (within HALF_ERROR of the table's largest value, so the table is
    converted), and the LayerNorm after them magnifies that past the probe's tolerance. The
    same model without the offset (``tiny``) keeps its float16 weights."""
    import torch
    from sentence_transformers import SentenceTransformer

    _, plain = tiny
    assert _stored(plain / GRAPH) == {"float16", "float32"}
    assert json.loads((plain / RECORD).read_text())["weights"] == "float16"
    path = build_embedding(tmp_path / "offset")
    model = SentenceTransformer(str(path), device="cpu")
    with torch.no_grad():
        model[0].auto_model.embeddings.word_embeddings.weight += 100.0
    model.save_pretrained(str(path))
    caplog.set_level(logging.INFO, logger="embedsvc")
    settings = settings_for(str(path), tmp_path / "cache")
    served = load_encoder(settings)
    assert isinstance(served, lean.LeanEncoder) and served.weights == "float32"
    assert "its float16 weights miss PyTorch's probe outputs" in caplog.text
    assert "offset: weights stored as float32, computed in float32" in caplog.text
    assert _stored(lean.record_path(settings)[0] / GRAPH) == {"float32"}
    reference = load_model(str(path))
    reference.place("cpu", "float32")
    _same_embeddings(served, reference)


def _stored(graph: Path) -> set[str]:
    """The floating-point types of a graph's weights."""
    import onnx

    types = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}
    return {types[t.data_type] for t in onnx.load(graph).graph.initializer
            if t.data_type in types}


def _tamper_graph(record: Path) -> None:
    data = bytearray((record / GRAPH).read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(64)  # same size: only the digest or the probe can tell
    (record / GRAPH).write_bytes(bytes(data))


def _truncate_graph(record: Path) -> None:
    (record / GRAPH).write_bytes((record / GRAPH).read_bytes()[:1000])


def _tamper_probe(record: Path) -> None:
    with np.load(record / PROBE) as probe:
        outputs = {k: probe[k] for k in probe.files}
    outputs["sentence_embedding"] = outputs["sentence_embedding"] * 1.5
    np.savez(record / PROBE, **outputs)


def _tamper_tokenizer(record: Path) -> None:
    text = (record / TOKENIZER).read_text()
    (record / TOKENIZER).write_text(text.replace('"lowercase":true', '"lowercase":false', 1)
                                    if '"lowercase":true' in text else text + " ")


def _other_model(record: Path) -> None:
    data = json.loads((record / RECORD).read_text())
    data["fingerprint"] = "0" * 64
    (record / RECORD).write_text(json.dumps(data))


def _corrupt_record(record: Path) -> None:
    (record / RECORD).write_text('{"format": 1, "lean": tr')


def _edit_a_field(record: Path) -> None:
    """What a user might try instead of a setting: the probe still matches, the digest not."""
    data = json.loads((record / RECORD).read_text())
    data["info"]["max_input_tokens"] *= 4
    (record / RECORD).write_text(json.dumps(data, indent=1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny embedding model's record (what is checked is the record, not the model; the
    bundled one's is checked by the tests above and below): (model path, record path)."""
    root = tmp_path_factory.mktemp("tiny")
    path = build_embedding(root / "model")
    settings = settings_for(str(path), root / "cache")
    assert isinstance(load_encoder(settings), lean.LeanEncoder)
    return str(path), lean.record_path(settings)[0]


@pytest.mark.parametrize("tamper", [_tamper_graph, _truncate_graph, _tamper_probe,
                                    _tamper_tokenizer, _other_model, _corrupt_record,
                                    _edit_a_field])
def test_a_tampered_record_is_rebuilt_never_served(tiny, tmp_path, tamper, caplog):
    model, original = tiny
    cache = tmp_path / "cache"
    shutil.copytree(original.parent, cache, ignore=shutil.ignore_patterns(".locks"))
    settings = settings_for(model, cache)
    record = cache / original.name
    tamper(record)
    warm = lean.warm_start(settings)
    assert warm.encoder is None and warm.export, warm.reason
    assert "does not verify" in caplog.text and "rebuilding it with PyTorch" in caplog.text
    served = load_encoder(settings)  # rebuilt with PyTorch, then served from the new record
    assert isinstance(served, lean.LeanEncoder)
    assert lean.warm_start(settings).encoder is not None
    for name in (GRAPH, PROBE, TOKENIZER):
        assert (record / name).read_bytes() == (original / name).read_bytes(), name
    assert served.info.max_input_tokens == json.loads((original / RECORD).read_text())[
        "info"]["max_input_tokens"]
    assert sorted(p.name for p in cache.iterdir()) == [".locks", record.name]


def test_the_bundled_model_answers_to_its_own_name(bundled):
    settings, path = bundled
    by_name = settings_for("all-MiniLM-L6-v2", Path(settings.cache_dir))
    assert lean.record_path(by_name) == lean.record_path(settings)
    served = lean.warm_start(by_name).encoder  # its record: no export, no hub
    assert isinstance(served, lean.LeanEncoder) and served.info.name == "all-MiniLM-L6-v2"
    assert served.graph.parent == path


class _CountedSession:
    """An ONNX Runtime session that notes the outputs each run asks for."""

    def __init__(self, session, runs: list) -> None:
        self._session, self._runs = session, runs

    def run(self, names, feeds):
        self._runs.append(list(names))
        return self._session.run(names, feeds)

    def __getattr__(self, name):
        return getattr(self._session, name)


def test_a_start_checks_the_probe_in_one_run_of_the_graph(bundled, monkeypatch):
    """The probe's pooled rows and token rows come from one run: each run on the probe costs
    a start as much as the first. A probe that differs is still refused (the tampered
    records above)."""
    from embedsvc.model import runtime

    _, path = bundled
    runs: list = []
    real = runtime.session
    monkeypatch.setattr(runtime, "session",
                        lambda graph, threads: _CountedSession(real(graph, threads), runs))
    encoder = lean.open_record(path, 1, before_run=lambda: runs.append("digests checked"))
    assert isinstance(encoder, lean.LeanEncoder)
    # the start's digests are checked before the graph first runs
    assert runs == ["digests checked", ["sentence_embedding", "token_embeddings"]]


def test_the_batcher_gives_the_lean_encoder_batches_of_one_session_run(bundled):
    from embedsvc.model.runtime import RUN_TOKENS
    from embedsvc.service import batch_limits

    settings, _ = bundled
    encoder = lean.warm_start(settings).encoder
    assert settings.max_batch_tokens == 16384
    assert batch_limits(settings, encoder).max_batch_tokens == RUN_TOKENS


def test_int8_serves_from_its_own_record_with_its_gate(bundled, tmp_path):
    from embedsvc.model.runtime import QualityBelowFloor

    settings, original = bundled
    cache = tmp_path / "cache"
    shutil.copytree(original, cache / original.name)  # the float32 record alone
    # the default floor: the bundled model's int8 graph keeps about 0.90 of the neighbours
    with pytest.raises(QualityBelowFloor, match="keep 0.*QUANTIZE_MIN_RECALL=0.97"):
        lean.warm_start(settings_for("", cache, quantize="int8"))  # quantized now
    accepting = settings_for("", cache, quantize="int8", quantize_min_recall=0.8)
    int8 = lean.warm_start(accepting).encoder  # read back from its record
    fp32 = lean.warm_start(settings_for("", cache)).encoder
    assert int8.info.dtype == "int8" and int8.quality.mean >= 0.99
    assert fp32.weights == "float16" and _quantized_matmuls(int8.graph) == 36  # 6 per layer
    assert int8.quality.recall >= 0.85 and int8.quality.texts == 287
    batch = [fp32.wrap(i) for i in fp32.tokenize(TEXTS[:4])]
    assert (cosine(int8.encode(batch), fp32.encode(batch)) > 0.95).all()
    again = lean.warm_start(accepting).encoder
    np.testing.assert_array_equal(again.encode(batch), int8.encode(batch))


def _quantized_matmuls(graph: Path) -> int:
    """The int8 graph's MatMuls whose weights were quantized once, as initializers."""
    import onnx

    model = onnx.load(graph)
    int8 = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8}
    return sum(n.op_type == "MatMulInteger" and n.input[1] in int8 for n in model.graph.node)


GUARD = f"""
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ImportError(name + " is made unimportable by this test")
sys.meta_path.insert(0, Refuse())
from embedsvc.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_warm_start_with_torch_unimportable_serves_correct_vectors(bundled, reference,
                                                                     tmp_path):
    settings, _ = bundled
    log = tmp_path / "serve.log"
    cmd = ["python", "-c", GUARD, "serve", "--port", "0", "--cache-dir", settings.cache_dir]
    with running(cmd, log) as server, server.client() as client:
        resp = client.post("/embed", json={"inputs": TEXTS})
        assert resp.status_code == 200, resp.text
        with open(f"/proc/{server.proc.pid}/maps") as f:
            maps = f.read()
        info = client.get("/info").json()
    got = np.array(resp.json(), dtype=np.float32)
    want = reference.encode(TEXTS)
    assert (cosine(got, want) > PARITY).all()
    assert "libtorch" not in maps and "PyTorch-free" not in server.output()
    assert "without PyTorch" in server.output() and "is made unimportable" not in server.output()
    assert info["model_id"] == "all-MiniLM-L6-v2", info


def test_the_lean_encoder_imports_none_of_the_model_libraries(bundled):
    settings, _ = bundled
    code = f"""
import sys
from embedsvc.model import lean
from embedsvc.service import load_encoder
from embedsvc.settings import Settings
enc = load_encoder(Settings.from_env({{}}, cache_dir={settings.cache_dir!r}, device="cpu"))
assert isinstance(enc, lean.LeanEncoder), enc
print(sorted(m for m in sys.modules if m.startswith({BLOCKED!r})))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def _libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_gunicorn_preload_master_holds_no_session_and_no_process_loads_torch(
        bundled, reference, tmp_path):
    settings, _ = bundled
    cmd = [*GUNICORN, "-w", "2", "--threads", "4", "--preload", "embedsvc:app"]
    env = {"EMBEDSVC_CACHE_DIR": settings.cache_dir}
    with running(cmd, tmp_path / "server.log", env=env, cwd=str(tmp_path)) as server:
        workers = workers_of(server.proc.pid)
        assert answering_pids(server, reference, want=2) == set(workers)
        log = server.output()
        # the two workers share one engine process, the only one with a session
        engine = loopback.get(server.url + "/info", timeout=30).json()["engine_pid"]
        assert "preloads nothing" in log and log.count("on the CPU without PyTorch") == 1, log
        assert "onnxruntime" in _libraries(engine)
        for pid in [server.proc.pid, *workers]:
            assert "onnxruntime" not in _libraries(pid)
        for pid in [server.proc.pid, *workers, engine]:
            assert "libtorch" not in _libraries(pid)


def test_waitress_serve_serves_without_torch(bundled, reference, tmp_path):
    settings, _ = bundled
    cmd = ["waitress-serve", "--host=127.0.0.1", "--port=0", "embedsvc:app"]
    env = {"EMBEDSVC_CACHE_DIR": settings.cache_dir}
    with running(cmd, tmp_path / "waitress.log", env=env, cwd=str(tmp_path)) as server, \
            server.client() as client:
        got = np.array(client.post("/embed", json={"inputs": TEXTS}).json(), dtype=np.float32)
        assert "libtorch" not in _libraries(server.proc.pid)
        assert "without PyTorch" in server.output()
    assert (cosine(got, reference.encode(TEXTS)) > PARITY).all()


def _embedsvc(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("embedsvc")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout)


def test_embedsvc_export_builds_the_record_ahead_and_embed_then_runs_without_torch(
        reference, tmp_path):
    cache = tmp_path / "cache"
    out = _embedsvc("export", "--cache-dir", str(cache))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "without PyTorch" in out.stdout and "first start of all-MiniLM-L6-v2" in out.stderr
    [record] = cache.glob("*.lean")
    assert f"pipeline from {record} (" in out.stdout  # where it is published, not built
    source, target = tmp_path / "lines.txt", tmp_path / "vectors.npy"
    source.write_text("\n".join(TEXTS) + "\n")
    run = subprocess.run([sys.executable, "-c", GUARD, "embed", str(source), "--output",
                          str(target), "--cache-dir", str(cache)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "first start" not in run.stderr
    assert (cosine(np.load(target), reference.encode(TEXTS)) > PARITY).all()
    assert sorted(p.name for p in cache.iterdir()) == [".locks", record.name]
