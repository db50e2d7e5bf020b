"""The PyTorch-free path's pieces that need no model: when it applies, how records compare,
sparse top-k, and record directories in the graph cache."""

import hashlib
from pathlib import Path

import numpy as np
import pytest

from embedsvc.model import lean
from embedsvc.model.graph_cache import GraphCache
from embedsvc.model.record import RecordError, compare, file_digest, fingerprint
from embedsvc.model.sparse import top_active
from embedsvc.settings import Settings


@pytest.mark.parametrize(
    ("env", "device", "reason"),
    [
        ({"EMBEDSVC_BACKEND": "onnx-torch"}, None, "BACKEND=onnx-torch"),
        ({"EMBEDSVC_BACKEND": "torch"}, None, "BACKEND=torch"),
        ({"EMBEDSVC_DTYPE": "bfloat16"}, None, "DTYPE=bfloat16 (this path computes in float32)"),
        ({"EMBEDSVC_DEVICE": "cuda"}, None, "DEVICE=cuda"),
        ({}, "cuda", "the device is cuda"),
        ({"EMBEDSVC_DEVICE": "cpu"}, None, None),
        ({"EMBEDSVC_BACKEND": "onnx"}, "cpu", None),
    ],
)
def test_when_the_lean_path_applies(env, device, reason):
    assert lean.why_not(Settings.from_env(env), device) == reason


def test_device_auto_counts_as_the_cpu_only_without_a_gpu(monkeypatch, tmp_path):
    settings = Settings.from_env({"EMBEDSVC_CACHE_DIR": str(tmp_path)})
    monkeypatch.setattr(lean, "accelerator_present", lambda: True)
    warm = lean.warm_start(settings)
    assert "GPU" in warm.reason and warm.export  # PyTorch decides; on the CPU it exports
    assert not lean.recorded(settings)
    monkeypatch.setattr(lean, "accelerator_present", lambda: False)
    warm = lean.warm_start(settings)
    assert warm.reason.startswith("first start of all-MiniLM-L6-v2") and warm.export


def test_compare_refuses_what_differs_and_accepts_rounding():
    want = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    compare(want + 1e-6, want, "rows")
    for bad in (want * 1.01, want[:2], np.full_like(want, np.nan)):
        with pytest.raises(RecordError):
            compare(bad, want, "rows")


def test_compare_reads_token_rows_only_up_to_each_length():
    want = np.zeros((2, 3, 4), dtype=np.float32) + 1.0
    got = want.copy()
    got[0, 2] = 99.0  # padding of the first input
    compare(got, want, "tokens", lengths=[2, 3])
    with pytest.raises(RecordError):
        compare(got, want, "tokens", lengths=[3, 3])


def test_top_active_matches_sentence_transformers():
    torch = pytest.importorskip("torch")
    from sentence_transformers.util import select_max_active_dims

    rows = np.random.default_rng(1).normal(size=(4, 100)).astype(np.float32)
    for k in (1, 7, 100, 150):
        want = select_max_active_dims(torch.from_numpy(rows), k).numpy()
        np.testing.assert_array_equal(top_active(rows, k), want)
    with pytest.raises(ValueError, match="positive"):
        top_active(rows, 0)


def test_the_fingerprint_follows_the_files_and_the_kind(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    before = fingerprint(tmp_path, "auto")
    assert fingerprint(tmp_path, "auto") == before != fingerprint(tmp_path, "sparse")
    (tmp_path / "config.json").write_text('{"x": 1}')
    assert fingerprint(tmp_path, "auto") != before


def _build_dir(content: str, path: Path) -> None:
    path.mkdir()
    (path / "a").write_text(content)


def _load_dir(path: Path) -> str:
    text = (path / "a").read_text()
    if text != "good":
        raise ValueError("bad record")
    return text


def test_a_record_directory_is_published_whole_and_a_bad_one_replaced(tmp_path):
    cache = GraphCache(tmp_path)
    path = cache.path("m", "ab" * 32, ".lean")
    assert cache.get_or_build(path, lambda p: _build_dir("good", p), _load_dir)[0] == "good"
    (path / "a").write_text("tampered")
    assert cache.get_or_build(path, lambda p: _build_dir("good", p), _load_dir)[0] == "good"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".locks", path.name]
    with pytest.raises(ValueError, match="bad record"):
        cache.get_or_build(cache.path("n", "cd" * 32, ".lean"),
                           lambda p: _build_dir("bad", p), _load_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".locks", path.name]  # no temporary


def test_the_cpu_batches_are_one_session_run_and_hold_one_input_at_the_limit():
    from types import SimpleNamespace

    from embedsvc.model.runtime import RUN_TOKENS, run_tokens

    assert run_tokens(SimpleNamespace(max_input_tokens=256), 16384) == RUN_TOKENS == 1024
    assert run_tokens(SimpleNamespace(max_input_tokens=8192), 16384) == 8192
    for chosen in (2048, 32768):  # MAX_BATCH_TOKENS that was set is kept
        assert run_tokens(SimpleNamespace(max_input_tokens=256), chosen) == chosen


