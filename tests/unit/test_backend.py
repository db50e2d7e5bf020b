"""The backend choice: a function of (kind, device, settings), refusing what cannot be."""

import pytest

from embedsvc.model.backend import choose_backend
from embedsvc.settings import Settings, SettingsError


@pytest.mark.parametrize(
    ("kind", "device", "setting", "dtype", "expected"),
    [
        ("embedding", "cpu", "auto", "auto", "onnx"),
        ("embedding", "cpu", "auto", "float32", "onnx"),
        ("embedding", "cpu", "auto", "bfloat16", "torch"),
        ("embedding", "cuda", "auto", "auto", "torch"),
        ("embedding", "cuda:1", "auto", "auto", "torch"),
        ("embedding", "mps", "auto", "auto", "torch"),
        ("embedding", "cpu", "torch", "auto", "torch"),
        ("embedding", "cpu", "onnx", "auto", "onnx"),
        ("reranker", "cpu", "auto", "auto", "torch"),
        ("reranker", "cpu", "onnx", "auto", "torch"),
    ],
)
def test_choice(kind, device, setting, dtype, expected):
    choice = choose_backend(kind, device, setting, dtype)
    assert choice.backend == expected
    assert choice.reason


def test_a_kind_without_onnx_support_says_why_it_falls_back():
    assert "not reranker models" in choose_backend("reranker", "cpu", "onnx").reason


@pytest.mark.parametrize(
    ("device", "setting", "dtype", "quantize", "named"),
    [
        ("cuda", "onnx", "auto", "none", "EMBEDSVC_DEVICE=cpu"),
        ("cpu", "onnx", "float16", "none", "EMBEDSVC_DTYPE"),
        ("cuda", "auto", "auto", "int8", "EMBEDSVC_QUANTIZE=none"),
        ("cpu", "torch", "auto", "int8", "EMBEDSVC_QUANTIZE=none"),
    ],
)
def test_impossible_combinations_fail_naming_the_fix(device, setting, dtype, quantize, named):
    with pytest.raises(SettingsError, match=named):
        choose_backend("embedding", device, setting, dtype, quantize)


def test_settings_parse_the_new_fields():
    s = Settings.from_env({"EMBEDSVC_BACKEND": "ONNX", "EMBEDSVC_QUANTIZE": "int8",
                           "EMBEDSVC_QUANTIZE_MIN_RECALL": "0.995", "EMBEDSVC_ONNX_THREADS": "1"})
    assert (s.backend, s.quantize, s.quantize_min_recall, s.onnx_threads) == (
        "onnx", "int8", 0.995, 1)
    for name, bad in (("backend", "tensorrt"), ("quantize", "int4"),
                      ("quantize_min_recall", "1.5")):
        with pytest.raises(SettingsError, match=name.upper()):
            Settings(**{name: bad})


def test_export_refuses_a_cache_it_cannot_write_before_loading_the_model(tmp_path,
                                                                        monkeypatch):
    from embedsvc.model import backend

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded for a record that would be thrown away")

    monkeypatch.setattr(backend, "pytorch_installed", lambda: True, raising=False)
    monkeypatch.setattr(backend, "load_model", loaded)
    (tmp_path / "a-file").write_text("")
    settings = Settings(cache_dir=str(tmp_path / "a-file" / "cache"))  # mkdir cannot succeed
    with pytest.raises(RuntimeError, match="choose a writable --cache-dir"):
        backend.export(settings)
