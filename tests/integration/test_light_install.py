"""The install without PyTorch (`pip install embedsvc`): a venv of its own, in which torch does
not import, serves the bundled model from a record this environment exported, and a model
directory that ships an ONNX graph with no record at all; what it cannot do, it says in one
line naming the extra or the export to run.

The venv is a real `pip install` of this checkout (editable, so that it follows the code) and
costs about a minute of wall time and 22 CPU-seconds; it is kept in .pytest_cache under a key
of the core requirements and the interpreter, so that later runs reuse it (a change of the
requirements rebuilds it, and older ones are removed).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import requires
from pathlib import Path

import numpy as np
import pytest

from embedsvc.model import lean
from embedsvc.model.backend import load_encoder
from embedsvc.model.encoder import bundled_model_path
from embedsvc.model.kinds import load_model
from embedsvc.model.onnx_dir import DirectoryEncoder, Unservable, open_directory
from embedsvc.settings import Settings

from ..models import POOLING_MODES, build_embedding
from .conftest import cosine
from .servers import running

REPO = Path(__file__).parents[2]
LIGHT = REPO / ".pytest_cache" / "embedsvc-light"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "short", "x",
         "Ein Satz auf Deutsch, mit Umlauten: äöü, und 東京は日本の首都です。",
         " ".join(["A long input that repeats itself past the truncation limit."] * 40)]
PARITY = 0.9999
HEAVY = ("torch", "transformers", "sentence_transformers")


def _key() -> str:
    core = [r for r in requires("embedsvc") or [] if "extra ==" not in r]
    return hashlib.sha256(json.dumps([core, sys.version]).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def light() -> Path:
    """The bin directory of a venv holding `pip install <checkout>` and nothing else."""
    LIGHT.mkdir(parents=True, exist_ok=True)
    venv = LIGHT / _key()
    with open(LIGHT / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / "installed").exists():
            for old in LIGHT.iterdir():
                if old.is_dir():
                    shutil.rmtree(old)
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
            subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                            "install", "--quiet", "--no-compile", "-e", str(REPO)], check=True,
                           timeout=900)
            (venv / "installed").touch()
    return venv / "bin"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EMBEDSVC_", "VIRTUAL_ENV", "PYTHON"))}
    return {**env, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", **extra}


def _run(bin_dir: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True,
                          env=_env(**env), cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def record_cache() -> Path:
    """The run's graph cache, holding the bundled model's record (exported here if no test
    of the run has yet): what `embedsvc export --cache-dir DIR` leaves to copy."""
    cache = Path(os.environ["EMBEDSVC_CACHE_DIR"])
    assert isinstance(load_encoder(Settings.from_env(os.environ, device="cpu")),
                      lean.LeanEncoder)
    return cache


def build_onnx_directory(source: Path, path: Path) -> Path:
    """The sentence-transformers model at ``source`` as the model hub ships many: its files,
    with its transformer as ``onnx/model.onnx`` (``last_hidden_state``, as optimum exports
    it), and without its PyTorch weights, so that nothing but the graph can serve it."""
    import torch
    from transformers import AutoModel

    shutil.copytree(source, path, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    model = AutoModel.from_pretrained(str(source)).eval()

    class Graph(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    names = ["input_ids", "attention_mask", "token_type_ids"]
    inputs = (torch.tensor([[101, 7592, 2088, 102], [101, 7592, 102, 0]]),
              torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), torch.zeros(2, 4, dtype=torch.long))
    (path / "onnx").mkdir()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's notes about its own future
        torch.onnx.export(Graph(), inputs, str(path / "onnx" / "model.onnx"), input_names=names,
                          output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                          dynamic_axes={n: {0: "batch", 1: "sequence"}
                                        for n in [*names, "last_hidden_state"]})
    return path


@pytest.mark.parametrize("pooling", POOLING_MODES, ids=lambda m: "+".join(m)
                         if isinstance(m, tuple) else m)
def test_a_directorys_own_graph_pools_as_sentence_transformers(pooling, tmp_path):
    source = build_embedding(tmp_path / "model", pooling=pooling)
    reference = load_model(str(source))
    reference.place("cpu", "float32")
    directory = build_onnx_directory(source, tmp_path / "onnx-model")
    served = open_directory(Settings(model=str(directory), device="cpu"), directory)
    assert isinstance(served, DirectoryEncoder)
    assert served.info == reference.info.__class__(**{
        **reference.info.__dict__, "backend": "onnx", "parameters": 0,
        "size_bytes": served.info.size_bytes, "name": served.info.name})
    room = reference.info.max_input_tokens - reference.special_tokens
    batch = [reference.wrap(ids) for ids in reference.tokenize(TEXTS, limit=room)]
    assert [served.wrap(ids) for ids in served.tokenize(TEXTS, limit=room)] == batch
    assert (cosine(served.encode(batch), reference.encode(batch)) > PARITY).all()
    np.testing.assert_allclose(served.encode(batch), reference.encode(batch), rtol=1e-4,
                               atol=1e-4)


def test_a_pipeline_with_more_than_pooling_is_refused(tmp_path):
    source = build_embedding(tmp_path / "model", dense=True)
    directory = build_onnx_directory(source, tmp_path / "onnx-model")
    with pytest.raises(Unservable, match="Transformer -> Pooling -> Dense -> Normalize"):
        open_directory(Settings(model=str(directory)), directory)


def test_the_light_install_has_no_pytorch(light, tmp_path):
    out = _run(light, "python", "-c", f"import importlib.util as u; print([m for m in {HEAVY!r} "
               "if u.find_spec(m)])", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_it_serves_the_bundled_model_from_a_record_exported_elsewhere(light, record_cache,
                                                                      reference, tmp_path):
    cache = tmp_path / "copied"  # as a deployment copies DIR of `embedsvc export --cache-dir DIR`
    shutil.copytree(record_cache, cache, ignore=shutil.ignore_patterns(".*"))
    cmd = [str(light / "embedsvc"), "serve", "--model", "all-MiniLM-L6-v2", "--port", "0",
           "--cache-dir", str(cache)]
    with running(cmd, tmp_path / "serve.log", env=_env(), cwd=str(tmp_path)) as server, \
            server.client() as client:
        resp = client.post("/embed", json={"inputs": TEXTS})
        info = client.get("/info").json()
        maps = Path(f"/proc/{server.pid}/maps").read_text()
        log = server.output()
    assert resp.status_code == 200, resp.text
    assert (cosine(np.array(resp.json()), reference.encode(TEXTS)) > PARITY).all()
    assert info["model_id"] == "all-MiniLM-L6-v2" and "libtorch" not in maps
    assert "without PyTorch" in log and "its probe outputs match PyTorch's" in log, log


def test_it_serves_a_model_directory_that_ships_an_onnx_graph(light, reference, tmp_path):
    directory = build_onnx_directory(Path(bundled_model_path()), tmp_path / "minilm-onnx")
    cmd = [str(light / "embedsvc"), "serve", "--model", str(directory), "--port", "0",
           "--cache-dir", str(tmp_path / "empty-cache")]
    with running(cmd, tmp_path / "serve.log", env=_env(), cwd=str(tmp_path)) as server, \
            server.client() as client:
        resp = client.post("/embed", json={"inputs": TEXTS})
        tokens = client.post("/tokenize", json={"inputs": TEXTS[:2]})
        log = server.output()
    assert resp.status_code == 200 and tokens.status_code == 200, resp.text + tokens.text
    assert (cosine(np.array(resp.json()), reference.encode(TEXTS)) > PARITY).all()
    assert "the model directory's own graph" in log and "no PyTorch evidence was checked" in log
    assert not (tmp_path / "empty-cache").exists() or not any((tmp_path / "empty-cache").iterdir())


FAILURES = [
    # (id, arguments, what the one line must name)
    ("no-record", ["serve", "--port", "0", "--cache-dir", "{empty}"],
     "has no export record in {empty}"),
    ("export", ["export", "--cache-dir", "{empty}"], "pip install 'embedsvc[torch]'"),
    ("device", ["serve", "--device", "cuda", "--port", "0"], "pip install 'embedsvc[torch]'"),
    ("backend", ["serve", "--backend", "torch", "--port", "0", "--cache-dir", "{records}"],
     "BACKEND=torch needs PyTorch, which this install does not have: pip install "
     "'embedsvc[torch]'"),
    ("int8", ["serve", "--quantize", "int8", "--port", "0", "--cache-dir", "{records}"],
     "pip install 'embedsvc[int8]', or run `embedsvc export --quantize int8 --cache-dir DIR`"),
    ("parquet", ["embed", "{text}", "-o", "{out}.parquet"], "pip install 'embedsvc[parquet]'"),
    ("url", ["embed", "{text}", "-o", "{out}.jsonl", "--url", "http://127.0.0.1:9"],
     "pip install 'embedsvc[remote]'"),
    ("ray", ["embed", "{text}", "-o", "{out}", "--ray"], "pip install 'embedsvc[ray]'"),
]


def test_what_it_cannot_do_is_one_line_naming_the_extra_or_the_export(light, record_cache,
                                                                      tmp_path):
    records = tmp_path / "records"  # the float32 record alone: no int8 record beside it
    shutil.copytree(record_cache, records, ignore=shutil.ignore_patterns(".*", "int8"))
    (tmp_path / "lines.txt").write_text("a line\n")
    values = {"empty": str(tmp_path / "empty"), "records": str(records),
              "text": str(tmp_path / "lines.txt"), "out": str(tmp_path / "out")}
    with ThreadPoolExecutor(max_workers=4) as pool:
        runs = {name: pool.submit(_run, light, "embedsvc", *[a.format(**values) for a in args],
                                  cwd=tmp_path) for name, args, _ in FAILURES}
        results = {name: run.result() for name, run in runs.items()}
    for name, _, message in FAILURES:
        result = results[name]
        lines = result.stderr.strip().splitlines()
        assert result.returncode in (1, 2) and len(lines) == 1, (name, result.stderr)
        assert "Traceback" not in result.stderr and message.format(**values) in lines[0], (
            name, lines)
