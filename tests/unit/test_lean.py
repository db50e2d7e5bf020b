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
    write_record(path, {"lean": True, "files": {
        n: describe_file(path / n) for n in ("model.onnx", "probe.npz")}})


def _counted_digests(monkeypatch) -> list[str]:
    from embedsvc.model import record

    digested: list[str] = []
    real = record.file_digest
    monkeypatch.setattr(record, "file_digest", lambda p: digested.append(p.name) or real(p))
    return digested


def _long_after(monkeypatch) -> None:
    """Digests as if long after the files were written (a file written within the last
    tick of the file system's clock is not stamped)."""
    import time
    from types import SimpleNamespace

    from embedsvc.model import record

    monkeypatch.setattr(record, "time", SimpleNamespace(time_ns=lambda: time.time_ns() + 10**11))


def test_a_start_digests_only_the_record_files_changed_since_the_last_digest(tmp_path,
                                                                               monkeypatch):
    """A file digested once is not digested again while its inode, size and times are
    those stamped; rewritten in place with the same size, or replaced, it is."""
    import time as real_time

    from embedsvc.model import record

    path = tmp_path / "m.lean"
    _small_record(path)
    digested = _counted_digests(monkeypatch)
    _long_after(monkeypatch)
    record.read_record(path)
    assert sorted(digested) == ["model.onnx", "probe.npz"]
    for _ in range(2):
        record.read_record(path)
    assert sorted(digested) == ["model.onnx", "probe.npz"]  # stamped: not read again

    real_time.sleep(0.05)  # past the file system clock's tick: the write gets a new ctime
    graph = path / "model.onnx"
    graph.write_bytes(b"GRAPH" + graph.read_bytes()[5:])  # same size, same name
    with pytest.raises(RecordError, match="SHA-256 differs"):
        record.read_record(path)
    graph.write_bytes(b"graph" * 1000)
    (path / "probe.npz").rename(tmp_path / "aside")  # a new inode with the same bytes
    (tmp_path / "aside").write_bytes(b"probe")
    (tmp_path / "aside").rename(path / "probe.npz")
    digested.clear()
    record.read_record(path)
    assert sorted(digested) == ["model.onnx", "probe.npz"]


def test_a_record_file_changed_within_the_clock_tick_is_not_stamped(tmp_path):
    """A file digested just after it was written may be rewritten within the same tick of
    the file system's clock, leaving its times as they were: it is digested again."""
    from embedsvc.model import record

    path = tmp_path / "m.lean"
    _small_record(path)
    record.read_record(path)
    graph = path / "model.onnx"
    graph.write_bytes(b"GRAPH" + graph.read_bytes()[5:])
    with pytest.raises(RecordError, match="SHA-256 differs"):
        record.read_record(path)


def test_a_record_on_a_read_only_volume_is_digested_at_every_start(tmp_path, monkeypatch):
    import os

    from embedsvc.model import record

    path = tmp_path / "m.lean"
    _small_record(path)
    digested = _counted_digests(monkeypatch)
    _long_after(monkeypatch)
    monkeypatch.setattr(record.os, "replace", lambda *a: (_ for _ in ()).throw(
        OSError(30, "Read-only file system")))
    for _ in range(2):
        record.read_record(path)
    assert digested == ["model.onnx", "probe.npz"] * 2
    assert sorted(os.listdir(path)) == ["model.onnx", "probe.npz", "record.json"]
