"""Pooling inside the graph or in numpy: the same batch through the PyTorch-free path's whole
pipeline graph, and through the transformer-only graph (BACKEND=onnx-torch's) plus numpy mean
pooling, alternating, on the bundled model.

    PYTHONPATH=$PWD .venv/bin/python bench/pooling_in_graph.py --runs 20
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from embedsvc.model import lean, runtime

BIN = Path(sys.executable).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="embedsvc-pooling-"))
    env = {**os.environ, "EMBEDSVC_CACHE_DIR": str(cache), "EMBEDSVC_DEVICE": "cpu"}
    for backend in ("onnx", "onnx-torch"):
        subprocess.run([str(BIN / "embedsvc"), "export", "--backend", backend], env=env,
                       check=True, capture_output=True)
    [record] = cache.glob("*.lean")
    [graph] = cache.glob("*.onnx")
    enc = lean.open_record(record, runtime.available_cpus())
    transformer = runtime.session(graph, runtime.available_cpus())
    texts = [f"sentence number {i} with a few words to embed and pool " * (1 + i % 3)
             for i in range(32)]
    feeds = enc.features([enc.wrap(ids) for ids in enc.tokenize(texts)])
    mask = feeds["attention_mask"][..., None].astype(np.float32)

    def whole() -> np.ndarray:
        return enc._session.run(["sentence_embedding"], feeds)[0]

    def in_numpy() -> np.ndarray:
        tokens = transformer.run([transformer.get_outputs()[0].name], feeds)[0]
        return (tokens * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)

    a, b = whole(), in_numpy()
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    print(f"min cosine between the two: {cos.min():.7f}")
    for name, fn in [("pooling in the graph", whole), ("pooling in numpy", in_numpy)] * 2:
        start = time.perf_counter()
        for _ in range(args.runs):
            fn()
        print(f"{name:22} {(time.perf_counter() - start) / args.runs * 1000:7.1f} ms per batch "
              "of 32")


if __name__ == "__main__":
    main()