@pytest.mark.parametrize("size", [0, 1, (1 << 20) + 3])
def test_a_files_digest_is_its_sha256_empty_files_too(tmp_path, size):
    """The record's digest of a file, read in one mapped pass (mmap refuses empty files)."""
    path = tmp_path / "f.bin"
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    path.write_bytes(data)
    assert file_digest(path) == hashlib.sha256(data).hexdigest()


def _small_record(path: Path) -> None:
    from embedsvc.model.record import describe_file, write_record

    path.mkdir()
    for name, data in (("model.onnx", b"graph" * 1000), ("probe.npz", b"probe")):
        (path / name).write_bytes(data)
    write_record(path, {"lean": True, "fingerprint": "k" * 64, "files": {
        n: describe_file(path / n) for n in ("model.onnx", "probe.npz")}})


def test_a_start_never_runs_nor_serves_a_graph_whose_digest_differs(tmp_path, monkeypatch):
    """The files' digests run beside the session's build (a thread of their own) and are
    checked before the graph first runs (the probe): a file that differs is refused before
    the probe, as a weight the probe inputs do not reach would not be."""
    from embedsvc.model import record

    path = tmp_path / "m.lean"
    _small_record(path)
    graph = path / "model.onnx"
    graph.write_bytes(b"GRAPH" + graph.read_bytes()[5:])  # same size
    built, ran = [], []

    def opened(path, threads, fields, before_run=None):
        built.append(path)  # the sessions are built, then ...
        before_run()
        ran.append(path)  # ... the probe runs
        return "the encoder"

    monkeypatch.setattr(lean, "open_record", opened)
    settings = Settings.from_env({"EMBEDSVC_CACHE_DIR": str(tmp_path)})
    with pytest.raises(RecordError, match="model.onnx is not the file that was recorded"):
        lean.open_lean(settings, path, "k" * 64)
    assert built and not ran

    graph.write_bytes(b"graph" * 1000)
    assert lean.open_lean(settings, path, "k" * 64) == "the encoder"
    assert ran
    fields = record.read_sized(path)
    record.Digests(path, fields).check()
    assert fields == record.read_record(path)


def test_a_failed_load_waits_for_the_digests_and_says_what_differs(tmp_path, monkeypatch):
    """No thread reads the record's files once the start has given up on it (a rebuild
    replaces them); where a file differs, that is the error, not the graph's. A record of
    other model files starts no digest at all."""
    import threading

    path = tmp_path / "m.lean"
    _small_record(path)
    (path / "probe.npz").write_bytes(b"PROBE")

    def broken(*args, **kwargs):
        raise RecordError("the probe differs")

    monkeypatch.setattr(lean, "open_record", broken)
    settings = Settings.from_env({"EMBEDSVC_CACHE_DIR": str(tmp_path)})
    with pytest.raises(RecordError, match="probe.npz is not the file"):
        lean.open_lean(settings, path, "k" * 64)
    (path / "probe.npz").write_bytes(b"probe")
    with pytest.raises(RecordError, match="the probe differs"):
        lean.open_lean(settings, path, "k" * 64)
    with pytest.raises(RecordError, match="other model files"):
        lean.open_lean(settings, path, "j" * 64)
    assert not [t for t in threading.enumerate() if t.name == "embedsvc-digests"]


def test_a_digest_that_fails_otherwise_refuses_the_record_too(tmp_path, monkeypatch):
    """The digests' thread fails closed: an error of any kind in it (here a file cut short
    between its size and its mapping) refuses the record, as in the calling thread."""
    from embedsvc.model import record

    path = tmp_path / "m.lean"
    _small_record(path)

    def cut_short(p):
        raise ValueError("cannot mmap an empty file")

    monkeypatch.setattr(record, "file_digest", cut_short)
    digests = record.Digests(path, record.read_sized(path))
    with pytest.raises(RecordError, match="does not read .*cannot mmap"):
        digests.check()


def test_a_record_file_cut_short_while_digested_is_refused_not_a_crash(tmp_path):
    """A record file truncated while a start digests it: read in blocks, it ends early and
    its digest differs (refused, the record rebuilt); mapped, the first page past its new
    end killed the whole process with SIGBUS. In a process of its own."""
    import subprocess
    import sys

    script = """
import os, sys, threading
from pathlib import Path
from embedsvc.model.record import file_digest
path = Path(sys.argv[1])
for _ in range(20):
    path.write_bytes(bytes(16 << 20))
    cut = threading.Timer(0.003, os.truncate, (path, 4096))
    cut.start()
    digest = file_digest(path)
    cut.join()
    assert len(digest) == 64
print("digested 20 files cut short meanwhile")
"""
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "graph")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-800:])
    assert "digested 20 files" in run.stdout
