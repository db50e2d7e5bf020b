"""int8 graphs of the bundled model, built several ways: what each keeps, and how fast it runs.

    .venv/bin/python bench/int8_graphs.py recall [VARIANT ...]
    flock /tmp/embedsvc-bench.lock .venv/bin/python bench/int8_graphs.py speed VARIANT ...

``recall``: recall@10 of each variant's vectors against PyTorch float32 on 1,000 passages of
bench/corpus.py (200 queries), and on the calibration set's own neighbours (what
QUANTIZE_MIN_RECALL gates). ``speed``: sentences/s at batch 32 (10-word sentences, the
session as the service builds it), every variant and float32 alternately, 3 s a turn;
prints the median of the rounds and its ratio to float32's. Variants are built from the
float32 graph of the bundled model's record (``embedsvc export`` builds it) into
bench/out/int8/. ``MatMulNBits`` variants need ``pip install onnx_ir`` (not a dependency).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.corpus import passages  # noqa: E402 - the path above makes the repository importable
from bench.run import WORDS  # noqa: E402
from embedsvc.model import lean, runtime  # noqa: E402
from embedsvc.model.quantize import calibration_texts  # noqa: E402
from embedsvc.model.retrieval import recall  # noqa: E402
from embedsvc.settings import Settings  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "int8"


def weight_matmuls(graph: Path) -> list[str]:
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    weights = {i.name for i in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]


def dynamic(src: Path, dst: Path, **options: Any) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(src, dst, per_channel=True, weight_type=options.pop("weight_type",
                                                                         QuantType.QInt8),
                     **options)


def excluding(src: Path, dst: Path, *parts: str) -> None:
    """Dynamic int8, the weight MatMuls whose names hold one of ``parts`` left in float."""
    skip = [n for n in weight_matmuls(src) if any(p in n for p in parts)]
    dynamic(src, dst, nodes_to_exclude=skip)


def static(src: Path, dst: Path, encoder: Any) -> None:
    """Static QDQ int8 (activation ranges from the calibration set, min to max)."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    batch = [encoder.wrap(ids) for ids in encoder.tokenize(calibration_texts())]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter([encoder.features(batch[i:i + 16])
                               for i in range(0, len(batch), 16)])

        def get_next(self) -> dict | None:
            return next(self.feeds, None)

    quantize_static(src, dst, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    op_types_to_quantize=["MatMul"], extra_options={"MatMulConstBOnly": True})


def nbits(src: Path, dst: Path, bits: int, block: int, level: int) -> None:
    """``MatMulNBits``: block-wise weights; accuracy level 4 quantizes activations per block."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True,
                                          accuracy_level=level, bits=bits)
    quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), algo_config=config)
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=False)


def per_token(src: Path, dst: Path, weight_bits: int = 7) -> None:
    """Each weight MatMul as MatMulInteger: weights per output channel, symmetric; activations
    per token (each row its own scale), symmetric, offset by 128 into uint8."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(src))
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    top = 2 ** (weight_bits - 1) - 1
    g.initializer.extend([numpy_helper.from_array(np.array(v, t), n) for n, v, t in (
        ("pt_zp", 128, np.uint8), ("pt_inv127", 1 / 127, np.float32),
        ("pt_128", 128, np.float32), ("pt_eps", 1e-8, np.float32))])
    nodes, replaced = [], set()
    for n in g.node:
        if not (n.op_type == "MatMul" and n.input[1] in inits):
            nodes.append(n)
            continue
        w = numpy_helper.to_array(inits[n.input[1]])
        ws = np.maximum(np.abs(w).max(axis=0), 1e-12) / top
        p = n.name.replace("/", "_")
        g.initializer.extend([
            numpy_helper.from_array(np.clip(np.rint(w / ws), -top, top).astype(np.int8),
                                    p + "_wq"),
            numpy_helper.from_array(ws.astype(np.float32), p + "_ws")])
        replaced.add(n.input[1])
        step = [  # (op, inputs, output, attributes)
            ("Abs", [n.input[0]], "abs", {}), ("ReduceMax", ["abs"], "amax",
                                               {"keepdims": 1, "axes": [-1]}),
            ("Max", ["amax", "pt_eps"], "amax2", {}), ("Mul", ["amax2", "pt_inv127"], "xs", {}),
            ("Div", [n.input[0], "xs"], "xd", {}), ("Round", ["xd"], "xr", {}),
            ("Add", ["xr", "pt_128"], "xa", {}), ("Cast", ["xa"], "xq", {"to": TensorProto.UINT8}),
            ("MatMulInteger", ["xq", "wq", "pt_zp"], "yi", {}),
            ("Cast", ["yi"], "yf", {"to": TensorProto.FLOAT}), ("Mul", ["yf", "ws"], "yw", {}),
            ("Mul", ["yw", "xs"], None, {})]
        for op, ins, out, attrs in step:
            named = [i if i.startswith("pt_") or i == n.input[0] else f"{p}_{i}" for i in ins]
            nodes.append(helper.make_node(op, named, [f"{p}_{out}" if out else n.output[0]],
                                          **attrs))
    del g.node[:]
    g.node.extend(nodes)
    used = {i for m in g.node for i in m.input}
    kept = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(kept)
    onnx.save(model, str(dst))


