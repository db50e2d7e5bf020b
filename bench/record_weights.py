"""The export record's weights stored as float16 against float32, in one run.

    .venv/bin/python bench/record_weights.py [--passages 400] [--rounds 3]

Exports the bundled model's record twice, each into a private cache: as `embedsvc export`
writes it (large weights stored as float16, cast to float32 as the session loads; export.py's
``half_weights``) and as it was written before (every weight float32: ``half_weights``
replaced here by one that converts nothing). Then, for each record: its size (du); its
vectors against PyTorch's (sentence-transformers, float32) on bench/corpus.py's passages, the
smallest cosine and the largest difference relative to the largest value (as record.compare
measures); and, in alternating rounds, the ONNX Runtime session's creation, the sentences/s
of its encoder at batch 32 on those passages, and `embedsvc serve` from launch to the first
answered /embed (bench/coldstart.py's ``one_start``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.coldstart import one_start  # noqa: E402 - the path above makes the repository importable
from bench.corpus import passages  # noqa: E402
from embedsvc.model import export, lean, runtime  # noqa: E402
from embedsvc.model.backend import export as export_record  # noqa: E402
from embedsvc.model.kinds import load_model  # noqa: E402
from embedsvc.settings import Settings  # noqa: E402

BATCH = 32


def build(cache: Path, half: bool) -> Path:
    settings = Settings.from_env({}, device="cpu", cache_dir=str(cache))
    keep = export.half_weights
    if not half:  # the record as written before: nothing converted, float32 throughout
        export.half_weights = lambda model: (model, 0)
    try:
        export_record(settings)
    finally:
        export.half_weights = keep
    found = lean.record_path(settings)
    assert found is not None
    return found[0]


def batches(encoder: Any, texts: list[str]) -> list[list[list[int]]]:
    room = encoder.info.max_input_tokens - encoder.special_tokens
    ids = [encoder.wrap(i) for i in encoder.tokenize(texts, limit=room)]
    return [ids[i:i + BATCH] for i in range(0, len(ids), BATCH)]


def against(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    return float(cos.min()), float(np.abs(got - want).max() / np.abs(want).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="embedsvc-weights-"))
    records = {"float16": build(root / "float16", True), "float32": build(root / "float32", False)}
    encoders = {}
    for name, path in records.items():
        found = lean.open_record(path, runtime.available_cpus())
        assert isinstance(found, lean.LeanEncoder)
        encoders[name] = found
    texts = passages(args.passages)
    work = vectors(records, encoders, texts)
    timed: dict[str, dict[str, list[float]]] = {k: {"session": [], "rate": [], "first": []}
                                                for k in records}
    base = {**os.environ, "EMBEDSVC_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    for _ in range(args.rounds):  # alternating: the machine's load falls on both
        for name, path in records.items():
            start = time.perf_counter()
            runtime.session(path / "model.onnx", runtime.available_cpus())
            timed[name]["session"].append(time.perf_counter() - start)
            start = time.perf_counter()
            for b in work:
                encoders[name].encode(b)
            timed[name]["rate"].append(len(texts) / (time.perf_counter() - start))
            served = one_start({**base, "EMBEDSVC_CACHE_DIR": str(root / name)})
            timed[name]["first"].append(float(served["first"]))  # type: ignore[arg-type]
    for name, t in timed.items():
        print(f"{name}: session {statistics.median(t['session']):.3f} s, "
              f"{statistics.median(t['rate']):.1f} sentences/s, first /embed "
              f"{statistics.median(t['first']):.2f} s (medians; rounds: "
              + "; ".join(f"{s:.3f}/{r:.1f}/{f:.2f}" for s, r, f in
                          zip(t["session"], t["rate"], t["first"], strict=True)) + ")")


def vectors(records: dict[str, Path], encoders: dict[str, lean.LeanEncoder],
            texts: list[str]) -> list[list[list[int]]]:
    """Print each record's size and its vectors against PyTorch's; the batches used."""
    reference = load_model("")
    reference.place("cpu", "float32")
    work = batches(reference, texts)
    want = np.concatenate([reference.encode(b) for b in work])
    print(f"{len(texts)} passages, batch {BATCH}; vectors against PyTorch float32")
    for name, path in records.items():
        size = int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True,
                                  check=True).stdout.split()[0])
        cos, rel = against(np.concatenate([encoders[name].encode(b) for b in work]), want)
        print(f"{name}: record {size / 2**20:.1f} MiB ({size / 1e6:.1f} MB), min cosine "
              f"{cos:.7f}, max relative difference {rel:.2e}")
    return work


if __name__ == "__main__":
    main()
