"""What each output the service offers keeps of the model's own neighbours, on real text.

    .venv/bin/python bench/quality.py [--passages 2000] [--queries 300] [--record]

The corpus is real English prose that Python itself ships (bench/corpus.py: the Language
Reference's help topics and the standard library's docstrings), the same on every machine
with the same Python. Queries are a seeded sample of the passages, each searched against all
the others. The truth is PyTorch's float32 vectors (``BACKEND=torch``) by cosine; every
output is then searched as a vector store would search it:

- floats of each backend (PyTorch, ONNX Runtime float32, the ``QUANTIZE=int8`` graph) by
  cosine, as the service serves them (normalised);
- ``dimensions`` 256/128/64: the first N dimensions, renormalised (as the service cuts);
- int8 codes by dot product; uint8 codes by dot product as they are, and after subtracting
  128 (the same as int8);
- binary/ubinary by Hamming distance (the same bits; ``binary`` is ``ubinary - 128``).

Figures: recall@10, the share of the truth's 10 nearest neighbours found in the output's
10 nearest; nDCG@10, graded by the truth's order (its nearest gains 10, its tenth 1; a
neighbour not in the truth's top 10 gains 0), so an output that finds the same ten in
another order scores under 1. Prints a markdown table; ``--record`` appends it to
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.corpus import passages  # noqa: E402 - the path above makes the repository importable
from embedsvc.model.retrieval import K, neighbours, recall  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BACKENDS: dict[str, dict[str, object]] = {  # label -> the settings that serve it
    "PyTorch float32": {"backend": "torch"},
    "ONNX Runtime float32": {"backend": "onnx", "quantize": "none"},
    # measured whatever its recall: the gate would refuse it below QUANTIZE_MIN_RECALL
    "ONNX Runtime int8 graph (QUANTIZE=int8)": {"backend": "onnx", "quantize": "int8",
                                                "quantize_min_recall": 0.01},
}
DIMENSIONS = (256, 128, 64)
Search = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (queries, documents) -> scores


def by_dot(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) @ d.astype(np.float32).T  # exact for int8 codes: sums < 2**24


def by_hamming(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Bits in common (the dimension less the Hamming distance), of packed bytes."""
    qb = np.unpackbits(q.view(np.uint8), axis=1).astype(np.float32)
    db = np.unpackbits(d.view(np.uint8), axis=1).astype(np.float32)
    return qb @ db.T + (1 - qb) @ (1 - db).T


def ndcg(truth: np.ndarray, got: np.ndarray, own: np.ndarray) -> float:
    """nDCG@10 of ``got``'s order, graded by ``truth``'s (see the module docstring)."""
    want, found = neighbours(truth, K, own), neighbours(got, K, own)
    discount = 1 / np.log2(np.arange(K) + 2)
    ideal = float(((K - np.arange(K)) * discount).sum())
    scores = []
    for w, f in zip(want, found, strict=True):
        gain = {int(doc): K - rank for rank, doc in enumerate(w)}
        scores.append(sum(gain.get(int(doc), 0) * discount[i] for i, doc in enumerate(f)))
    return float(np.mean(scores)) / ideal


def outputs(engine, texts: list[str]) -> dict[str, tuple[np.ndarray, Search, int]]:
    """Each output of one backend: (rows, how they are searched, bytes per vector)."""
    step = 64
    floats = np.concatenate([engine.embed(texts[i:i + step]).vectors
                             for i in range(0, len(texts), step)]).astype(np.float32)
    width = floats.shape[1]
    out = {"floats": (floats, by_dot, 4 * width)}
    for n in DIMENSIONS:
        cut = floats[:, :n] / np.linalg.norm(floats[:, :n], axis=1, keepdims=True)
        out[f"floats, dimensions={n}"] = (cut, by_dot, 4 * n)
    int8 = engine.codes(floats, "int8")
    uint8 = engine.codes(floats, "uint8")
    out["int8 codes, dot product"] = (int8, by_dot, width)
    out["uint8 codes, dot product as stored"] = (uint8, by_dot, width)
    out["uint8 codes - 128, dot product"] = (uint8.astype(np.int16) - 128, by_dot, width)
    cut = floats[:, :256] / np.linalg.norm(floats[:, :256], axis=1, keepdims=True)
    out["int8 codes, dimensions=256"] = (engine.codes(cut, "int8", dimensions=256),
                                         by_dot, 256)
    out["binary / ubinary, Hamming"] = (engine.codes(floats, "ubinary"), by_hamming,
                                        -(-width // 8))
    binary = engine.codes(floats, "binary")
    assert np.array_equal(binary.view(np.uint8) ^ 0x80, out["binary / ubinary, Hamming"][0])
    return out


def served(settings: dict[str, str], texts: list[str]) -> tuple[dict, str]:
    """The outputs of ``texts`` from a service with ``settings``, and what served them."""
    from embedsvc.service import Service
    from embedsvc.settings import Settings

    service = Service(Settings.from_env(os.environ, device="cpu", **settings))
    service.start(background=False)
    try:
        engine = service.ready()
        return outputs(engine, texts), f"{engine.info.backend} {engine.info.dtype}"
    finally:
        service.drain(timeout=5)


def table(texts: list[str], queries: int) -> str:
    own = np.array(sorted(random.Random(1).sample(range(len(texts)), queries)))
    rows = ["| backend | output | bytes/vector | recall@10 | nDCG@10 |",
            "|---|---|---:|---:|---:|"]
    truth = None
    for label, settings in BACKENDS.items():
        started = time.perf_counter()
        found, what = served(settings, texts)
        print(f"  {label} ({what}): {time.perf_counter() - started:.0f} s", flush=True)
        if truth is None:
            truth = by_dot(found["floats"][0][own], found["floats"][0])
        for output, (vectors, search, size) in found.items():
            got = search(vectors[own], vectors)
            rows.append(f"| {label} | {output} | {size} | {recall(truth, got, own=own):.3f} | "
                        f"{ndcg(truth, got, own):.3f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=2000)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args()
    texts = passages(args.passages)
    head = (f"{len(texts)} passages (bench/corpus.py, Python {platform.python_version()}), "
            f"{args.queries} of them as queries against all the others; the bundled "
            f"all-MiniLM-L6-v2 on {platform.machine()}; truth: PyTorch float32 by cosine.")
    print(head, flush=True)
    report = head + "\n\n" + table(texts, args.queries)
    print("\n" + report)
    if args.record:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        command = "python bench/quality.py " + " ".join(sys.argv[1:])
        with open(RESULTS, "a", encoding="utf-8") as out:
            out.write(f"\n## {stamp}: `{command.strip()}`\n\n{report}\n")


if __name__ == "__main__":
    main()
