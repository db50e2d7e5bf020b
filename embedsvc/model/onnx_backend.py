"""ONNX Runtime in place of a sentence-transformers model's transformer, on the CPU.

The graph computes what the model's first module computes: token embeddings from token ids
and the attention mask. Tokenizing, special tokens, truncation, pooling and any layer after
pooling stay the model's own (``SentenceTransformerEncoder.use_forward``), so the vectors are
PyTorch's. The graph is exported once with ``torch.onnx.export`` and cached by the content
of the weights (graph_cache.py); a model directory that ships ``onnx/model.onnx`` is used as
it is. Every graph, cached or shipped, must reproduce PyTorch's vectors on a probe batch
before it serves; an int8 graph must keep QUANTIZE_MIN_RECALL of float32's neighbours on the
calibration set.

Sessions are built only in the process that serves (after any fork): ONNX Runtime's thread
pools do not survive a fork.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ..settings import Settings
from . import runtime
from .graph_cache import GraphCache, cache_root
from .quantize import calibration_texts
from .record import file_digest
from .runtime import Quality, QualityBelowFloor, available_cpus, run_sliced
from .st_encoder import SentenceTransformerEncoder

log = logging.getLogger(__name__)

# The TorchScript exporter (dynamo=False): it exports all-MiniLM-L6-v2 in ~4 s with no extra
# dependency; the torch.export-based one took ~17 s and needs onnxscript, for the same vectors
# and speed. Bump FORMAT whenever what a cached file holds changes.
EXPORTER = "torchscript"
OPSET = 17
FORMAT = 1
PARITY = 0.9999  # minimum cosine to PyTorch on the probe batch for a float32 graph
_BROKEN = 0.5  # mean cosine to float32 under which an int8 file is damaged, not just lossy
_PROBE = ["a probe", "a longer probe sentence, so that the batch holds padding", "x"]


class OnnxUnavailable(RuntimeError):
    """This model cannot run on ONNX Runtime here; the message says why."""


class OnnxForward:
    """The transformer's forward on an ``onnxruntime.InferenceSession``.

    ``InferenceSession.run`` releases the GIL, so request threads go on while it computes.
    """

    def __init__(self, session: Any, output_key: str) -> None:
        self.session = session
        self.inputs = [i.name for i in session.get_inputs()]
        self.output_key = output_key
        self._output = _output_name(session)

    def __call__(self, features: dict[str, Any]) -> dict[str, Any]:
        import torch

        feeds = {name: features[name].numpy() for name in self.inputs}
        features[self.output_key] = torch.from_numpy(run_sliced(self.session, self._output,
                                                                 feeds))
        return features


def attach(encoder: SentenceTransformerEncoder, settings: Settings) -> str:
    """Run ``encoder``'s transformer on ONNX Runtime, int8 if QUANTIZE says so.

    Returns the startup line; raises OnnxUnavailable when this model cannot run there, and
    QualityBelowFloor when its int8 graph falls below QUANTIZE_MIN_RECALL.
    """
    output_key = _check_exportable(encoder)
    cache = GraphCache(cache_root(settings.cache_dir))
    threads = settings.onnx_threads or available_cpus()
    fp32, path, key = _float32(encoder, output_key, cache, threads)
    _quiet_torch()
    if settings.quantize == "none":
        encoder.use_forward(fp32, "onnx", "float32")
        return (f"backend: ONNX Runtime float32 on the CPU, {threads} intra-op threads, "
                f"graph {path}")
    if not path.exists():  # built in memory: the cache cannot be written (graph_cache.py)
        raise OnnxUnavailable(f"QUANTIZE={settings.quantize} quantizes the float32 graph from "
                              f"the cache, which this process cannot write ({path.parent}): "
                              "set CACHE_DIR to a writable directory")
    int8, path, quality = _int8(encoder, fp32, (path, key), cache, threads,
                                settings.quantize_min_recall)
    encoder.use_forward(int8, "onnx", "int8")
    return (f"backend: ONNX Runtime on the CPU, serving a model quantized to int8 "
            f"(QUANTIZE=int8), {threads} intra-op threads; recall@10 against float32 "
            f"{quality.recall:.3f} on {quality.texts} calibration texts (floor "
            f"QUANTIZE_MIN_RECALL={settings.quantize_min_recall}), cosine mean "
            f"{quality.mean:.4f}; graph {path}")


def _quiet_torch() -> None:
    """One PyTorch thread from here on: what PyTorch still computes beside the graph
    (pooling, normalising) is too small to split, and its idle pool threads would spin on the
    cores ONNX Runtime's threads need (offline on 2 cores: 379 sentences/s against 353)."""
    import torch

    torch.set_num_threads(1)


