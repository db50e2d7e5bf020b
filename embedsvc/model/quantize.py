"""Quantized embeddings: int8/uint8 codes on one scale fixed per model, and packed bits.

int8 codes are the values of a vector in steps of one scale for every dimension, rounded:
code 0 is 0.0, code 127 the scale's reach, so the dot product of two texts' codes, which is
what a vector store computes on them, is the dot product of their vectors (times a constant)
give or take the rounding, and ranks as the floats do. The reach comes from a calibration set
the package ships (``calibration.txt``), embedded once through the served model and kept in
the cache beside its graphs, so that a text's codes depend on the model and the text only,
never on the other texts of its request or batch (sentence-transformers'
``quantize_embeddings`` takes ranges from the batch unless it is given fixed ones). Binary
codes are packed as sentence-transformers packs them: one bit per dimension, set for a
value > 0, eight to a byte; ``binary`` is ``ubinary - 128``.

>>> rows = np.array([[0.5, -0.25, 0.0, 1.0]], np.float32)
>>> quantize(rows, "ubinary").tolist(), quantize(rows, "binary").tolist()
([[144]], [[16]])
>>> quantize(rows, "int8", Scale(1.0)).tolist(), quantize(rows, "uint8", Scale(1.0)).tolist()
([[64, -32, 0, 127]], [[192, 96, 128, 255]])
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from .encoder import ModelInfo
from .graph_cache import GraphCache
from .retrieval import recall

log = logging.getLogger(__name__)

FLOAT, INT8, UINT8, BINARY, UBINARY = "float", "int8", "uint8", "binary", "ubinary"
DTYPES = (FLOAT, INT8, UINT8, BINARY, UBINARY)
NUMPY_TYPES = {FLOAT: np.float32, INT8: np.int8, UINT8: np.uint8, BINARY: np.int8,
               UBINARY: np.uint8}
_TOP = 127  # int8 codes -127..127: symmetric, so 0.0 is code 0 and -x is -(code of x)
_FORMAT = "1"  # bump when what a calibration file holds changes
# At load, the calibration's first batch is embedded again, to tell a changed model: the
# same texts in the same batch, since the int8 graph's dynamic quantization scales each
# batch's activations (texts 0-7 alone against their rows in the batch of 64: cosine down to
# 0.9895, which failed the 0.99 once asked; the same batch again: identical rows). The int8
# floor still leaves room for batch-mates the batcher may add under load; a changed model is
# far further off than either.
_PROBE_COSINE = {"int8": 0.98}
# The reaches tried, as multiples of the largest magnitude the calibration set shows: a wider
# reach clips nothing but rounds more coarsely, a narrower one clips the rare large values.
# The one kept is the one whose codes keep most of the calibration set's own top-10
# neighbours. On the bundled model recall@10 on bench/quality.py's corpus followed the
# calibration set's (bench/RESULTS.md, 2026-12-03): 0.5x 0.965, 0.75x 0.994 (the one
# chosen), 1x 0.993, 1.5x 0.987 (the per-dimension ranges served before: 0.896).
REACHES = (0.5, 0.625, 0.75, 0.875, 1.0, 1.25, 1.5)

Embed = Callable[[list[str]], np.ndarray]  # texts -> raw (unnormalised) float32 rows


@dataclass(frozen=True)
class Scale:
    """The value of int8 code 127 (and -127 of -127), the same for every dimension."""

    reach: float


@dataclass(frozen=True)
class Calibration:
    """The calibration set's raw vectors through one model; the scale for any output shape.

    ``rows`` must be finite and none of them zero (``CalibrationError`` otherwise): a NaN
    would make every code -127.
    """

    rows: np.ndarray  # (texts, dimension) float32, as the model gives them
    _scales: dict[tuple[bool, int | None], Scale] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_rows(self.rows)

    def scale(self, *, normalize: bool = True, dimensions: int | None = None) -> Scale:
        """The scale of vectors shaped as a request shapes them: cut to ``dimensions`` first,
        then normalised (as the engine does); chosen once per shape (see REACHES)."""
        key = (normalize, dimensions)
        if key not in self._scales:
            rows = self.rows[:, :dimensions] if dimensions else self.rows
            if normalize:
                rows = rows / np.linalg.norm(rows, axis=1, keepdims=True)
            self._scales[key] = best_scale(rows)
        return self._scales[key]


class CalibrationError(ValueError):
    """Rows that must not become a calibration (not finite, a zero row, the wrong shape)."""


def check_rows(rows: np.ndarray, texts: int | None = None) -> None:
    if rows.ndim != 2 or (texts is not None and rows.shape[0] != texts):
        raise CalibrationError(f"rows of shape {rows.shape}, not one per calibration text")
    if not np.isfinite(rows).all():
        raise CalibrationError("it holds values that are not finite (NaN or infinity)")
    if not np.linalg.norm(rows, axis=1).all():
        raise CalibrationError("it holds a row of zeros")


def best_scale(rows: np.ndarray) -> Scale:
    """Of the REACHES, the scale whose int8 codes keep most of the top-10 neighbours of
    ``rows`` (each row a query against the others, by dot product); on a tie, the wider."""
    largest = float(np.abs(rows).max())
    kept = {}
    for f in REACHES:
        codes = _codes(rows, Scale(largest * f)).astype(np.float32)  # exact: sums < 2**24
        kept[f] = recall(rows @ rows.T, codes @ codes.T)
    factor = max(reversed(REACHES), key=kept.__getitem__)  # max keeps the first of a tie
    return Scale(largest * factor)


def quantize(rows: np.ndarray, dtype: str, scale: Scale | None = None) -> np.ndarray:
    """``rows`` as ``dtype`` (one of ``DTYPES``); int8 and uint8 need the ``scale``.

    int8: each value divided by ``scale.reach / 127``, rounded to the nearest integer and
    clipped to -127..127 (a value past the reach gets the end code); uint8 = int8 + 128.
    binary/ubinary: ``ceil(dimension / 8)`` bytes per row.
    """
    if dtype == FLOAT:
        return np.asarray(rows, np.float32)
    if dtype in (BINARY, UBINARY):
        packed = np.packbits(rows > 0, axis=-1)
        return packed if dtype == UBINARY else (packed.astype(np.int16) - 128).astype(np.int8)
    if dtype not in (INT8, UINT8):
        raise ValueError(f"unknown dtype {dtype!r}; one of {', '.join(DTYPES)}")
    if scale is None:
        raise ValueError(f"{dtype} codes need a calibrated scale")
    codes = _codes(rows, scale)
    return (codes.astype(np.int16) + 128).astype(np.uint8) if dtype == UINT8 else codes


def dequantize(codes: np.ndarray, dtype: str, scale: Scale) -> np.ndarray:
    """int8/uint8 codes back to the values they stand for (for quality checks)."""
    values = codes.astype(np.float32) - (128 if dtype == UINT8 else 0)
    return values * np.float32(scale.reach / _TOP)


def _codes(rows: np.ndarray, scale: Scale) -> np.ndarray:
    step = np.float32(scale.reach / _TOP)
    return np.clip(np.rint(np.asarray(rows, np.float32) / step), -_TOP, _TOP).astype(np.int8)


def calibration_texts() -> list[str]:
    """The shipped calibration set: varied English sentences, one a line."""
    text = resources.files(__package__).joinpath("calibration.txt").read_text("utf-8")
    return [line for line in text.splitlines() if line.strip()]


def calibrate(cache_root: Path, info: ModelInfo, embed: Embed, *, batch: int = 64,
              texts: list[str] | None = None) -> Calibration:
    """The model's calibration: read from the cache, else computed with ``embed`` (texts to raw
    rows, called with at most ``batch`` texts) and stored.

    The cache key names what makes the vectors (model, dimension, backend, dtype) and the
    texts. A cached file is used only after its first texts, embedded again now, still give
    its vectors, and only when it holds finite rows, so that a model changed under the same
    name, or a damaged file, is calibrated afresh. Where the cache cannot be written (a full
    disk, ``.locks`` not a directory, a read-only mount), the calibration is computed once
    and kept in this process's memory, with one warning.
    """
    texts = calibration_texts() if texts is None else texts
    made_by = [info.name, str(info.dimension), info.backend, info.dtype]
    digest = hashlib.sha256("\n".join([*made_by, *texts, _FORMAT]).encode()).hexdigest()
    cache = GraphCache(cache_root)
    path = cache.path(info.name, digest, suffix=".calibration.npy")
    with _IN_MEMORY_LOCK:
        if path in _IN_MEMORY:
            return _IN_MEMORY[path]
    computed: list[np.ndarray] = []
    probes: list[np.ndarray] = []

    def rows() -> np.ndarray:
        if not computed:
            log.info("calibrating int8 codes for %s on %d texts", info.name, len(texts))
            computed.append(np.concatenate([embed(texts[i:i + batch])
                                            for i in range(0, len(texts), batch)]
                                           ).astype(np.float32))
        return computed[0]

    def build(target: Path) -> None:
        with open(target, "wb") as out:  # np.save on a path would add its own suffix
            np.save(out, rows())

    def load(source: Path) -> Calibration:
        found = np.load(source)
        check_rows(found, len(texts))
        if not probes:
            probes.append(np.asarray(embed(texts[:batch]), np.float32))
        if not _same(found[:len(probes[0])], probes[0], _PROBE_COSINE.get(info.dtype, 0.9999)):
            raise CalibrationError("the model no longer gives these vectors")
        return Calibration(found)

    try:
        return cache.get_or_build(path, build, load)[0]
    except OSError as exc:
        calibration = Calibration(rows())
        log.warning("cannot write the calibration to %s (%s): serving it from this process's "
                    "memory, computed once; free space there or set CACHE_DIR to a writable "
                    "directory", path, exc)
    with _IN_MEMORY_LOCK:
        return _IN_MEMORY.setdefault(path, calibration)


# Calibrations that could not be written, by the path they were for: computed once a process.
_IN_MEMORY: dict[Path, Calibration] = {}
_IN_MEMORY_LOCK = threading.Lock()


def _same(a: np.ndarray, b: np.ndarray, floor: float) -> bool:
    if a.shape != b.shape:
        return False
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return bool(((a * b).sum(axis=1) / np.maximum(norms, 1e-12) > floor).all())
