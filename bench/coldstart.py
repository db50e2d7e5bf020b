"""Cold start of `embedsvc serve` and `embedsvc embed` on the CPU, warm cache: PyTorch-free
path against the path before it (BACKEND=onnx-torch: ONNX Runtime for the transformer,
PyTorch loaded beside it), in one run.

    .venv/bin/python bench/coldstart.py            # 3 starts of each, the bundled model
    .venv/bin/python bench/coldstart.py --starts 5
    .venv/bin/python bench/coldstart.py --light DIR/bin [--onnx-dir MODEL]

Beside them, always: the floor (bench/floor_server.py: ONNX Runtime and tokenizers serving the
same record over the standard library's HTTP server), and what embedsvc's start costs over it;
with ``--baseline REV``, `embedsvc serve` of that revision too (its tree checked out under
bench/out, run in that tree with this venv), in the same alternating rounds.

``--light``: also the install without PyTorch (`pip install embedsvc` into a venv of its
own, whose bin directory this is), serving the record this venv exported, and with
``--onnx-dir`` a model directory that ships an ONNX graph, served with no record.

For each path: writes each tree's bytecode and exports into a private cache first (not
timed), then starts `embedsvc serve`
--starts times and reports the median of: seconds from launch to the first answered
POST /embed, the process's CPU-seconds by then, VmRSS after ten more requests, and which of
libtorch, scikit-learn, scipy, pandas appear in /proc/PID/maps. Then `embedsvc embed` on
1,000 lines: seconds from launch to its first committed part (50 rows), and to its end.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

BIN = Path(sys.executable).parent
PATHS = {"lean (default)": {}, "before (BACKEND=onnx-torch)": {"EMBEDSVC_BACKEND": "onnx-torch"}}
# package directories: numpy's own OpenBLAS is named libscipy_openblas, and is not scipy
LIBRARIES = {"libtorch": "/torch/lib/libtorch", "scikit-learn": "/sklearn/", "scipy": "/scipy/",
             "pandas": "/pandas/"}
TICKS = os.sysconf("SC_CLK_TCK")
BODY = {"inputs": ["a first request after the start", "and a second input"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / TICKS  # utime stime cutime cstime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def loaded(pid: int) -> list[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return [name for name, needle in LIBRARIES.items() if needle in maps]


def one_start(env: dict[str, str], cmd: list[str], cwd: Path | None = None
              ) -> dict[str, object]:
    """Launch ``cmd`` (its port appended) in ``cwd`` and time it to its first answered POST
    /embed."""
    port = free_port()
    cmd = [*cmd, "--port", str(port)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=cwd)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            while True:
                try:
                    if client.post("/embed", json=BODY).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
                time.sleep(0.01)
            first, cpu = time.monotonic() - start, cpu_seconds(proc.pid)
            for _ in range(10):
                assert client.post("/embed", json=BODY).status_code == 200
            return {"first": first, "cpu": cpu, "rss": rss_mib(proc.pid),
                    "maps": loaded(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(30)


def compiled(tree: Path) -> None:
    """The tree's bytecode written, as an install writes it: under PYTHONDONTWRITEBYTECODE a
    checkout never gets any, and each start would compile its 70 modules again (not timed)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "embedsvc")],
                   check=True, capture_output=True)


