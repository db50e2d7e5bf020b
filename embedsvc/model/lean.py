"""Serving without PyTorch: tokenizers, ONNX Runtime and numpy, from an export record.

A warm start on the CPU reads the model's record (record.py), checks its files, builds one
ONNX Runtime session on its graph and runs the recorded probe inputs through it: the outputs
must be PyTorch's, as export.py recorded them, or the record is rebuilt with PyTorch and
never served. Nothing here imports torch, transformers or sentence-transformers, even
indirectly (tests/unit/test_lean.py checks it in a fresh interpreter).

The encoders implement the Encoder interface as the sentence-transformers ones do, with the
same tokenizer code (``TextSide``), so token windows, pieces and truncation are identical:

- ``LeanEncoder``: embedding models (``encode``, ``encode_tokens``, ``decode``);
- ``LeanScorer``: rerankers and classifiers (logits; ``activate`` as ``CrossEncoder.predict``);
- ``LeanSparse``: SPLADE (the graph ends in log1p(relu) and max pooling over the mask).
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ..settings import Settings
from ..work import Pair, Pixels, Sequenced
from . import runtime
from .device import pytorch_installed
from .encoder import Encoder, ModelInfo, model_name
from .graph_cache import GraphCache, cache_root
from .pairs import tokenize_pairs
from .quantize import calibration_texts
from .record import (
    GRAPH,
    INT8,
    PROBE,
    TOKENIZER,
    VISION,
    Digests,
    NotLean,
    RecordError,
    compare,
    describe_file,
    find_exported,
    fingerprint,
    model_source,
    read_record,
    read_sized,
    write_record,
)
from .scorer import segment_ids
from .sparse import sparse_batch_tokens
from .tokenizer import TextSide, padded, tokenizer_from_json

log = logging.getLogger(__name__)

_BROKEN = 0.5  # mean cosine to float32 under which an int8 graph is damaged, not just lossy
_ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Identity": lambda x: x,
    "Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "Tanh": np.tanh,
    "ReLU": lambda x: np.maximum(x, 0.0),
}


@dataclass(frozen=True)
class Warm:
    """What a start found: an encoder to serve, or why not (and whether exporting helps)."""

    encoder: Encoder | None
    reason: str
    export: bool = False  # True: no usable record yet; PyTorch can build one


class LeanEncoder(TextSide):
    """An embedding model's pipeline on one ONNX Runtime session.

    Example (``path`` is a record directory that export.py wrote)::

        enc = open_record(path, threads=2)
        rows = enc.encode([enc.wrap(ids) for ids in enc.tokenize(["a text"])])
    """

    kind = "embedding"
    output = "sentence_embedding"

    quality: runtime.Quality | None = None  # an int8 graph's against float32's (QUANTIZE)

    def __init__(self, path: Path, record: dict[str, Any], session: Any, precision: str) -> None:
        tok = record["tokenizer"]
        self.kind = record["kind"]  # a scorer's: reranker or classifier
        self._text = (path / TOKENIZER).read_text(encoding="utf-8")
        self._use_tokenizer(tokenizer_from_json(self._text))
        if [self._prefix, self._suffix] != [tok["prefix"], tok["suffix"]]:
            raise RecordError("tokenizer.json's template differs from the recorded one")
        self._pad_id = int(tok["pad_id"])
        self._token_types = bool(tok["token_types"])
        self._session = session
        self.graph = path / GRAPH
        self.weights: str = record["weights"]  # float16 where export.py could store them so
        self.probe_inputs: list[Any] = []
        info = record["info"]
        self.info = ModelInfo(**{**info, "labels": tuple(info["labels"])}, kind=record["kind"],
                              device="cpu", dtype=precision, backend="onnx")
        if "token_embeddings" in {o.name for o in session.get_outputs()}:
            self.encode_tokens = self._encode_tokens  # optional in the Encoder interface

    def batch_tokens(self, max_batch_tokens: int) -> int:
        """The batcher's batches on the CPU: at most one session run (``runtime.run_tokens``)."""
        return runtime.run_tokens(self.info, max_batch_tokens)

    def encode(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        return runtime.run_sliced(self._session, self.output, self.features(batch))

    def _encode_tokens(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        rows = runtime.run_sliced(self._session, "token_embeddings", self.features(batch))
        return [rows[row, : len(ids)] for row, ids in enumerate(batch)]

    def features(self, batch: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
        """The graph's inputs for ``batch`` (wrapped ids), as the sentence-transformers
        encoder pads them."""
        input_ids, mask = padded(batch, self._pad_id)
        feeds = {"input_ids": input_ids, "attention_mask": mask}
        if self._token_types:
            feeds["token_type_ids"] = segment_ids(batch, input_ids.shape)
        return feeds

    def probe_batch(self, inputs: Sequence[Any]) -> list[list[int]]:
        """The recorded probe inputs (texts) as this encoder's wrapped ids."""
        return [self.wrap(ids) for ids in self.tokenize(list(inputs))]

    def probe_outputs(self, names: Sequence[str], feeds: dict[str, np.ndarray],
                      recorded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This encoder's outputs of ``names`` for the probe (``feeds``: the probe texts' graph
        inputs; ``recorded``: the probe file's arrays), none for an array that is an input.
        The graph's outputs come from one run: each run costs a start as much as the first
        (0.017 CPU-seconds for the bundled model's probe)."""
        names = list(names)
        return dict(zip(names, self._session.run(names, feeds), strict=True)) if names else {}

    def quantized(self, path: Path, session: Any) -> LeanEncoder:
        """The same model on another session (its int8 graph at ``path``)."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin._session, twin.graph = session, path
        twin.info = ModelInfo(**{**self.info.__dict__, "dtype": "int8"})
        if hasattr(self, "encode_tokens"):
            twin.encode_tokens = twin._encode_tokens
        return twin


class LeanSparse(LeanEncoder):
    """SPLADE on ONNX Runtime: rows as wide as the vocabulary."""

    kind = "sparse"

    def __init__(self, path: Path, record: dict[str, Any], session: Any, precision: str) -> None:
        super().__init__(path, record, session, precision)
        self.max_active_dims: int | None = record["pipeline"].get("max_active_dims")

    def batch_tokens(self, max_batch_tokens: int) -> int:
        return sparse_batch_tokens(self.info, super().batch_tokens(max_batch_tokens))


class LeanScorer(LeanEncoder):
    """A cross-encoder on ONNX Runtime: raw logits, one column per label."""

    kind = "reranker"
    output = "scores"

    def __init__(self, path: Path, record: dict[str, Any], session: Any, precision: str) -> None:
        super().__init__(path, record, session, precision)
        self._truncate_at = int(record["tokenizer"]["truncate_at"])
        self._activation = _ACTIVATIONS[record["pipeline"]["activation"]]

    def tokenize_sequences(self, inputs: Sequence[Sequenced], direction: str | None
                           ) -> list[Pair]:
        """As ``CrossEncoderScorer.tokenize_sequences``: see there."""
        return tokenize_pairs(self, self._truncate_at, inputs, direction)

    def activate(self, rows: np.ndarray, raw: bool) -> np.ndarray:
        """As ``CrossEncoderScorer.activate``: the model's activation, then a softmax across
        several labels; ``raw``: the logits."""
        if raw:
            return rows
        scores = self._activation(rows.astype(np.float32))
        if scores.shape[1] > 1:
            scores = np.exp(scores - scores.max(axis=1, keepdims=True))
            scores /= scores.sum(axis=1, keepdims=True)
        return scores.astype(np.float32)

    def probe_outputs(self, names: Sequence[str], feeds: dict[str, np.ndarray],
                      recorded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        got = super().probe_outputs([n for n in names if n != "activated"], feeds, recorded)
        if "activated" in names:
            got["activated"] = self.activate(recorded[self.output], raw=False)
        return got

    def probe_batch(self, inputs: Sequence[Any]) -> list[list[int]]:
        return list(self.tokenize_sequences([tuple(i) if isinstance(i, list) else i
                                             for i in inputs], None))


class LeanImageText(LeanEncoder):
    """An image-text model (CLIP, SigLIP): two towers, ``model.onnx`` (ids, mask ->
    text_embeds) and ``vision.onnx`` (pixels -> image_embeds), texts and images into one space.

    The fronts decode and preprocess images (image/) into ``Pixels``; the batcher holds them
    beside texts' ids, each image counting as many tokens as its tower's patches
    (``ModelInfo.image_tokens``). ``encode`` runs each tower once a batch, on its own inputs
    (images batch with images, texts with texts) and returns the rows in the batch's order.
    The model's quirks are its record's, as image_export.py read them from its config:
    SigLIP pads texts to a fixed length and attends to the padding (its processor gives no
    mask), so a text's vector never depends on its batch-mates; CLIP pads to the longest."""

    output = "text_embeds"

    def __init__(self, path: Path, record: dict[str, Any], session: Any, precision: str) -> None:
        super().__init__(path, record, session, precision)
        towers = record["towers"]
        self.text_length: int | None = towers["text_length"]  # pad every text to it
        self.text_mask: bool = towers["text_mask"]  # False: the tower attends to padding
        self.info = dataclasses.replace(self.info, modalities=tuple(self.info.modalities))
        threads = session.get_session_options().intra_op_num_threads
        self._vision = runtime.session(path / VISION, threads)

    towers: Any = None  # the Metrics that count each tower's inputs and seconds (service.py)

    def encode(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        images = [i for i, item in enumerate(batch) if isinstance(item, Pixels)]
        if not images:
            return self._texts(batch)
        pixels = np.stack([batch[i].array for i in images])  # type: ignore[attr-defined]
        if len(images) == len(batch):
            return self.embed_pixels(pixels)
        rows = np.empty((len(batch), self.info.dimension), np.float32)
        taken = set(images)
        texts = [i for i in range(len(batch)) if i not in taken]
        rows[texts] = self._texts([batch[i] for i in texts])
        rows[images] = self.embed_pixels(pixels)
        return rows

    def embed_pixels(self, pixels: np.ndarray) -> np.ndarray:
        """Raw rows of a float32 NCHW batch, as image/preprocess.py makes it."""
        started = time.monotonic()
        (out,) = self._vision.run(None, {"pixel_values": pixels.astype(np.float32, copy=False)})
        self._count("image", len(pixels), time.monotonic() - started)
        return out.astype(np.float32, copy=False)

    def _texts(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        started = time.monotonic()
        rows = runtime.run_sliced(self._session, self.output, self.features(batch))
        self._count("text", len(batch), time.monotonic() - started)
        return rows

    def _count(self, modality: str, inputs: int, seconds: float) -> None:
        if self.towers is not None:
            self.towers.modality_inputs.labels(modality).inc(inputs)
            self.towers.modality_seconds.labels(modality).inc(seconds)

    def features(self, batch: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
        ids, mask = padded(batch, self._pad_id)
        if self.text_length is not None and ids.shape[1] < self.text_length:
            extra = ((0, 0), (0, self.text_length - ids.shape[1]))
            ids = np.pad(ids, extra, constant_values=self._pad_id)
            mask = np.pad(mask, extra, constant_values=0)
        if not self.text_mask:
            mask = np.ones_like(mask)
        return {"input_ids": ids, "attention_mask": mask}

    def probe_outputs(self, names: Sequence[str], feeds: dict[str, np.ndarray],
                      recorded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # pixels: the probe's images, an input
        texts = [n for n in names if n not in ("pixels", "image_embeds")]
        got = super().probe_outputs(texts, feeds, recorded)
        if "image_embeds" in names:
            got["image_embeds"] = self.embed_pixels(recorded["pixels"])
        return got


def activation_names() -> tuple[str, ...]:
    """The cross-encoder activations this path computes (export.py refuses others)."""
    return tuple(_ACTIVATIONS)


def _encoder_class(kind: str) -> type[LeanEncoder]:
    return {"embedding": LeanEncoder, "sparse": LeanSparse,
            "image-text": LeanImageText}.get(kind, LeanScorer)


def open_record(path: Path, threads: int, record: dict[str, Any] | None = None,
                before_run: Callable[[], None] | None = None) -> LeanEncoder | NotLean:
    """The float32 encoder of the record at ``path``, once its graph reproduces PyTorch's
    probe outputs; RecordError (or ONNX Runtime's error) for a record not to serve.
    ``record``: its ``read_record``, when the caller has it (each read digests every file);
    ``before_run``: called once the sessions are built, before the graph first runs (the
    probe): ``Digests.check`` where the caller's record is ``read_sized``'s."""
    record = record if record is not None else read_record(path)
    if not record.get("lean"):
        return NotLean(str(record.get("reason", "the record says so")))
    encoder = _encoder_class(record["kind"])(path, record, runtime.session(path / GRAPH, threads),
                                             "float32")
    if before_run is not None:
        before_run()
    verify(encoder, record, path / PROBE, "PyTorch's")
    encoder.probe_inputs = record["probe"]["inputs"]
    return encoder


def verify(encoder: LeanEncoder, record: dict[str, Any], probe: Path, whose: str) -> None:
    """RecordError unless ``encoder`` tokenizes the probe as recorded and its graph gives the
    outputs recorded in ``probe``."""
    inputs = record["probe"]["inputs"]
    batch = encoder.probe_batch(inputs)
    if [list(ids) for ids in batch] != record["probe"]["ids"]:
        raise RecordError("the tokenizer does not give the recorded probe ids")
    with np.load(probe) as recorded:
        want = {name: recorded[name] for name in recorded.files}
    lengths = [len(ids) for ids in batch]
    outputs = encoder.probe_outputs(list(want), encoder.features(batch), want)
    for name, got in outputs.items():
        value = want[name]
        compare(got, value, f"the graph's {name} (against {whose})",
                lengths if value.ndim == 3 else None)


def why_not(settings: Settings, device: str | None = None) -> str | None:
    """Why these settings keep this process off the PyTorch-free path, or None.

    ``device``: the resolved device, once known; before, DEVICE=auto counts as the CPU
    (``warm_start`` asks ``accelerator_present`` too).
    """
    if settings.backend in ("torch", "onnx-torch"):
        return f"BACKEND={settings.backend}"
    if settings.dtype not in ("auto", "float32"):
        return f"DTYPE={settings.dtype} (this path computes in float32)"
    if device is not None:
        return None if device == "cpu" else f"the device is {device}"
    if settings.device not in ("auto", "cpu"):
        return f"DEVICE={settings.device}"
    return None


def accelerator_present() -> bool:
    """Whether PyTorch might find a CUDA, ROCm or MPS device here (never without PyTorch)."""
    if not pytorch_installed():
        return False
    if platform.system() == "Darwin":
        return platform.machine() == "arm64"
    dev = Path("/dev")
    return (dev / "nvidiactl").exists() or (dev / "kfd").exists() or any(dev.glob("nvidia[0-9]*"))


def record_path(settings: Settings) -> tuple[Path, str] | None:
    """Where the record of MODEL, served as KIND, lies, and its fingerprint. Where the model
    is not on disk, the newest record of its name made elsewhere (None: none either)."""
    cache = GraphCache(cache_root(settings.cache_dir))
    name = model_name(settings.model)
    source = model_source(settings.model)
    if source is None:
        return find_exported(cache.named(name, ".lean"), settings.kind)
    key = fingerprint(source, settings.kind)
    return cache.path(name, key, ".lean"), key


def recorded(settings: Settings) -> bool:
    """Whether a start would serve from a record (its files checked, not yet its graph)."""
    lean = why_not(settings) is None and not (settings.device == "auto"
                                               and accelerator_present())
    found = record_path(settings) if lean else None
    try:
        return found is not None and bool(read_record(found[0]).get("lean"))
    except RecordError:
        return False


def threads_for(settings: Settings) -> int:
    return settings.onnx_threads or runtime.available_cpus()


def warm_start(settings: Settings) -> Warm:
    """The encoder of this model's verified record, without PyTorch; or why not."""
    why = why_not(settings)
    if why:
        return Warm(None, why)
    if settings.device == "auto" and accelerator_present():  # PyTorch resolves the device
        return Warm(None, "DEVICE=auto on a machine with a GPU device", export=True)
    found = record_path(settings)
    if found is None:
        return Warm(None, f"neither {model_name(settings.model)}'s files nor a record of it "
                          "are here", export=True)
    path, key = found
    if not path.exists():
        return Warm(None, f"first start of {model_name(settings.model)}: nothing exported yet",
                    export=True)
    try:
        encoder = open_lean(settings, path, key)
    except Exception as exc:  # noqa: BLE001 - any failure: the record is rebuilt, not served
        log.warning("the record %s does not verify (%s); rebuilding it with PyTorch", path, exc)
        return Warm(None, f"its record {path.name} did not verify", export=True)
    if isinstance(encoder, NotLean):
        return Warm(None, encoder.reason)
    gate(encoder, settings.quantize_min_recall)
    return Warm(encoder, startup_line(encoder, path))


def open_lean(settings: Settings, path: Path, key: str) -> LeanEncoder | NotLean:
    """The record's encoder, int8 when QUANTIZE says so (quantized here once, no PyTorch);
    RecordError for a record of another model."""
    record = read_sized(path)
    recorded_key = record.get("fingerprint")
    if recorded_key != key:
        raise RecordError(f"it was exported from other model files (fingerprint "
                          f"{str(recorded_key)[:12]}, not {key[:12]})")
    threads = threads_for(settings)
    digests = Digests(path, record)  # beside the session's build, checked before the probe
    try:
        found = open_record(path, threads, record, before_run=digests.check)
    except Exception:
        digests.check()  # a file that differs is the error to report, else the load's
        raise
    digests.check()  # a record that is not lean has no probe
    if isinstance(found, NotLean) or settings.quantize == "none":
        return found
    if found.kind != "embedding":
        return NotLean(f"QUANTIZE={settings.quantize} serves embedding models, not "
                       f"{found.kind} models")
    int8, _ = GraphCache(path).get_or_build(path / INT8, partial(build_int8, found),
                                            partial(open_int8, found, threads))
    return int8


def gate(encoder: LeanEncoder, floor: float) -> None:
    """QualityBelowFloor for an int8 encoder whose recorded recall@10 is under ``floor``."""
    q = getattr(encoder, "quality", None)
    if q is not None and q.recall < floor:
        raise runtime.QualityBelowFloor(
            f"QUANTIZE=int8 refused: its vectors keep {q.recall:.3f} of float32's 10 nearest "
            f"neighbours on the {q.texts} calibration texts, below QUANTIZE_MIN_RECALL={floor}; "
            "serve with QUANTIZE=none, or lower EMBEDSVC_QUANTIZE_MIN_RECALL")


def startup_line(encoder: LeanEncoder, path: Path) -> str:
    quality = getattr(encoder, "quality", None)
    precision = f"float32 (weights stored as {encoder.weights})" if quality is None else (
        f"int8 (QUANTIZE=int8; recall@10 against float32 {quality.recall:.3f} on "
        f"{quality.texts} calibration texts, cosine mean {quality.mean:.4f})")
    return (f"backend: ONNX Runtime {precision} on the CPU without PyTorch, "
            f"{encoder._session.get_session_options().intra_op_num_threads} intra-op threads, "
            f"{encoder.kind} pipeline from {path} (its probe outputs match PyTorch's)")


def build_int8(fp32: LeanEncoder, path: Path) -> None:
    """The int8 record at ``path``: the float32 graph quantized (dynamic, per channel), its
    own probe outputs and its quality against float32 on the calibration set."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    log.info("quantizing %s to int8, once: later starts read it from the cache", fp32.graph)
    path.mkdir()
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # it advises pre-processing through the root logger
    try:
        quantize_dynamic(float_weights(fp32.graph), path / GRAPH, per_channel=True,
                         weight_type=QuantType.QInt8)
    finally:
        root.setLevel(level)
    int8 = fp32.quantized(path / GRAPH, runtime.session(path / GRAPH, 1))
    quality = _quality(fp32, int8)
    inputs = fp32.probe_inputs
    batch = int8.probe_batch(inputs)
    np.savez(path / PROBE, sentence_embedding=int8.encode(batch))
    write_record(path, {
        "quality": quality.__dict__, "probe": {"inputs": inputs, "ids": batch},
        "files": {GRAPH: describe_file(path / GRAPH),
                  PROBE: describe_file(path / PROBE)},
    })


def float_weights(graph: Path) -> Any:
    """The ONNX model at ``graph`` with the weights that export.py stored as float16 back as
    float32 initializers (the values it serves), their Cast nodes gone: onnxruntime's
    quantization takes a MatMul's weight for a weight only when it is an initializer, and
    would otherwise quantize it again on every run, per tensor."""
    import onnx
    from onnx import TensorProto, numpy_helper

    model = onnx.load(str(graph))
    uses = Counter(name for node in model.graph.node for name in node.input)
    halves = {t.name: t for t in model.graph.initializer
              if t.data_type == TensorProto.FLOAT16 and uses[t.name] == 1}
    for cast in [n for n in model.graph.node if n.op_type == "Cast" and n.input[0] in halves
                 and _cast_to(n) == TensorProto.FLOAT]:
        half = halves[cast.input[0]]
        model.graph.initializer.remove(half)
        model.graph.initializer.append(numpy_helper.from_array(
            numpy_helper.to_array(half).astype(np.float32), cast.output[0]))
        model.graph.node.remove(cast)
    return model


def _cast_to(node: Any) -> int:
    import onnx

    return int(next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "to"))


def open_int8(fp32: LeanEncoder, threads: int, path: Path) -> LeanEncoder:
    record = read_record(path)
    int8 = fp32.quantized(path / GRAPH, runtime.session(path / GRAPH, threads))
    verify(int8, record, path / PROBE, "its own recorded outputs")
    int8.quality = runtime.Quality(**record["quality"])
    if int8.quality.mean < _BROKEN:  # a damaged file, not the cost of quantizing: rebuild it
        raise RecordError(f"its vectors are unrelated to float32's: cosine "
                          f"{int8.quality.mean:.3f}")
    return int8


def _quality(fp32: LeanEncoder, int8: LeanEncoder, size: int = 32) -> runtime.Quality:
    """int8 rows against float32 rows of the calibration set (recall@10 of each text's
    neighbours among the others, cosine), computed in batches of similar length."""
    room = fp32.info.max_input_tokens - fp32.special_tokens
    batch = [fp32.wrap(ids[:room]) for ids in fp32.tokenize(calibration_texts())]
    order = sorted(range(len(batch)), key=lambda i: len(batch[i]))
    chunks = [[batch[i] for i in order[s:s + size]] for s in range(0, len(order), size)]
    return runtime.quality(np.concatenate([fp32.encode(c) for c in chunks]),
                           np.concatenate([int8.encode(c) for c in chunks]))
