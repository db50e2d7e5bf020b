"""The ONNX Runtime backend on real models: cache, int8 quality, other model shapes, gunicorn."""

import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from embedsvc.metrics import Metrics
from embedsvc.model.encoder import bundled_model_path
from embedsvc.service import Service
from embedsvc.settings import Settings

from .conftest import cosine
from .servers import running
from .test_launchers import GUNICORN, answering_pids, workers_of

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings map text to vectors.",
         "short", "Ein Satz auf Deutsch, mit Umlauten: äöü."]


def started(**settings) -> Service:
    """A service on the real model; the run's shared cache unless ``cache_dir`` says."""
    # this file tests the PyTorch-backed ONNX path (test_lean.py the PyTorch-free one)
    if settings.get("backend", "onnx") == "onnx":
        settings["backend"] = "onnx-torch"
    settings = Settings.from_env(os.environ, device="cpu", **settings)
    service = Service(settings, metrics=Metrics(CollectorRegistry()))
    service.start(background=False)
    return service


def vectors(service: Service, texts) -> np.ndarray:
    try:
        return service.ready().embed(texts).vectors
    finally:
        service.drain(timeout=5)


def graphs(cache: Path) -> list[Path]:
    return sorted(p for p in cache.glob("*.onnx") if not p.name.startswith("."))


@pytest.fixture(scope="module")
def exported() -> Path:
    """The bundled model's float32 graph in the run's shared cache, exported if not yet."""
    vectors(started(backend="onnx"), TEXTS[:1])
    [graph] = [p for p in graphs(Path(os.environ["EMBEDSVC_CACHE_DIR"])) if "int8" not in p.name]
    return graph


