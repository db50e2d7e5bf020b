"""PyTorch against ONNX Runtime on the CPU, float32 and int8, offline and served, in one run.

    .venv/bin/python bench/backends.py --duration 10 --record

Offline: sentences/s of the model's own compute at batch 32 and 128 (the same tokenizer,
padding and pooling as embedsvc: its encoder's ``encode``), for PyTorch float32 (what
``BACKEND=torch`` serves), ONNX Runtime float32 and ONNX Runtime int8, with int8's cosine to
float32 beside it. Served: ``embedsvc serve`` on each of the three, 32 clients x 1 sentence
and 4 clients x 32 sentences (wrk, as bench/run.py), then Infinity when it is installed
(bench/run.py installs it; ``--infinity-engine`` picks its engine).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run import (  # noqa: E402 - the path above makes the repository importable
    BENCH,
    INFINITY_VENV,
    OUT,
    SCENARIOS,
    WORDS,
    Result,
    Running,
    measure,
)

CONFIGS = {  # label -> the settings embedsvc serves with
    "torch fp32": {"EMBEDSVC_BACKEND": "torch"},
    "onnx fp32": {"EMBEDSVC_BACKEND": "onnx"},
    # measured whatever its recall (QUANTIZE_MIN_RECALL would refuse the bundled model's)
    "onnx int8": {"EMBEDSVC_BACKEND": "onnx", "EMBEDSVC_QUANTIZE": "int8",
                  "EMBEDSVC_QUANTIZE_MIN_RECALL": "0.01"},
}
SERVED = [s for s in SCENARIOS if s.name in ("32x1", "4x32")]


def sentences(n: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choices(WORDS, k=10)) + f" {i}" for i in range(n)]


def offline(seconds: float) -> dict[str, dict[int | str, float]]:
    """Sentences/s per config and batch size, of the transformer alone (key "alone"), and
    int8's cosine to float32 (keys "mean", "min")."""
    from embedsvc.model.backend import load_encoder
    from embedsvc.settings import Settings

    texts = sentences(1024)
    rates: dict[str, dict[int | str, float]] = {}
    rows = {}
    for label, env in CONFIGS.items():
        settings = Settings.from_env({**os.environ, **env}, device="cpu")
        encoder = load_encoder(settings)
        batch = [encoder.wrap(ids) for ids in encoder.tokenize(texts)]
        rows[label] = encoder.encode(batch[:256])
        rates[label] = {"alone": forward_rate(encoder, batch[:32], seconds)}
        for size in (32, 128):
            encoder.encode(batch[:size])
            done, started = 0, time.perf_counter()
            while time.perf_counter() - started < seconds:
                start = done % (len(batch) - size)
                encoder.encode(batch[start:start + size])
                done += size
            rates[label][size] = done / (time.perf_counter() - started)
        r = rates[label]
        print(f"  offline {label}: transformer alone {r['alone']:.0f}/s, batch 32 {r[32]:.0f}/s,"
              f" batch 128 {r[128]:.0f}/s", flush=True)
    a, b = rows["onnx fp32"], rows["onnx int8"]
    cos = (a * b).sum(1) / (((a * a).sum(1) * (b * b).sum(1)) ** 0.5)
    rates["onnx int8"]["mean"], rates["onnx int8"]["min"] = float(cos.mean()), float(cos.min())
    return rates


def forward_rate(encoder: Any, batch: list[list[int]], seconds: float) -> float:
    """Sentences/s of the transformer alone (the graph, or PyTorch's module) on one padded
    batch: the compute ratio between backends, without tokenizing, pooling or copies."""
    import torch

    features = encoder.features(batch)
    with torch.inference_mode():
        encoder.forward(dict(features))
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            encoder.forward(dict(features))
            done += len(batch)
    return done / (time.perf_counter() - started)


