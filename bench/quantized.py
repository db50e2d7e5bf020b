"""Quality of quantized embeddings on a retrieval set, and what calibration costs.

    .venv/bin/python bench/quantized.py [--corpus 4000] [--queries 300]

The retrieval set is offline text every machine here has: the paragraphs of Python's own
help topics (``pydoc_data``) and the descriptions of the installed packages (their
METADATA), deduplicated, 80-800 characters each; queries are a seeded sample of them, each
searched against the whole corpus but itself. For each query, the top-10 neighbours by
float cosine are the truth; a quantized search keeps some of them ("recall@10").

Prints a markdown section for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import platform
import random
import re
import tempfile
import time
from importlib import metadata
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np

from embedsvc.model import quantize
from embedsvc.service import Service
from embedsvc.settings import Settings

K = 10


def paragraphs() -> list[str]:
    """Offline English text, in a fixed order."""
    texts = list(topics.values())
    for dist in metadata.distributions():
        texts.append(dist.metadata.get_payload() or "")  # the long description
    out: set[str] = set()
    for text in texts:
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if 80 <= len(para) <= 800 and sum(c.isalpha() for c in para) > 0.7 * len(para):
                out.add(para)
    return sorted(out)


def top_k(scores: np.ndarray) -> np.ndarray:
    return np.argsort(-scores, axis=1)[:, :K]


def recall(truth: np.ndarray, got: np.ndarray) -> float:
    return float(np.mean([len(set(t) & set(g)) / K for t, g in zip(truth, got, strict=True)]))


def searches(floats: np.ndarray, q: np.ndarray, ranges: dict[str, quantize.Ranges]
             ) -> dict[str, np.ndarray]:
    """Each method's scores of the queries ``q`` (indices) against the corpus."""
    out = {"float32": floats[q] @ floats.T}
    for name, r in ranges.items():
        codes = quantize.quantize(floats, "int8", r).astype(np.int32)
        out[f"int8 codes, dot product ({name})"] = codes[q] @ codes.T
        back = quantize.dequantize(codes.astype(np.int8), "int8", r)
        out[f"int8 dequantized, cosine ({name})"] = (back[q] @ back.T) / np.outer(
            np.linalg.norm(back[q], axis=1), np.linalg.norm(back, axis=1))
    bits = np.unpackbits(quantize.quantize(floats, "ubinary"), axis=1).astype(np.int32)
    # Hamming similarity: matching bits; the bits of a dimension are its sign
    out["binary, Hamming"] = bits[q] @ bits.T + (1 - bits[q]) @ (1 - bits).T
    return out


def timed_calibration(engine, root: Path) -> float:
    started = time.perf_counter()
    quantize.calibrate(root, engine.info, lambda t: engine.embed(t, normalize=False).vectors)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", type=int, default=4000)
    parser.add_argument("--queries", type=int, default=300)
    args = parser.parse_args()
    texts = paragraphs()
    texts = random.Random(0).sample(texts, min(args.corpus, len(texts)))
    started = time.perf_counter()
    service = Service(Settings(device="cpu"))
    service.start(background=False)
    engine = service.ready()
    load_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as cache:
        cold = timed_calibration(engine, Path(cache))
        warm = timed_calibration(engine, Path(cache))
    calibration = quantize.calibrate(Path(tempfile.mkdtemp()), engine.info,
                                     lambda t: engine.embed(t, normalize=False).vectors)
    floats = np.concatenate([engine.embed(texts[i:i + 256]).vectors
                             for i in range(0, len(texts), 256)])
    service.drain(timeout=5)
    q = np.array(random.Random(1).sample(range(len(texts)), args.queries))
    normed = calibration.rows / np.linalg.norm(calibration.rows, axis=1, keepdims=True)
    reach = np.abs(normed).max()
    ranges = {
        "served: per dimension, symmetric, widened": calibration.ranges(),
        "per dimension, min to max, no margin": quantize.Ranges(normed.min(0), normed.max(0)),
        "one range for every dimension": quantize.Ranges(np.full(384, -reach, np.float32),
                                                         np.full(384, reach, np.float32)),
    }
    scores = searches(floats, q, ranges)
    for name in scores:  # a query is not its own neighbour
        scores[name] = scores[name].astype(np.float64)
        scores[name][np.arange(len(q)), q] = -np.inf
    truth = top_k(scores["float32"])
    print(f"{len(texts)} paragraphs (pydoc topics and installed packages' descriptions), "
          f"{len(q)} queries, bundled all-MiniLM-L6-v2 on ONNX Runtime, {platform.machine()}.")
    print(f"Model load {load_s:.1f} s; calibration ({len(quantize.calibration_texts())} texts) "
          f"{cold:.2f} s cold, {warm:.3f} s from the cache.\n")
    print("| search | bytes/vector | top-10 kept vs float32 |\n|---|---:|---:|")
    sizes = {"float32": 4 * floats.shape[1], "binary, Hamming": floats.shape[1] // 8}
    for name, s in scores.items():
        kept = recall(truth, top_k(s))
        print(f"| {name} | {sizes.get(name, floats.shape[1])} | {kept:.3f} |")


if __name__ == "__main__":
    main()