def variants(encoder: Any) -> dict[str, Callable[[Path, Path], None]]:
    return {
        "dynamic (served)": lambda s, d: dynamic(s, d),
        "dynamic, MatMul only": lambda s, d: dynamic(s, d, op_types_to_quantize=["MatMul"]),
        "dynamic, reduce_range": lambda s, d: dynamic(s, d, reduce_range=True),
        "dynamic, uint8 weights": lambda s, d: _uint8_weights(s, d),
        "dynamic, FFN output in float": lambda s, d: excluding(s, d, "/output/dense/MatMul"),
        "dynamic, FFN input in float": lambda s, d: excluding(s, d, "intermediate/dense"),
        "dynamic, attention output in float": lambda s, d: excluding(
            s, d, "attention/output/dense"),
        "dynamic, q/k/v in float": lambda s, d: excluding(s, d, "self/query", "self/key",
                                                          "self/value"),
        "dynamic, layers 0 and 5 in float": lambda s, d: excluding(s, d, "layer.0/",
                                                                   "layer.5/"),
        "static QDQ, min-max": lambda s, d: static(s, d, encoder),
        "per token (7-bit weights)": lambda s, d: per_token(s, d, 7),
        "per token (8-bit weights)": lambda s, d: per_token(s, d, 8),
        "MatMulNBits 8-bit, block 32, level 4": lambda s, d: nbits(s, d, 8, 32, 4),
        "MatMulNBits 8-bit, block 128, level 4": lambda s, d: nbits(s, d, 8, 128, 4),
        "MatMulNBits 8-bit, block 32, level 0": lambda s, d: nbits(s, d, 8, 32, 0),
        "MatMulNBits 4-bit, block 32, level 4": lambda s, d: nbits(s, d, 4, 32, 4),
    }


def _uint8_weights(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType

    dynamic(src, dst, weight_type=QuantType.QUInt8)


def built(name: str, build: Callable[[Path, Path], None], src: Path) -> Path:
    path = OUT / ("".join(c if c.isalnum() else "-" for c in name) + ".onnx")
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        logging.getLogger().setLevel(logging.ERROR)
        build(src, path)
    return path


def rows(encoder: Any, texts: list[str]) -> np.ndarray:
    room = encoder.info.max_input_tokens - encoder.special_tokens
    batch = [encoder.wrap(ids[:room]) for ids in encoder.tokenize(texts)]
    order = sorted(range(len(batch)), key=lambda i: len(batch[i]))
    out = np.zeros((len(batch), encoder.info.dimension), np.float32)
    for start in range(0, len(order), 32):
        chunk = order[start:start + 32]
        out[chunk] = encoder.encode([batch[i] for i in chunk])
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def measure_recall(fp32: Any, src: Path, names: list[str]) -> None:
    from sentence_transformers import SentenceTransformer

    from embedsvc.model.encoder import bundled_model_path

    texts, calibration = passages(2000)[:1000], calibration_texts()
    own = np.array(random.Random(1).sample(range(len(texts)), 200))
    truth = SentenceTransformer(bundled_model_path(), device="cpu").encode(
        texts, normalize_embeddings=True)
    truth, base = truth[own] @ truth.T, rows(fp32, calibration)
    print("| variant | recall@10, corpus | recall@10, calibration set | MB |\n|---|---:|---:|---:|")
    for name in names:
        path = built(name, variants(fp32)[name], src)
        int8 = fp32.quantized(path, runtime.session(path, 2))
        got, cal = rows(int8, texts), rows(int8, calibration)
        print(f"| {name} | {recall(truth, got[own] @ got.T, own=own):.3f} | "
              f"{recall(base @ base.T, cal @ cal.T):.3f} | {path.stat().st_size >> 20} |",
              flush=True)


def measure_speed(fp32: Any, src: Path, names: list[str], rounds: int) -> None:
    rng = random.Random(0)
    batch = fp32.probe_batch([" ".join(rng.choices(WORDS, k=10)) for _ in range(32)])
    feeds = fp32.features(batch)
    paths = {"float32": src, **{n: built(n, variants(fp32)[n], src) for n in names}}
    sessions = {n: runtime.session(p, runtime.available_cpus()) for n, p in paths.items()}
    rates: dict[str, list[float]] = {n: [] for n in sessions}
    for _ in range(rounds):
        for name, session in sessions.items():
            wanted = {i.name: feeds[i.name] for i in session.get_inputs()}
            done, started = 0, time.perf_counter()
            while time.perf_counter() - started < 3:
                session.run(None, wanted)
                done += len(batch)
            rates[name].append(done / (time.perf_counter() - started))
    base = float(np.median(rates["float32"]))
    for name, got in rates.items():
        print(f"| {name} | {np.median(got):.0f} | {np.median(got) / base:.2f}x | "
              f"{', '.join(f'{r:.0f}' for r in got)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("recall", "speed"))
    parser.add_argument("variants", nargs="*", help="default: every one (recall)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    settings = Settings.from_env(os.environ, device="cpu", quantize="none")
    found = lean.record_path(settings)
    fp32 = lean.open_record(found[0], 2) if found and found[0].exists() else None
    if fp32 is None or isinstance(fp32, lean.NotLean):
        raise SystemExit("no float32 record of the bundled model: run 'embedsvc export' first")
    names = args.variants or list(variants(fp32))
    if args.what == "recall":
        measure_recall(fp32, fp32.graph, names)
    else:
        measure_speed(fp32, fp32.graph, names, args.rounds)


if __name__ == "__main__":
    main()
