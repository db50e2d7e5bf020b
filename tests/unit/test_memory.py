"""serving/memory.py: what several models will hold, on which device, weighed before they load.

No GPU here: ``nvidia-smi`` is a script on PATH that prints what a real one prints for
``--query-gpu=index,memory.free --format=csv,noheader,nounits``."""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path

import pytest

from embedsvc.serving import memory
from embedsvc.serving.memory import MemoryRefused, Need, check_apart, check_memory, need
from embedsvc.settings import Settings

MIB = 1 << 20


def safetensors(path: Path, tensors: dict[str, tuple[str, int]]) -> None:
    """A safetensors file: each tensor's dtype and bytes, its data left sparse."""
    header, offset = {}, 0
    for name, (dtype, size) in tensors.items():
        header[name] = {"dtype": dtype, "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)


def model(root: Path, name: str, f32_mib: int) -> str:
    safetensors(root / name / "model.safetensors", {"w": ("F32", f32_mib * MIB)})
    return str(root / name)


@pytest.fixture
def gpus(tmp_path, monkeypatch):
    """Set the GPUs a fake nvidia-smi reports: {index: free MiB}."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def report(free: dict[int, int]) -> None:
        rows = "\\n".join(f"{i}, {mib}" for i, mib in free.items())
        script = bin_dir / "nvidia-smi"
        script.write_text(f"#!/bin/sh\nprintf '{rows}\\n'\n")
        script.chmod(0o755)

    return report


def on(device: str, source: str) -> Settings:
    return Settings(model=source, device=device)


def test_models_on_cuda_are_weighed_as_float16_against_that_gpus_free_memory(tmp_path, gpus):
    """Before, a model's device was not asked: a CUDA model was weighed against this
    machine's memory, at its float32 size on disk."""
    models = [("a", on("cuda", model(tmp_path, "a", 600))),
              ("b", on("cuda:0", model(tmp_path, "b", 400)))]
    gpus({0: 501})
    needs = check_memory(models, available=1 << 60)
    assert needs == [Need("a", "cuda:0", "float16", 300 * MIB),
                     Need("b", "cuda:0", "float16", 200 * MIB)]
    gpus({0: 499})
    with pytest.raises(MemoryRefused) as refused:
        check_memory(models, available=1 << 60)
    assert str(refused.value) == (
        "the models on cuda:0 take 500 MiB (a 300 MiB float16, b 200 MiB float16), more than "
        "the 499 MiB free on cuda:0 (nvidia-smi): serve fewer models on it, or set one's "
        "DEVICE to another GPU")


def test_two_models_on_two_gpus_are_weighed_each_against_its_own(tmp_path, gpus):
    models = [("a", on("cuda:0", model(tmp_path, "a", 600))),
              ("b", on("cuda:1", model(tmp_path, "b", 600)))]
    gpus({0: 400, 1: 400})  # 600 MiB in all: more than either GPU, but each model fits its own
    assert [n.device for n in check_memory(models, available=1 << 60)] == ["cuda:0", "cuda:1"]
    gpus({0: 400, 1: 200})
    with pytest.raises(MemoryRefused, match=r"^the models on cuda:1 take 300 MiB \(b 300 MiB "
                                            r"float16\), more than the 200 MiB free on cuda:1"):
        check_memory(models, available=1 << 60)


def test_cuda_visible_devices_renumbers_the_gpus_as_cuda_does(tmp_path, gpus, monkeypatch):
    models = [("a", on("cuda:0", model(tmp_path, "a", 600)))]
    gpus({0: 100, 1: 400})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert check_memory(models, available=1 << 60)[0].device == "cuda:0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(MemoryRefused, match="more than the 100 MiB free on cuda:0"):
        check_memory(models, available=1 << 60)


def test_a_device_that_is_not_there_is_refused_by_name(tmp_path, gpus):
    gpus({0: 4000})
    models = [("a", on("cuda:0", model(tmp_path, "a", 6))),
              ("b", on("cuda:2", model(tmp_path, "b", 6)))]
    with pytest.raises(MemoryRefused, match=r"b set for cuda:2, which is not a GPU here "
                                            r"\(nvidia-smi lists cuda:0\)"):
        check_memory(models, available=1 << 60)


def test_without_nvidia_smi_the_cuda_models_are_not_weighed_and_one_line_says_so(
        tmp_path, gpus, caplog):
    models = [("a", on("cuda", model(tmp_path, "a", 600))),
              ("b", on("cuda", model(tmp_path, "b", 600)))]
    with caplog.at_level(logging.WARNING, logger=memory.__name__):
        needs = check_memory(models, available=1 << 60)  # the fake is not written: not found
    assert [n.size for n in needs] == [300 * MIB, 300 * MIB]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("the memory of the models on CUDA (a 300 MiB float16, b 300 "
                                  "MiB float16) is not checked: nvidia-smi did not run")


def test_nvidia_smi_that_fails_says_why():
    def run(*args, **kwargs):
        import subprocess

        return subprocess.CompletedProcess(args, 9, "", "NVIDIA-SMI has failed because it "
                                                        "couldn't communicate with the driver\n")

    assert memory.nvidia_free(run) == ("nvidia-smi failed (NVIDIA-SMI has failed because it "
                                       "couldn't communicate with the driver)")


def test_a_model_is_weighed_at_the_dtype_its_device_computes_in(tmp_path):
    """float16 weights on the CPU are held as float32; integer tensors keep their size; a
    safetensors file is counted once, not with the same weights' .bin and ONNX copies."""
    source = tmp_path / "m"
    safetensors(source / "model.safetensors", {"w": ("F16", 10 * MIB), "ids": ("I64", MIB)})
    (source / "pytorch_model.bin").write_bytes(b"\0" * MIB)
    safetensors(source / "onnx" / "model.safetensors", {"w": ("F32", 10 * MIB)})
    (source / "onnx" / "model.onnx").write_bytes(b"\0" * MIB)
    assert need("m", on("cpu", str(source)), "no GPU").size == 21 * MIB
    assert need("m", Settings(model=str(source), device="cpu", dtype="bfloat16"),
                "no GPU").size == 11 * MIB


def test_a_hub_model_in_the_hub_cache_is_weighed(tmp_path, monkeypatch):
    """Before, only a local directory counted: a hub id weighed 0 bytes."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    safetensors(repo / "snapshots" / "abc123" / "model.safetensors", {"w": ("F32", 5 * MIB)})
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert need("tiny", on("cpu", "org/tiny"), "no GPU").size == 5 * MIB
    assert need("gone", on("cpu", "org/not-cached"), "no GPU").size == 0


def test_a_model_served_from_its_export_record_weighs_what_the_record_states(tmp_path):
    """The PyTorch-free path loads the record's graph, not the directory's weights (here a
    directory with none: before, it weighed 0 bytes)."""
    from embedsvc.model.lean import record_path

    source = tmp_path / "m"
    source.mkdir()
    (source / "config.json").write_text("{}")
    settings = Settings(model=str(source), device="cpu", cache_dir=str(tmp_path / "cache"))
    found = record_path(settings)
    assert found is not None
    found[0].mkdir(parents=True)
    (found[0] / "record.json").write_text(json.dumps({"lean": True,
                                                      "info": {"size_bytes": 7 * MIB}}))
    assert need("m", settings, "no GPU") == Need("m", memory.HOST, "float32", 7 * MIB)


def test_the_bundled_model_is_weighed():
    """Before, the bundled model (MODEL empty) weighed 0 bytes: all-MiniLM-L6-v2 has 22.7M
    parameters, 87 MiB in float32, in its export record or its weights."""
    assert 80 * MIB < need("embedder", on("cpu", ""), "no GPU").size < 95 * MIB


def test_models_that_do_not_fit_this_machine_are_refused_in_one_line(tmp_path):
    models = [("a", on("cpu", model(tmp_path, "a", 3))), ("b", on("cpu", model(tmp_path, "b", 2)))]
    assert sum(n.size for n in check_memory(models, available=6 * MIB)) == 5 * MIB
    with pytest.raises(MemoryRefused) as refused:
        check_memory(models, available=4 * MIB)
    assert str(refused.value) == (
        "the models' weights take 5 MiB (a 3 MiB float32, b 2 MiB float32), more than the 4 MiB "
        "this machine has available: serve fewer models here, or give it more memory")


def huge(root: Path, name: str, size: int = 1 << 42) -> str:
    """A model directory whose weights are more than any machine here has (sparse: no disk)."""
    (root / name).mkdir()
    with open(root / name / "pytorch_model.bin", "wb") as f:
        f.truncate(size)
    return str(root / name)


def test_the_check_apart_answers_the_refusal_or_logs_the_sizes(tmp_path, caplog):
    """The check as a program of its own (a gunicorn worker's, and waitress-serve's)."""
    several = f"a={huge(tmp_path, 'a')},b={huge(tmp_path, 'b')}"
    refusal = check_apart(Settings(models=several, device="cpu"))
    assert refusal is not None and refusal.startswith(
        "the models' weights take 8388608 MiB (a 4194304 MiB float32, b 4194304 MiB float32), "
        "more than the ")
    small = f"a={model(tmp_path, 'c', 1)},b={model(tmp_path, 'd', 2)}"
    with caplog.at_level(logging.INFO, logger=memory.__name__):
        assert check_apart(Settings(models=small, device="cpu")) is None
    assert ("the models' weights: a 1 MiB float32 on this machine, b 2 MiB float32 on this "
            "machine; 3 MiB in all") in caplog.messages


def test_an_app_loaded_outside_gunicorn_refuses_models_that_do_not_fit(tmp_path):
    """waitress-serve loads ``embedsvc:app`` before it listens: the refusal stops it there.
    Before, only `embedsvc serve` weighed the models."""
    from embedsvc.serving.preflight import PreflightError
    from embedsvc.serving.process import LazyApp

    several = f"a={huge(tmp_path, 'a')},b={huge(tmp_path, 'b')}"
    with pytest.raises(PreflightError, match="^the models' weights take 8388608 MiB") as refused:
        LazyApp(env={"EMBEDSVC_MODELS": several, "EMBEDSVC_DEVICE": "cpu"})
    assert refused.value.exit_code == 1


def test_gunicorns_workers_weigh_the_models_once_a_master(tmp_path, monkeypatch):
    """Once the engines run, their memory is taken: a worker that starts later (or replaces
    another) must not weigh the models again, or it would refuse a service that fits."""
    import shutil

    from embedsvc.remote.place import owner_dir
    from embedsvc.serving import shared_engine

    calls = []
    monkeypatch.setattr(memory, "check_apart", lambda settings: calls.append(settings))
    master = os.getpid()  # a master's pid that no engine uses
    try:
        for _ in range(3):
            shared_engine.check_memory_once(Settings(models="a=,b="), master)
        assert len(calls) == 1
    finally:
        shutil.rmtree(owner_dir(master), ignore_errors=True)


@pytest.mark.parametrize("header", [b"[1]", b"5", b'"x"',
                                    b'{"w": {"dtype": "F32", "data_offsets": [100, 0]}}'])
def test_a_safetensors_header_that_does_not_read_weighs_the_files_size(tmp_path, header):
    """A header that is not a table of tensors, or a tensor that ends before it starts,
    is weighed as the file's size: never a traceback at start, never a size below 0 that
    would hide another model's."""
    path = tmp_path / "m" / "model.safetensors"
    path.parent.mkdir()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 990)
    assert memory.weights_bytes(path.parent, "float32") == 8 + len(header) + 990