def _check_exportable(encoder: SentenceTransformerEncoder) -> str:
    """The first module's output key, or OnnxUnavailable saying why it cannot be exported."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise OnnxUnavailable(f"onnxruntime does not import ({exc}): pip install onnxruntime") \
            from exc
    module = encoder.input_module
    name = type(module).__name__
    if name != "Transformer" or not hasattr(module, "model"):
        raise OnnxUnavailable(f"the model's first module is {name}, not a Transformer")
    modality = getattr(module, "modality_config", {"text": {}})
    if "text" not in modality:
        raise OnnxUnavailable(f"the model's transformer takes {sorted(modality)}, not text")
    return str(getattr(module, "module_output_name", "token_embeddings"))


def _float32(encoder: SentenceTransformerEncoder, output_key: str, cache: GraphCache,
             threads: int) -> tuple[OnnxForward, Path, str]:
    """The verified float32 forward, its graph's path and the key of its content."""
    verified = partial(_verified, encoder, output_key, threads)
    shipped = runtime.shipped_graph(Path(encoder.source)) if encoder.source else None
    if shipped is not None:
        try:
            return verified(shipped), shipped, file_digest(shipped)
        except Exception as exc:  # noqa: BLE001 - any failure: export our own instead
            log.warning("%s is not used: %s; exporting the model instead", shipped, exc)
    key = model_key(encoder.input_module)
    path = cache.path(encoder.info.name, key)
    forward, path = cache.get_or_build(path, partial(export_graph, encoder), verified)
    return forward, path, key


def _int8(encoder: SentenceTransformerEncoder, fp32: OnnxForward, source: tuple[Path, str],
          cache: GraphCache, threads: int, floor: float) -> tuple[OnnxForward, Path, Quality]:
    """The int8 forward quantized from the float32 graph ``source`` (path, key), its path
    and its quality on the calibration set, measured at every start (this path keeps no
    record); QualityBelowFloor under ``floor``."""
    batch = [encoder.wrap(ids[: encoder.info.max_input_tokens - encoder.special_tokens])
             for ids in encoder.tokenize(calibration_texts())]
    reference = _encode_sorted(encoder, fp32, batch)

    def load(path: Path) -> tuple[OnnxForward, Quality]:
        forward = OnnxForward(runtime.session(path, threads), fp32.output_key)
        quality = runtime.quality(reference, _encode_sorted(encoder, forward, batch))
        if quality.mean < _BROKEN:  # a damaged file, not the cost of quantizing: rebuild it
            raise ValueError(f"its vectors are unrelated to float32's: cosine {quality.mean:.3f}")
        return forward, quality

    key = hashlib.sha256(f"{source[1]}|int8-dynamic-per-channel|{FORMAT}".encode()).hexdigest()
    path = cache.path(encoder.info.name + "-int8", key)
    (forward, quality), path = cache.get_or_build(path, partial(quantize_graph, source[0]), load)
    if quality.recall < floor:
        raise QualityBelowFloor(
            f"QUANTIZE=int8 refused: its vectors keep {quality.recall:.3f} of float32's 10 "
            f"nearest neighbours on the {quality.texts} calibration texts, below "
            f"QUANTIZE_MIN_RECALL={floor}; serve with QUANTIZE=none, or lower "
            "EMBEDSVC_QUANTIZE_MIN_RECALL")
    return forward, path, quality


