"""Which runtime computes the model, PyTorch or ONNX Runtime: chosen once, in the serving process.

>>> choose_backend("embedding", "cpu", "auto").backend
'onnx'
>>> choose_backend("embedding", "cuda", "auto").backend
'torch'
>>> choose_backend("reranker", "cpu", "auto").reason
'ONNX Runtime serves embedding models here, not reranker models'
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ..settings import Settings, SettingsError
from . import lean
from .device import pytorch_installed, resolve_device
from .encoder import Encoder, model_name
from .graph_cache import GraphCache, cache_root
from .kinds import load_model
from .onnx_dir import Unservable, open_directory
from .onnx_dir import startup_line as directory_line
from .record import INT8, RECORD, NotLean, model_source
from .runtime import QualityBelowFloor, shipped_graph
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
    first start of a model exports that record with PyTorch, then serves from it too. An
    install without PyTorch serves the record, or the ONNX graph a model directory ships
    (onnx_dir.py), or fails in one line. Call in the process that serves: ONNX Runtime
    sessions, like CUDA, are built after fork.
    """
    if preloaded is None and not pytorch_installed():
        return _without_pytorch(settings)
    warm = lean.warm_start(settings) if preloaded is None else None
    if warm is not None and warm.encoder is not None:
        log.info("%s", warm.reason)
        return warm.encoder
    if warm is not None and not warm.export:
        log.info("backend: not the PyTorch-free path (%s)", warm.reason)
    if preloaded is None and image_text(settings):
        return serve_image_text(settings)[0]
    encoder = preloaded or load_model(settings.model, settings.kind)
    device = resolve_device(settings.device)
    if (warm is None or warm.export) and lean.why_not(settings, device) is None:
        served = _serve_lean(encoder, settings)
        if served is not None:
            return served[0]
    choice = choose_backend(encoder.kind, device, settings.backend, settings.dtype,
                            settings.quantize)
    if choice.backend == "onnx":
        _attach_onnx(encoder, settings, choice)
    else:
        log.info("backend: PyTorch on %s (%s)", device, choice.reason)
    encoder.place(device, settings.dtype)
    encoder.release_replaced()  # an ONNX-served transformer's PyTorch weights, if any
    return encoder


def _without_pytorch(settings: Settings) -> Encoder:
    """The install without PyTorch: the model's record, else the ONNX graph its directory
    ships; else RuntimeError, one line naming the extra to install or the export to run."""
    extra = "pip install 'embedsvc[torch]'"
    needs = lean.why_not(settings)
    if needs:
        raise RuntimeError(f"{needs} needs PyTorch, which this install does not have: {extra}")
    _check_quantizer(settings)
    warm = lean.warm_start(settings)
    if warm.encoder is not None:
        log.info("%s", warm.reason)
        return warm.encoder
    if not warm.export:  # its record says that it needs PyTorch, and why
        raise RuntimeError(f"{model_name(settings.model)} cannot be served without PyTorch "
                           f"({warm.reason}): {extra}")
    source = model_source(settings.model)
    why = warm.reason
    if source is not None and shipped_graph(source) is not None:
        try:
            served = open_directory(settings, source)
        except Unservable as exc:
            why = f"{why}; its own ONNX graph: {exc}"
        else:
            log.info("%s", directory_line(served))
            return served
    raise RuntimeError(
        f"this install has no PyTorch, and {model_name(settings.model)} has no export record "
        f"in {cache_root(settings.cache_dir)} ({why}): run `{_export_command(settings)}` "
        f"where 'embedsvc[torch]' is installed, then copy DIR here and set EMBEDSVC_CACHE_DIR "
        f"to it; or {extra}")


def image_text(settings: Settings) -> bool:
    """Whether MODEL is an image-text model (kinds.py), which serves from its record only."""
    from .kinds import resolve

    return resolve(settings.kind, settings.model).kind == "image-text"


