"""Which runtime computes the model, PyTorch or ONNX Runtime: chosen once, in the serving process.

>>> choose_backend("embedding", "cpu", "auto").backend
'onnx'
>>> choose_backend("embedding", "cuda", "auto").backend
'torch'
>>> choose_backend("reranker", "cpu", "auto").reason
'ONNX Runtime serves embedding models here, not reranker models'
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

from ..settings import Settings, SettingsError
from . import lean
from .device import resolve_device
from .encoder import Encoder
from .graph_cache import GraphCache, cache_root
from .kinds import load_model
from .record import NotLean
from .runtime import QualityBelowFloor
from .st_encoder import SentenceTransformerEncoder

log = logging.getLogger(__name__)

# The kinds whose encoder can swap its transformer for an ONNX graph (use_forward).
ONNX_KINDS = ("embedding",)


@dataclass(frozen=True)
class Choice:
    backend: str  # "torch" or "onnx"
    reason: str


def choose_backend(kind: str, device: str, setting: str, dtype: str = "auto",
                   quantize: str = "none") -> Choice:
    """The backend for a model of ``kind`` on a resolved ``device``; SettingsError when the
    settings ask for what cannot be. ``onnx-torch`` is ``onnx`` here: whether PyTorch is
    loaded at all is lean.py's question."""
    setting = "onnx" if setting == "onnx-torch" else setting
    if setting == "onnx" and device != "cpu":
        raise SettingsError(f"BACKEND=onnx runs on the CPU, but DEVICE resolves to {device}: "
                            "set EMBEDSVC_DEVICE=cpu, or EMBEDSVC_BACKEND=auto or torch")
    if setting == "onnx" and dtype not in ("auto", "float32"):
        raise SettingsError(f"BACKEND=onnx computes in float32, not DTYPE={dtype}: set "
                            "EMBEDSVC_DTYPE=auto, or EMBEDSVC_BACKEND=torch")
    choice = _choose(kind, device, setting, dtype)
    if quantize != "none" and choice.backend != "onnx":
        raise SettingsError(f"QUANTIZE={quantize} needs ONNX Runtime on the CPU, but this "
                            f"process runs PyTorch ({choice.reason}): set EMBEDSVC_QUANTIZE=none")
    return choice


def _choose(kind: str, device: str, setting: str, dtype: str) -> Choice:
    if setting == "torch":
        return Choice("torch", "BACKEND=torch")
    if kind not in ONNX_KINDS:
        return Choice("torch", f"ONNX Runtime serves {', '.join(ONNX_KINDS)} models here, "
                               f"not {kind} models")
    if setting == "onnx":
        return Choice("onnx", "BACKEND=onnx")
    if device != "cpu":
        return Choice("torch", f"BACKEND=auto runs PyTorch on {device}")
    if dtype not in ("auto", "float32"):
        return Choice("torch", f"BACKEND=auto runs PyTorch for DTYPE={dtype}")
    return Choice("onnx", "BACKEND=auto runs ONNX Runtime on the CPU")


def load_encoder(settings: Settings, preloaded: SentenceTransformerEncoder | None = None
                 ) -> Encoder:
    """Load (unless a pre-fork master already did), pick the backend and place the model.

    On the CPU a model with a verified export record serves without PyTorch (lean.py); the
    first start of a model exports that record with PyTorch, then serves from it too. Call
    in the process that serves: ONNX Runtime sessions, like CUDA, are built after fork.
    """
    warm = lean.warm_start(settings) if preloaded is None else None
    if warm is not None and warm.encoder is not None:
        log.info("%s", warm.reason)
        return warm.encoder
    if warm is not None and not warm.export:
        log.info("backend: not the PyTorch-free path (%s)", warm.reason)
    encoder = preloaded or load_model(settings.model, settings.kind)
    device = resolve_device(settings.device)
    if (warm is None or warm.export) and lean.why_not(settings, device) is None:
        served = _serve_lean(encoder, settings)
        if served is not None:
            return served
    choice = choose_backend(encoder.kind, device, settings.backend, settings.dtype,
                            settings.quantize)
    if choice.backend == "onnx":
        _attach_onnx(encoder, settings, choice)
    else:
        log.info("backend: PyTorch on %s (%s)", device, choice.reason)
    encoder.place(device, settings.dtype)
    encoder.release_replaced()  # an ONNX-served transformer's PyTorch weights, if any
    return encoder


def _serve_lean(encoder: SentenceTransformerEncoder, settings: Settings
                ) -> lean.LeanEncoder | None:
    """The encoder of this model's record, exported now if there is none that verifies;
    None (and the reason, logged) when the model cannot be served that way."""
    from .export import build_record

    found = lean.record_path(settings)
    if found is None:
        log.info("backend: not the PyTorch-free path (the model's files are not on disk)")
        return None
    path, key = found
    if not path.exists():
        log.info("first start of %s: exporting it once to %s, so that later starts serve it "
                 "without PyTorch", encoder.info.name, path)
    try:
        served, path = record_cache(settings).get_or_build(
            path, partial(build_record, encoder, key), partial(lean.open_lean, settings,
                                                               key=key))
    except QualityBelowFloor:
        raise
    except Exception as exc:  # noqa: BLE001 - today's path still serves this model
        log.warning("backend: not the PyTorch-free path (its record failed: %s)", exc)
        return None
    if isinstance(served, NotLean):
        log.info("backend: not the PyTorch-free path (%s)", served.reason)
        return None
    lean.gate(served, settings.quantize_min_recall)
    log.info("%s", lean.startup_line(served, path))
    return served


def record_cache(settings: Settings) -> GraphCache:
    return GraphCache(cache_root(settings.cache_dir))


def _attach_onnx(encoder: SentenceTransformerEncoder, settings: Settings, choice: Choice) -> None:
    from .onnx_backend import OnnxUnavailable, attach

    try:
        log.info("%s", attach(encoder, settings))
    except OnnxUnavailable as exc:
        if settings.backend in ("onnx", "onnx-torch") or settings.quantize != "none":
            raise RuntimeError(f"BACKEND=onnx cannot serve this model: {exc}; set "
                               "EMBEDSVC_BACKEND=torch") from exc
        log.warning("backend: PyTorch on cpu, not ONNX Runtime (%s): %s", choice.reason, exc)


def export(settings: Settings) -> str:
    """What ``embedsvc export`` does: build (or find) the model's record, or where the model
    cannot be served without PyTorch the cached transformer graph; the startup line."""
    from .onnx_backend import attach

    encoder = load_model(settings.model, settings.kind)
    if lean.why_not(settings, "cpu") is None:
        served = _serve_lean(encoder, settings)
        if served is not None:
            return lean.startup_line(served, served.graph.parent)
    if encoder.kind not in ONNX_KINDS:
        raise RuntimeError(f"this {encoder.kind} model cannot be exported for the CPU (the log "
                           "says why); it serves with PyTorch")
    return attach(encoder, settings)