def test_a_truncated_cached_graph_is_rebuilt_and_serves_right_vectors(exported, tmp_path,
                                                                       reference, caplog):
    graph = tmp_path / exported.name
    whole = exported.stat().st_size
    graph.write_bytes(exported.read_bytes()[: whole // 3])
    again = started(backend="onnx", cache_dir=str(tmp_path))
    assert (cosine(vectors(again, TEXTS), reference.encode(TEXTS)) > 0.9999).all()
    assert graphs(tmp_path) == [graph] and graph.stat().st_size == whole
    assert "does not load" in caplog.text and "rebuilding" in caplog.text


def test_a_batch_over_the_run_size_is_computed_in_slices_with_the_same_vectors(exported,
                                                                              reference):
    from embedsvc.model.runtime import RUN_TOKENS

    texts = [f"input {i}: " + " ".join(["slices of one batch"] * (20 + i)) for i in range(48)]
    service = started(backend="onnx")
    engine = service.ready()
    batch = engine.tokens(texts)
    assert len(batch) * max(map(len, batch)) > 2 * RUN_TOKENS  # three runs or more
    rows = service.runner.encoder.encode(batch)
    service.drain(timeout=5)
    assert (cosine(rows, reference.encode(texts)) > 0.9999).all()


def test_a_graph_the_model_directory_ships_is_used_as_it_is(exported, tmp_path, reference,
                                                              caplog):
    model = tmp_path / "model"
    shutil.copytree(bundled_model_path(), model)
    (model / "onnx").mkdir()
    shutil.copy(exported, model / "onnx" / "model.onnx")
    caplog.clear()
    caplog.set_level("INFO")
    engine = started(backend="onnx", model=str(model), cache_dir=str(tmp_path / "empty"))
    assert (cosine(vectors(engine, TEXTS), reference.encode(TEXTS)) > 0.9999).all()
    assert f"graph {model / 'onnx' / 'model.onnx'}" in caplog.text
    assert not (tmp_path / "empty").exists()  # nothing exported


def test_int8_reports_its_quality_and_keeps_neighbours(caplog):
    caplog.set_level("INFO")
    rng = random.Random(0)
    subjects = ["the cat", "a doctor", "the new phone", "our team", "the river", "a student",
                "the bank", "this recipe", "the old car", "my neighbour"]
    verbs = ["needs", "loves", "breaks", "finds", "sells", "cleans", "explains", "watches"]
    things = ["fresh bread", "the contract", "a red ball", "cold water", "the final exam",
              "an umbrella", "the network", "warm soup", "a long letter", "the engine"]
    texts = sorted({f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(things)}"
                    for _ in range(400)})
    fp32 = started(backend="onnx")
    int8 = started(backend="onnx", quantize="int8", quantize_min_recall=0.8)
    assert int8.model.dtype == "int8"
    line = next(r.getMessage() for r in caplog.records if "QUANTIZE=int8" in r.getMessage())
    assert "on 287 calibration texts (floor QUANTIZE_MIN_RECALL=0.8)" in line, line
    assert "cosine mean 0.99" in line, line
    queries = 30
    top = {}
    for name, engine in (("fp32", fp32), ("int8", int8)):
        rows = vectors(engine, texts)
        scores = rows[-queries:] @ rows[:-queries].T
        top[name] = np.argsort(-scores, axis=1)[:, :10]
    agreement = np.mean([len(set(a) & set(b)) / 10 for a, b in
                         zip(top["fp32"], top["int8"], strict=True)])
    print(f"int8 top-10 neighbour agreement with float32: {agreement:.3f} "
          f"({queries} queries, {len(texts) - queries} documents)")
    assert agreement >= 0.8


def test_int8_below_its_floor_refuses_to_start_naming_the_setting():
    # the default floor: the bundled model's int8 graph keeps about 0.90 of the neighbours
    with pytest.raises(RuntimeError, match="keep 0.*QUANTIZE_MIN_RECALL=0.97"):
        started(backend="onnx", quantize="int8")


@pytest.fixture(scope="module")
def cls_dense_model(tmp_path_factory) -> str:
    """A small random BERT with CLS pooling and a Dense layer after it, saved as users save."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Pooling, Transformer
    from transformers import AutoTokenizer, BertConfig, BertModel

    root = tmp_path_factory.mktemp("cls-dense")
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128, max_position_embeddings=64)
    BertModel(config).save_pretrained(root / "bert")
    tokenizer.save_pretrained(root / "bert")
    modules = [Transformer(str(root / "bert"), max_seq_length=48),
               Pooling(64, pooling_mode="cls"), Dense(64, 24)]
    SentenceTransformer(modules=modules, device="cpu").save(str(root / "model"))
    return str(root / "model")


def test_cls_pooling_and_a_dense_layer_give_pytorchs_vectors(cls_dense_model, tmp_path):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(cls_dense_model, device="cpu")
    texts = [*TEXTS, " ".join(["truncated at forty-eight tokens"] * 30)]
    engine = started(backend="onnx", model=cls_dense_model, cache_dir=str(tmp_path))
    assert (engine.model.backend, engine.model.dimension) == ("onnx", 24)
    assert (cosine(vectors(engine, texts), reference.encode(texts)) > 0.9999).all()


def test_gunicorn_preload_two_workers_each_build_their_own_session(cls_dense_model, tmp_path):
    """Two workers that each hold the model (ENGINE=inline) start together on an empty cache:
    one export, two sessions, none in the master, both serving PyTorch's vectors. (A small
    model: what is tested is the export's lock and the sessions, not the bundled model.)"""
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(cls_dense_model, device="cpu")
    env = {"EMBEDSVC_BACKEND": "onnx-torch", "EMBEDSVC_CACHE_DIR": str(tmp_path / "cache"),
           "EMBEDSVC_ENGINE": "inline", "EMBEDSVC_MODEL": cls_dense_model}
    cmd = [*GUNICORN, "-w", "2", "--threads", "4", "--preload", "embedsvc:app"]
    with running(cmd, tmp_path / "server.log", env=env, cwd=str(tmp_path)) as server:
        workers = workers_of(server.proc.pid)
        assert answering_pids(server, reference, want=2) == set(workers)
        log = server.output()
        assert log.count("backend: ONNX Runtime float32") == 2, log
        assert len(re.findall(r"exporting \S+ to ONNX", log)) == 1, log
        assert "onnxruntime" not in Path(f"/proc/{server.proc.pid}/maps").read_text()
        for pid in workers:
            assert "onnxruntime" in Path(f"/proc/{pid}/maps").read_text()
    assert len(graphs(tmp_path / "cache")) == 1


def test_embedsvc_export_builds_ahead_what_a_start_then_reads(cls_dense_model, tmp_path,
                                                              caplog):
    exe = Path(sys.executable).parent / "embedsvc"
    out = subprocess.run([str(exe), "export", "--backend", "onnx-torch", "--model",
                          cls_dense_model, "--cache-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    [graph] = graphs(tmp_path)
    assert f"graph {graph}" in out.stdout and re.search(r"exporting \S+ to ONNX", out.stderr)
    caplog.set_level("INFO")
    engine = started(backend="onnx", model=cls_dense_model, cache_dir=str(tmp_path))
    vectors(engine, TEXTS[:1])
    assert "exporting" not in caplog.text and f"graph {graph}" in caplog.text