def _verified(encoder: SentenceTransformerEncoder, output_key: str, threads: int,
              path: Path) -> OnnxForward:
    """A forward on the graph at ``path``, once its vectors match PyTorch's on a probe."""
    forward = OnnxForward(runtime.session(path, threads), output_key)
    missing = set(forward.inputs) - set(encoder.input_names)
    if missing:
        raise OnnxUnavailable(f"the graph at {path} needs inputs {sorted(missing)}")
    batch = [encoder.wrap(ids) for ids in encoder.tokenize(_PROBE)]
    quality = runtime.quality(encoder.encode_with(None, batch), encoder.encode_with(forward, batch))
    if quality.min < PARITY:
        raise ValueError(f"its vectors differ from PyTorch's: cosine {quality.min:.6f}")
    return forward


def _encode_sorted(encoder: SentenceTransformerEncoder, forward: OnnxForward,
                   batch: list[list[int]], size: int = 32) -> np.ndarray:
    """Rows for ``batch`` in its order, computed in batches of similar length: padding every
    text to the longest would multiply the start-up cost of the quality check."""
    order = sorted(range(len(batch)), key=lambda i: len(batch[i]))
    rows = np.empty((len(batch), encoder.info.dimension), dtype=np.float32)
    for start in range(0, len(order), size):
        chunk = order[start:start + size]
        rows[chunk] = encoder.encode_with(forward, [batch[i] for i in chunk])
    return rows


def _output_name(session: Any) -> str:
    name = runtime.token_output(session)
    if name is None:
        outputs = [o.name for o in session.get_outputs()]
        raise OnnxUnavailable(f"no token-embedding output among {outputs}")
    return name


def model_key(module: Any) -> str:
    """A hash of the transformer's weights and configuration, and of what exports them."""
    import torch
    import transformers

    config = module.model.config.to_dict()
    config.pop("_name_or_path", None)  # where the model lies is not what it computes
    h = hashlib.sha256(json.dumps([
        FORMAT, EXPORTER, OPSET, torch.__version__, transformers.__version__,
        type(module.model).__name__, repr(module), config,
    ], sort_keys=True, default=str).encode())
    for name, tensor in module.state_dict().items():
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)}".encode())
        h.update(flat.view(torch.uint8).numpy())
    return h.hexdigest()


def export_graph(encoder: SentenceTransformerEncoder, path: Path) -> None:
    """Write the transformer of ``encoder`` (weights on the CPU, float32) as ONNX to ``path``."""
    import torch

    names = encoder.input_names
    module = encoder.input_module
    key = str(getattr(module, "module_output_name", "token_embeddings"))
    graph = _graph_module(module, names, key)
    features = encoder.features([encoder.wrap(ids) for ids in encoder.tokenize(_PROBE[:2])])
    axes = {name: {0: "batch", 1: "sequence"} for name in [*names, key]}
    log.info("exporting %s to ONNX, once: later starts read it from the cache",
             encoder.info.name)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer notes about shapes the probe fixes for good
        torch.onnx.export(graph, tuple(features[n] for n in names), str(path),
                          input_names=names, output_names=[key], dynamic_axes=axes,
                          opset_version=OPSET, dynamo=False)


def quantize_graph(source: Path, path: Path) -> None:
    """Dynamic int8 quantization, per channel, of the float32 graph at ``source``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    log.info("quantizing %s to int8, once: later starts read it from the cache", source.name)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # it advises pre-processing through the root logger
    try:
        quantize_dynamic(source, path, per_channel=True, weight_type=QuantType.QInt8)
    finally:
        root.setLevel(level)


def _graph_module(module: Any, names: list[str], key: str) -> Any:
    """What is exported: the model's own first module, called with positional tensors."""
    import torch

    class Graph(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = module

        def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
            return self.module(dict(zip(names, tensors, strict=True)))[key]

    return Graph().eval()
