"""Quantized embeddings: int8/uint8 codes from fixed per-dimension ranges, and packed bits.

The ranges come from a calibration set the package ships (``calibration.txt``), embedded once
through the served model and kept in the cache beside its graphs, so that a text's codes
depend on the model and the text only, never on the other texts of its request or batch
(sentence-transformers' ``quantize_embeddings`` takes them from the batch unless it is given
fixed ones). Binary codes are packed as sentence-transformers packs them: one bit per
dimension, set for a value > 0, eight to a byte; ``binary`` is ``ubinary - 128``.

>>> rows = np.array([[0.5, -0.25, 0.0, 1.0]], np.float32)
>>> quantize(rows, "ubinary").tolist(), quantize(rows, "binary").tolist()
([[144]], [[16]])
>>> ranges = Ranges(np.full(4, -1.0, np.float32), np.full(4, 1.0, np.float32))
>>> quantize(rows, "int8", ranges).tolist()
[[63, -32, 0, 127]]
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from .encoder import ModelInfo
from .graph_cache import GraphCache

log = logging.getLogger(__name__)

FLOAT, INT8, UINT8, BINARY, UBINARY = "float", "int8", "uint8", "binary", "ubinary"
DTYPES = (FLOAT, INT8, UINT8, BINARY, UBINARY)
NUMPY_TYPES = {FLOAT: np.float32, INT8: np.int8, UINT8: np.uint8, BINARY: np.int8,
               UBINARY: np.uint8}
_LEVELS = 254  # steps: an odd number of codes, so that a range's middle has one
_FORMAT = "1"  # bump when what a calibration file holds changes
_PROBES = 8  # calibration texts embedded again at load, to tell a changed model
_PROBE_COSINE = 0.9999
# The calibration set's extremes underestimate what other texts reach, and a clipped value
# costs more than a coarser step: each range reaches half again past the largest magnitude
# the set shows (on the bundled model, the worst of eight unusual texts kept cosine 0.985 to
# its float vector without the margin and 0.998 with it; ordinary texts stay at 0.9999).
MARGIN = 0.5

Embed = Callable[[list[str]], np.ndarray]  # texts -> raw (unnormalised) float32 rows


@dataclass(frozen=True)
class Ranges:
    """The lowest and highest value of each dimension over the calibration set."""

    low: np.ndarray
    high: np.ndarray


@dataclass(frozen=True)
class Calibration:
    """The calibration set's raw vectors through one model; ranges for any output shape."""

    rows: np.ndarray  # (texts, dimension) float32, as the model gives them

    def ranges(self, *, normalize: bool = True, dimensions: int | None = None) -> Ranges:
        """The ranges of vectors shaped as a request shapes them: cut to ``dimensions``
        first, then normalised (as the engine does).

        Each dimension's range is symmetric about zero (0.0 is int8 code 0), so that the dot
        product of two texts' codes, which is what a vector store computes on them, carries
        no per-document offset: it kept 0.905 of the float top-10 on bench/quantized.py's
        retrieval set against 0.842 for min-to-max ranges (bench/RESULTS.md).
        """
        rows = self.rows[:, :dimensions] if dimensions else self.rows
        if normalize:
            rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
        reach = np.abs(rows).max(axis=0) * (1 + MARGIN)
        return Ranges(-reach, reach)


def quantize(rows: np.ndarray, dtype: str, ranges: Ranges | None = None) -> np.ndarray:
    """``rows`` as ``dtype`` (one of ``DTYPES``); int8 and uint8 need ``ranges``.

    int8/uint8: each dimension's range cut into 254 equal steps, each value rounded to the
    nearest and clipped to the range (a value past the calibration set's extremes gets the
    end code): int8 codes -127 to 127, the middle of the range 0; uint8 = int8 + 128.
    binary/ubinary: ``ceil(dimension / 8)`` bytes per row.
    """
    if dtype == FLOAT:
        return np.asarray(rows, np.float32)
    if dtype in (BINARY, UBINARY):
        packed = np.packbits(rows > 0, axis=-1)
        return packed if dtype == UBINARY else (packed.astype(np.int16) - 128).astype(np.int8)
    if dtype not in (INT8, UINT8):
        raise ValueError(f"unknown dtype {dtype!r}; one of {', '.join(DTYPES)}")
    if ranges is None:
        raise ValueError(f"{dtype} codes need calibrated ranges")
    low, steps = _steps(ranges, rows.shape[1])
    codes = np.clip(np.rint((rows - low) / steps), 0, _LEVELS).astype(np.int16) - _LEVELS // 2
    return (codes + 128).astype(np.uint8) if dtype == UINT8 else codes.astype(np.int8)


def dequantize(codes: np.ndarray, dtype: str, ranges: Ranges) -> np.ndarray:
    """int8/uint8 codes back to the values they stand for (for quality checks)."""
    low, steps = _steps(ranges, codes.shape[1])
    levels = codes.astype(np.float32) - (128 if dtype == UINT8 else 0) + _LEVELS // 2
    return low + levels * steps


def _steps(ranges: Ranges, width: int) -> tuple[np.ndarray, np.ndarray]:
    low, high = ranges.low[:width], ranges.high[:width]
    return low, np.maximum(high - low, 1e-12) / _LEVELS


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
    its vectors, so that a model changed under the same name is calibrated afresh.
    """
    texts = calibration_texts() if texts is None else texts
    made_by = [info.name, str(info.dimension), info.backend, info.dtype]
    digest = hashlib.sha256("\n".join([*made_by, *texts, _FORMAT]).encode()).hexdigest()
    cache = GraphCache(cache_root)
    path = cache.path(info.name, digest, suffix=".calibration.npy")
    probes: list[np.ndarray] = []

    def build(target: Path) -> None:
        log.info("calibrating int8 ranges for %s on %d texts", info.name, len(texts))
        rows = [embed(texts[i:i + batch]) for i in range(0, len(texts), batch)]
        with open(target, "wb") as out:  # np.save on a path would add its own suffix
            np.save(out, np.concatenate(rows).astype(np.float32))

    def load(source: Path) -> Calibration:
        rows = np.load(source)
        if rows.shape[0] != len(texts):
            raise ValueError(f"{rows.shape[0]} rows for {len(texts)} calibration texts")
        if not probes:
            probes.append(np.asarray(embed(texts[:min(_PROBES, batch)]), np.float32))
        if not _same(rows[:len(probes[0])], probes[0]):
            raise ValueError("the model no longer gives these vectors")
        return Calibration(rows)

    calibration, _ = cache.get_or_build(path, build, load)
    return calibration


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return bool(((a * b).sum(axis=1) / np.maximum(norms, 1e-12) > _PROBE_COSINE).all())