def embed_run(env: dict[str, str], work: Path) -> tuple[float, float]:
    source = work / "lines.txt"
    source.write_text("".join(f"line {i}: a short sentence to embed, number {i}\n"
                              for i in range(1000)))
    out = work / f"out-{time.monotonic_ns()}.jsonl"
    # parts of 50 from chunks of 50: the first part is committed when the first chunk is done
    cmd = [str(BIN / "embedsvc"), "embed", str(source), "--output", str(out),
           "--chunk-size", "50", "--part-size", "50"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = None
    while proc.poll() is None:
        if first is None and any(p.is_file() and p.stat().st_size and p != source
                                 for p in work.rglob("*.jsonl")):
            first = time.monotonic() - start
        time.sleep(0.01)
    total = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"embedsvc embed exited with {proc.returncode}")
    return (first if first is not None else total), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--light", type=Path, help="bin directory of a venv without PyTorch")
    parser.add_argument("--onnx-dir", help="with --light: a model directory with onnx/")
    parser.add_argument("--baseline", metavar="REV", help="also `embedsvc serve` of REV")
    parser.add_argument("--serve-only", action="store_true",
                        help="only the default path's `embedsvc serve` (no BACKEND=onnx-torch, "
                             "no `embedsvc embed`)")
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="embedsvc-coldstart-"))
    base = {**os.environ, "EMBEDSVC_CACHE_DIR": str(cache), "EMBEDSVC_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1"}
    paths = {k: v for k, v in PATHS.items() if not args.serve_only or not v}
    compiled(Path(__file__).resolve().parent.parent)
    for extra in paths.values():  # a warm cache for both paths: exporting is not timed
        subprocess.run([str(BIN / "embedsvc"), "export"], env={**base, **extra}, check=True,
                       capture_output=True)
    serve = [str(BIN / "embedsvc"), "serve"]
    # (environment, command, working directory: `python -m` imports from there first)
    starts: dict[str, tuple[dict[str, str], list[str], Path | None]] = {
        name: ({**base, **extra}, serve, None) for name, extra in paths.items()}
    record = next(d for d in cache.glob("*.lean") if (d / "record.json").is_file())
    starts["floor (onnxruntime + tokenizers)"] = (
        base, [sys.executable, str(Path(__file__).with_name("floor_server.py")),
               "--record", str(record)], None)
    if args.baseline:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from bench.run import baseline_tree

        tree = baseline_tree(args.baseline)
        compiled(tree)
        env = {**base, "PYTHONPATH": str(tree)}
        subprocess.run([sys.executable, "-m", "embedsvc", "export"], env=env, check=True,
                       capture_output=True, cwd=tree)  # its own record format, not timed
        # in its tree: `python -m` puts the working directory first on sys.path, so that
        # run from this checkout's root it would serve this tree, not the baseline
        starts[f"embedsvc serve at {args.baseline}"] = (
            env, [sys.executable, "-m", "embedsvc", "serve"], tree)
    if args.light:  # its own environment: nothing of this venv's on its path
        light = {**base, "PYTHONPATH": "", "VIRTUAL_ENV": str(args.light.parent)}
        starts["light install, record"] = (light, [str(args.light / "embedsvc"), "serve"],
                                           None)
        if args.onnx_dir:
            starts["light install, ONNX directory"] = (
                light, [str(args.light / "embedsvc"), "serve", "--model", args.onnx_dir], None)
    print(f"{'path':30} {'first /embed s':>14} {'CPU s':>6} {'RSS MiB':>8}  libraries mapped")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in starts}
    for _ in range(args.starts):  # alternating rounds: the machine's load falls on every path
        for name, (env, cmd, cwd) in starts.items():
            runs[name].append(one_start(env, cmd, cwd))
    medians = {}
    for name, runs_ in runs.items():
        med = medians[name] = {k: statistics.median(r[k] for r in runs_)
                               for k in ("first", "cpu", "rss")}
        maps = ", ".join(sorted({m for r in runs_ for m in r["maps"]}))
        each = ", ".join(f"{r['first']:.2f}" for r in runs_)
        print(f"{name:30} {med['first']:14.2f} {med['cpu']:6.2f} {med['rss']:8.0f}  "
              f"{maps or 'none of ' + '/'.join(LIBRARIES)}   (launch to answer: {each})")
    floor = medians["floor (onnxruntime + tokenizers)"]["first"]
    for name, med in medians.items():
        print(f"{name:30} launch to first answer / the floor's: {med['first'] / floor:.2f}x")
    if args.serve_only:
        return
    for name, extra in PATHS.items():
        with tempfile.TemporaryDirectory() as work:
            first, total = embed_run({**base, **extra}, Path(work))
        print(f"embed 1,000 lines, {name:28} first part {first:5.2f} s, done {total:5.2f} s")


if __name__ == "__main__":
    main()