def serve_image_text(settings: Settings) -> tuple[lean.LeanEncoder, Path]:
    """The encoder of an image-text model's record (image_export.py), exported with PyTorch
    on its first start, and where the record is; RuntimeError, in one line, where it cannot
    be."""
    from .image_export import build_image_record

    why = lean.why_not(settings, resolve_device(settings.device))
    if why is not None:
        raise RuntimeError(f"image-text models are served by ONNX Runtime on the CPU, not with "
                           f"{why}: set EMBEDSVC_DEVICE=cpu and EMBEDSVC_BACKEND=auto")
    found = lean.record_path(settings)
    source = model_source(settings.model)
    if found is None or source is None:
        raise RuntimeError(f"{model_name(settings.model)}'s files are not on this machine and "
                           "no record of it was exported here: set MODEL to its directory")
    path, key = found
    if not path.exists():
        log.info("first start of %s: exporting its two towers once to %s",
                 model_name(settings.model), path)
    served, path = record_cache(settings).get_or_build(
        path, partial(build_image_record, source, key, name=model_name(settings.model),
                      kind_setting=settings.kind),
        partial(lean.open_lean, settings, key=key))
    if isinstance(served, NotLean):
        raise RuntimeError(f"{model_name(settings.model)} cannot be served: {served.reason}")
    log.info("%s", lean.startup_line(served, path))
    return served, path


def _export_command(settings: Settings) -> str:
    flags = [f"--model {settings.model}" if settings.model else "",
             f"--kind {settings.kind}" if settings.kind != "auto" else "",
             f"--quantize {settings.quantize}" if settings.quantize != "none" else ""]
    return " ".join(["embedsvc export", *filter(None, flags), "--cache-dir DIR"])


def _check_quantizer(settings: Settings) -> None:
    """RuntimeError when QUANTIZE asks for an int8 record that is not there and this install
    cannot quantize (onnx, which onnxruntime's quantizer reads graphs with, is missing)."""
    if settings.quantize == "none" or importlib.util.find_spec("onnx") is not None:
        return
    found = lean.record_path(settings)
    if found is not None and (found[0] / INT8 / RECORD).is_file():
        return
    raise RuntimeError(f"QUANTIZE={settings.quantize} quantizes the model's record once, with "
                       "onnx, which this install does not have: pip install 'embedsvc[int8]', "
                       f"or run `{_export_command(settings)}` where it is installed and copy "
                       "DIR here")


def _serve_lean(encoder: SentenceTransformerEncoder, settings: Settings
                ) -> tuple[lean.LeanEncoder, Path] | None:
    """The encoder of this model's record, exported now if there is none that verifies, and
    where the record is published (a record built now was read from its temporary
    directory); None (and the reason, logged) when the model cannot be served that way."""
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
            path, partial(build_record, encoder, key, kind_setting=settings.kind),
            partial(lean.open_lean, settings, key=key))
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
    return served, path


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

    if not pytorch_installed():
        raise RuntimeError("embedsvc export builds a model's record with PyTorch, which this "
                           "install does not have: pip install 'embedsvc[torch]' where you "
                           "export (the record then serves where it is not)")
    _check_writable(cache_root(settings.cache_dir))
    if image_text(settings):
        return lean.startup_line(*serve_image_text(settings))
    encoder = load_model(settings.model, settings.kind)
    if lean.why_not(settings, "cpu") is None:
        served = _serve_lean(encoder, settings)
        if served is not None:
            return lean.startup_line(*served)
    if encoder.kind not in ONNX_KINDS:
        raise RuntimeError(f"this {encoder.kind} model cannot be exported for the CPU (the log "
                           "says why); it serves with PyTorch")
    return attach(encoder, settings)


def _check_writable(root: Path) -> None:
    """RuntimeError unless ``embedsvc export`` can publish into the cache ``root``: a record
    built for this process only would be thrown away as it exits."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        writable = os.access(root, os.W_OK | os.X_OK)
    except OSError as exc:
        raise RuntimeError(f"cannot create the cache {root} ({exc.strerror}): embedsvc export "
                           "writes the record there; choose a writable --cache-dir") from None
    if not writable:
        raise RuntimeError(f"cannot write the cache {root}: embedsvc export writes the record "
                           "there; choose a writable --cache-dir")