def sweep(seconds: float) -> str:
    """ONNX Runtime float32 sentences/s by batch shape: what MAX_BATCH_TOKENS should allow."""
    from embedsvc.model.backend import load_encoder
    from embedsvc.settings import Settings

    encoder = load_encoder(Settings.from_env({**os.environ, **CONFIGS["onnx fp32"]},
                                             device="cpu"))
    lines = ["| tokens per input | inputs per batch | padded tokens | sentences/s |",
             "|---:|---:|---:|---:|"]
    for words in (10, 100):
        text = " ".join(sentences(1)[0].split()[:10] * (words // 10))
        ids = encoder.wrap(encoder.tokenize([text])[0])
        for size in (8, 32, 128, 512):
            if len(ids) * size > 32768:
                continue
            batch = [ids] * size
            encoder.encode(batch)
            done, started = 0, time.perf_counter()
            while time.perf_counter() - started < seconds:
                encoder.encode(batch)
                done += size
            rate = done / (time.perf_counter() - started)
            lines.append(f"| {len(ids)} | {size} | {len(ids) * size} | {rate:.0f} |")
            print("  " + lines[-1], flush=True)
    return "\n".join(lines)


def served(seconds: float, infinity_engine: str | None) -> tuple[list[Result], dict[str, float]]:
    """The served scenarios per config, and seconds from launch to the first answer (the
    cache already warm: offline() built every graph)."""
    results, startup = [], {}
    plan = [(label, env) for label, env in CONFIGS.items()]
    if infinity_engine:
        plan.append((f"infinity {infinity_engine}", {}))
    for port, (label, env) in enumerate(plan, start=18901):
        name = "infinity" if label.startswith("infinity") else "embedsvc"
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            started = time.monotonic()
            server = Running(name, port)
            startup[label] = time.monotonic() - started
        except RuntimeError as exc:
            print(f"  {label} left out: {exc}"[:500])
            continue
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        try:
            for sc in SERVED:
                r = replace(measure(server, sc, seconds), server=label)
                results.append(r)
                print(f"  {label} {sc.name}: {r.inputs_per_s:.1f} inputs/s, p50 "
                      f"{r.p50_ms:.1f} ms, errors {r.errors}", flush=True)
        finally:
            server.stop()
    return results, startup


def report(rates: dict[str, dict[int | str, float]], results: list[Result],
           startup: dict[str, float]) -> str:
    torch32 = rates["torch fp32"]
    lines = ["| compute | transformer alone, batch 32 /s | vs torch fp32 | offline batch 32 /s "
             "| offline batch 128 /s | vs torch fp32 (b32) |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, r in rates.items():
        lines.append(f"| {label} | {r['alone']:.0f} | {r['alone'] / torch32['alone']:.2f}x | "
                     f"{r[32]:.0f} | {r[128]:.0f} | {r[32] / torch32[32]:.2f}x |")
    q = rates["onnx int8"]
    lines.append(f"\nint8 cosine to ONNX float32 on 256 bench sentences: mean {q['mean']:.4f}, "
                 f"min {q['min']:.4f}.\n")
    lines += ["| scenario | server | inputs/s | p50 ms | p99 ms | errors | vs its offline "
              "(b32 for 32x1, b128 for 4x32) | vs embedsvc torch fp32 |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    base = {r.scenario.name: r for r in results if r.server == "torch fp32"}
    for r in results:
        limit = rates.get(r.server, {}).get(r.scenario.offline_batch or -2)
        vs_offline = f"{r.inputs_per_s / limit:.2f}" if limit else ""
        b = base.get(r.scenario.name)
        vs_torch = f"{r.inputs_per_s / b.inputs_per_s:.2f}x" if b and b.inputs_per_s else ""
        lines.append(f"| {r.scenario.name} | {r.server} | {r.inputs_per_s:.1f} | "
                     f"{r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.errors} | {vs_offline} | "
                     f"{vs_torch} |")
    lines.append("\nSeconds from launch to the first answer (warm cache, polled every 0.5 s): "
                 + ", ".join(f"{label} {s:.1f}" for label, s in startup.items()) + ".")
    return "\n".join(lines)


def cpu() -> str:
    """The CPU's name and the vector units that decide ONNX Runtime's rate, from /proc."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "CPU unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "CPU unknown")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines()
                      if line.startswith("flags")), []))
    units = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return f"{name}, {' '.join(units) or 'no AVX2'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10, help="seconds per scenario")
    parser.add_argument("--offline-seconds", type=float, default=5, help="seconds per rate")
    parser.add_argument("--infinity-engine", default="torch",
                        help="Infinity's --engine; 'none' leaves it out. Its ONNX engine "
                        "(optimum) did not load a local model here: infinity-emb 0.0.78 passes "
                        "optimum an absolute file name where it expects one in the directory")
    parser.add_argument("--sweep", action="store_true",
                        help="also ONNX Runtime's rate by batch shape (for MAX_BATCH_TOKENS)")
    parser.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    OUT.mkdir(exist_ok=True)
    os.environ.setdefault("EMBEDSVC_CACHE_DIR", str(OUT / "cache"))  # the servers' too
    engine = None if args.infinity_engine == "none" else args.infinity_engine
    if engine and not (INFINITY_VENV / "bin" / "infinity_emb").exists():
        print("Infinity is not installed (bench/run.py installs it); left out")
        engine = None
    if engine:
        os.environ["BENCH_INFINITY_ENGINE"] = engine
    load = os.getloadavg()
    print("offline ...", flush=True)
    rates = offline(args.offline_seconds)
    results, startup = served(args.duration, engine)
    text = report(rates, results, startup)
    if args.sweep:
        print("batch shapes ...", flush=True)
        text += "\n\nONNX Runtime float32, one batch shape at a time:\n\n" + sweep(
            args.offline_seconds)
    print("\n" + text)
    if args.record:
        command = "python bench/backends.py " + " ".join(argv if argv is not None
                                                          else sys.argv[1:])
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with open(BENCH / "RESULTS.md", "a") as f:
            f.write(f"\n## {when}: `{command}`\n\n{os.cpu_count()} cores, "
                    f"{platform.machine()} ({cpu()}); wrk and the server share the cores; "
                    f"load average "
                    f"{load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (above "
                    f"{os.cpu_count()}, other work shared the cores).\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
