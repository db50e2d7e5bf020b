"""What the Cohere, Voyage and Jina embedding fields share: an input role (a query, a
document) mapped to the model's prompts, and vectors out as float, int8, uint8 or packed bits.

int8/uint8 codes need the model's calibration (model/quantize.py). It is computed at the
first request that asks for them, not at startup: most deployments never ask, and for them
startup stays as it was; with the cache warm it is read from disk (bench/RESULTS.md has both
times).
"""

from __future__ import annotations

import base64
import threading
import time
import weakref
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidRequest
from ..model import quantize
from ..model.graph_cache import cache_root

if TYPE_CHECKING:
    from ..engine import Engine

# The prompt names each role goes by in sentence-transformers models, most usual first.
_ROLE_PROMPTS = {
    "query": ("query", "search_query", "retrieval.query"),
    "document": ("document", "passage", "search_document", "corpus", "retrieval.passage"),
    "classification": ("classification",),
    "clustering": ("clustering", "separation"),
    "similarity": ("text-matching", "similarity", "sts"),
}
_CALIBRATION_BATCH = 64

_calibrations: weakref.WeakKeyDictionary[Engine, quantize.Calibration] = (
    weakref.WeakKeyDictionary())
_calibrating = threading.Lock()


def role_prefix(prompts: dict[str, str], sent: str, role: str) -> str:
    """The prompt to put before texts of ``role``: a prompt named as the client's own value
    (``sent``) first, else the role's usual names; none when the model has no such prompt
    (a symmetric model, or one that prompts queries only, embeds documents as they are)."""
    for name in (sent, *_ROLE_PROMPTS[role]):
        if name in prompts:
            return prompts[name]
    return ""


def with_role(engine: Engine, texts: list[str], sent: str | None, roles: dict[str, str],
              param: str) -> list[str]:
    """``texts`` with the prompt of the role the client's ``param`` value names."""
    if sent is None:
        return texts
    if sent not in roles:
        known = ", ".join(sorted(roles))
        raise InvalidRequest(f"'{param}' {sent!r} is not one of {known}", param=param,
                             code=f"invalid_{param}")
    prefix = role_prefix(engine.info.prompts, sent, roles[sent])
    return [prefix + t for t in texts] if prefix else texts


def encoded(engine: Engine, rows: np.ndarray, dtype: str, *, normalize: bool = True,
            dimensions: int | None = None) -> np.ndarray:
    """``rows`` (shaped by ``normalize`` and ``dimensions``) as ``dtype``."""
    ranges = None
    if dtype in (quantize.INT8, quantize.UINT8):
        ranges = calibration(engine).ranges(normalize=normalize, dimensions=dimensions)
    return quantize.quantize(rows, dtype, ranges)


def base64_rows(rows: np.ndarray) -> list[str]:
    """Each row's little-endian bytes, base64-encoded (float32 rows: OpenAI's base64)."""
    little = rows.astype(rows.dtype.newbyteorder("<"), copy=False)
    return [base64.b64encode(r.tobytes()).decode() for r in little]


def calibration(engine: Engine) -> quantize.Calibration:
    """The served model's calibration, computed (or read from the cache) once per engine."""
    found = _calibrations.get(engine)
    if found is not None:
        return found
    with _calibrating:  # concurrent first requests compute it once
        found = _calibrations.get(engine)
        if found is None:
            found = quantize.calibrate(cache_root(engine.settings.cache_dir), engine.info,
                                       raw_embedder(engine), batch=_batch(engine))
            _calibrations[engine] = found
    return found


def raw_embedder(engine: Engine) -> quantize.Embed:
    """Raw vectors through the engine (and so the batcher), each call one admitted request."""

    def embed(texts: list[str]) -> np.ndarray:
        deadline = time.monotonic() + engine.settings.request_timeout_s
        return engine.embed(texts, normalize=False, truncate=True, deadline=deadline).vectors

    return embed


def _batch(engine: Engine) -> int:
    return max(1, min(_CALIBRATION_BATCH, engine.settings.max_inputs_per_request))
