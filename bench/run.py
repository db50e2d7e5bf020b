"""Side by side, in one run: the offline limit, embedsvc, the naive Flask app and Infinity.

    .venv/bin/python bench/run.py --duration 15 --record

Servers run one at a time on loopback; wrk (one thread, a Lua script) drives them from the
same cores, so every figure is relative to this machine and this run: compare ratios, not
absolute numbers. Scenarios: 1 client x 1 input; 32 clients x 1 input; 4 clients x 32
inputs (10-word sentences); 32 clients x 1 input of 5 to 200 words; 4 clients x 8 RAG
chunks (200 words of prose and code, cut at the model's 256 tokens). Every scenario sends
bodies written here (bench/out/bodies-*.jsonl), and the offline limit is measured on the
same texts: the encoder embedsvc serves (ONNX Runtime on the CPU), in this process, on
pre-tokenized batches, one session run per batch (no slicing), at batch 1, 32 and 128 for
the sentences and at its best batch size for the chunks.

Then embedsvc over a simulated zero-cost device (bench/sim_server.py): its sustained
requests/s and the server CPU microseconds per request and per input, for 1- and 32-input
requests, next to a bare waitress app with the same threads that answers every request
with one precomputed answer of the same size (bench/bare_server.py: the HTTP server's own
pace), Infinity's debugengine and, when granian is installed (the bench extra), the same app
under granian's WSGI server instead of waitress. Infinity is installed into
bench/out/infinity-venv on first use. ``--baseline REV`` also runs the simulated device on
the code of git revision REV (checked out under bench/out/), in the same run, so that a
change's cost per request is measured against what it replaced:

    .venv/bin/python bench/run.py --only sim --baseline 16bca89 --duration 15
    .venv/bin/python bench/run.py --only sim --baseline 16bca89 --duration 10 --rounds 5

``embedsvc-onnx-torch`` (in ``--only``) serves with BACKEND=onnx-torch, the CPU path before
the PyTorch-free one, beside the default in the same run; ``embedsvc-tokens-N`` serves with
MAX_BATCH_TOKENS=N, to compare batch budgets in one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from statistics import median
from typing import Any

import httpx

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
OUT = BENCH / "out"
VENV_BIN = Path(sys.executable).parent
INFINITY_VENV = OUT / "infinity-venv"
INFINITY_VERSION = "0.0.78"
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "service", "embedding",
         "vector", "batch", "token", "model", "request", "latency", "search", "query")
CLK_TCK = os.sysconf("SC_CLK_TCK")


POOL = 1024  # distinct texts per scenario
BODIES = 500  # distinct request bodies per scenario, sent in turn
CHUNK_WORDS = 200
CHUNK_BATCHES = (1, 2, 4, 8, 16, 32)  # offline batch sizes tried on the chunks


@dataclass(frozen=True)
class Scenario:
    name: str
    clients: int
    inputs: int
    min_words: int = 10
    max_words: int = 10
    offline_batch: int | None = None  # the offline figure this scenario is compared with
    chunks: bool = False  # RAG chunks (compared with offline's best batch) instead of sentences


SCENARIOS = [
    Scenario("1x1", 1, 1, offline_batch=1),
    Scenario("32x1", 32, 1, offline_batch=32),
    Scenario("4x32", 4, 32, offline_batch=128),
    Scenario("mixed 32x1", 32, 1, 5, 200),
    Scenario("rag 4x8", 4, 8, CHUNK_WORDS, CHUNK_WORDS, chunks=True),
]
SIM_SCENARIOS = [Scenario("sim 64x1", 64, 1), Scenario("sim 8x32", 8, 32)]
BARE_SCENARIOS = SIM_SCENARIOS[:1]  # its one answer holds one vector


# -- inputs -------------------------------------------------------------------------------------


def texts(sc: Scenario) -> list[str]:
    """The texts of a scenario, the same in every run: sentences of WORDS, or chunks."""
    if sc.chunks:
        return chunk_texts()
    rng = random.Random(0)
    return [" ".join(rng.choices(WORDS, k=rng.randint(sc.min_words, sc.max_words))) + f" {i}"
            for i in range(POOL)]


def chunk_texts() -> list[str]:
    """RAG-sized chunks: Python's help topics (prose with code), cut every CHUNK_WORDS words;
    most hold more than the model's 256 tokens, so the model's window cuts them."""
    from pydoc_data.topics import topics

    words = " ".join(topics[name] for name in sorted(topics)).split()
    return [" ".join(words[i:i + CHUNK_WORDS])
            for i in range(0, len(words) - CHUNK_WORDS + 1, CHUNK_WORDS)]


def bodies_file(sc: Scenario) -> Path:
    """The scenario's request bodies, one a line, for embed.lua (BENCH_BODIES)."""
    pool = texts(sc)
    OUT.mkdir(exist_ok=True)
    path = OUT / f"bodies-{re.sub(r'[^a-z0-9]+', '-', sc.name)}.jsonl"
    lines = [json.dumps({"model": "bench", "input": [pool[(b * sc.inputs + j) % len(pool)]
                                                     for j in range(sc.inputs)]})
             for b in range(BODIES)]
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Result:
    server: str
    scenario: Scenario
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_s: float = 0.0
    requests: int = 0
    padding: float | None = None

    @property
    def inputs_per_s(self) -> float:
        return self.rps * self.scenario.inputs


# -- servers ------------------------------------------------------------------------------------


def model_path() -> str:
    from embedsvc.model.encoder import bundled_model_path

    return bundled_model_path()


def server_command(name: str, port: int) -> tuple[list[str], str, dict[str, str]]:
    """(command, route, extra environment) for one of the servers under test."""
    workers = re.fullmatch(r"(embedsvc|sim|bare-gunicorn)-w(\d+)", name)
    if workers:  # N HTTP processes: embedsvc's around one engine process, gunicorn's
        return workers_command(workers.group(1), int(workers.group(2)), port)
    if name in ("embedsvc", "embedsvc-onnx-torch") or name.startswith("embedsvc-tokens-"):
        # embedsvc-onnx-torch: the CPU path before the PyTorch-free one, for comparison
        env = {"EMBEDSVC_BACKEND": "onnx-torch"} if name == "embedsvc-onnx-torch" else {}
        if name.startswith("embedsvc-tokens-"):
            env = {"EMBEDSVC_MAX_BATCH_TOKENS": name.removeprefix("embedsvc-tokens-")}
        return [str(VENV_BIN / "embedsvc"), "serve", "--port", str(port), "--threads", "64",
                "--log-level", "warning"], "/v1/embeddings", env
    if name == "naive":
        return [str(VENV_BIN / "waitress-serve"), "--threads=32", f"--port={port}",
                "--call", "bench.naive_app:create"], "/v1/embeddings", {}
    if name == "sim":
        return [sys.executable, str(BENCH / "sim_server.py"), "--port", str(port)], \
            "/v1/embeddings", {}
    if name in ("bare", "bare-adapter", "bare-handoff", "bare-handoff-python"):
        extra = {"bare": [], "bare-adapter": ["--adapter"], "bare-handoff": ["--handoff"],
                 "bare-handoff-python": ["--handoff", "--python-us", "100"]}[name]
        return [sys.executable, str(BENCH / "bare_server.py"), "--port", str(port),
                "--threads", "64", *extra], "/v1/embeddings", {}
    if name == "sim-baseline":
        tree = baseline_tree()
        return [sys.executable, str(tree / "bench" / "sim_server.py"), "--port", str(port)], \
            "/v1/embeddings", {"PYTHONPATH": str(tree)}
    if name == "sim-granian":  # the same app under an HTTP server with a compiled parser
        return [str(VENV_BIN / "granian"), "--interface", "wsgi", "--factory", "--host",
                "127.0.0.1", "--port", str(port), "--workers", "1", "--runtime-threads", "1",
                "--blocking-threads", "64", "--log-level", "warning",
                "bench.sim_server:make_app"], "/v1/embeddings", {}
    if name in ("infinity", "infinity-debug"):
        engine = "debugengine" if name == "infinity-debug" else \
            os.environ.get("BENCH_INFINITY_ENGINE", "torch")  # bench/backends.py picks one
        return [str(INFINITY_VENV / "bin" / "infinity_emb"), "v2", "--model-id", model_path(),
                "--served-model-name", "bench", "--engine", engine,
                "--device", os.environ.get("EMBEDSVC_DEVICE", "cpu"),
                "--host", "127.0.0.1", "--port", str(port), "--batch-size", "32",
                "--no-bettertransformer", "--log-level", "warning"], "/embeddings", \
            {"INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"}
    raise ValueError(name)


def workers_command(name: str, workers: int, port: int
                    ) -> tuple[list[str], str, dict[str, str]]:
    """embedsvc serve --workers N (on the model, or the simulated device), or the bare app
    under gunicorn -w N (gthread, 32 threads a worker)."""
    if name == "embedsvc":
        return [str(VENV_BIN / "embedsvc"), "serve", "--port", str(port), "--threads", "64",
                "--workers", str(workers), "--log-level", "warning"], "/v1/embeddings", {}
    if name == "sim":
        return [sys.executable, str(BENCH / "sim_server.py"), "--port", str(port),
                "--workers", str(workers)], "/v1/embeddings", {}
    return [str(VENV_BIN / "gunicorn"), "-w", str(workers), "-k", "gthread", "--threads", "32",
            "-b", f"127.0.0.1:{port}", "--log-level", "warning", "--no-control-socket",
            "bench.bare_server:make_app()"], "/v1/embeddings", {}


_baseline: str | None = None


def baseline_tree(rev: str | None = None) -> Path:
    """A checkout of ``rev`` (by default the ``--baseline``), made once under bench/out/."""
    rev = rev or _baseline
    assert rev is not None
    tree = OUT / f"baseline-{rev}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev],
                       check=True, capture_output=True)
    return tree


def baseline_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a bench that compares a tree with ``--baseline REV``, round by round."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--baseline", required=True, metavar="REV")
    parser.add_argument("--tree", type=Path, default=REPO,
                        help="the tree measured against the baseline (default: this one)")
    parser.add_argument("--rounds", type=int, default=5)
    return parser


# string hashes, and so dict and set layouts, fixed: with random ones a count moved by 5%
CALLGRIND = ("env", "PYTHONHASHSEED=0", "valgrind", "--tool=callgrind",
             "--callgrind-out-file=/dev/null")


def callgrind_delta(run: Callable[[int, tuple[str, ...]], subprocess.CompletedProcess],
                    few: int, many: int) -> int:
    """The instructions valgrind counts in ``run(many, CALLGRIND)``'s process less those in
    ``run(few, CALLGRIND)``'s (``run`` starts one with that wrapper, running that many of
    something): what the ``many - few`` more cost, start-up and imports cancelled out."""
    totals = []
    for n in (few, many):
        out = run(n, CALLGRIND)
        found = re.search(r"Collected : (\d+)", out.stderr)
        if not found:
            raise RuntimeError(out.stderr[-2000:])
        totals.append(int(found.group(1)))
    return totals[1] - totals[0]


def baseline_rows(keys: Iterable[Any], found: dict[tuple[str, Any], list[float]],
                  form: str) -> list[str]:
    """Table rows of each key's median figure for the ``baseline`` and ``this`` trees (the
    rounds in ``found[tree, key]``), formatted by ``form``, and their ratio."""
    rows = []
    for key in keys:
        base, this = median(found["baseline", key]), median(found["this", key])
        rows.append(f"| {key} | {base:{form}} | {this:{form}} | {this / base:.3f} |")
    return rows


def ensure_infinity() -> bool:
    exe = INFINITY_VENV / "bin" / "infinity_emb"
    if exe.exists():
        return True
    print(f"installing infinity-emb {INFINITY_VERSION} into {INFINITY_VENV} ...", flush=True)
    pip = [str(INFINITY_VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
    steps = [[sys.executable, "-m", "venv", str(INFINITY_VENV)], [*pip, "torch==2.13.0"],
             [*pip, f"infinity-emb[server,torch]=={INFINITY_VERSION}"]]
    for step in steps:
        if subprocess.run(step).returncode != 0:
            print("could not install Infinity; it is left out of this run")
            return False
    return exe.exists()


class Running:
    """Server ``name`` on ``port``, ready; ``command``: (argv, route, environment) in place
    of ``server_command``'s."""

    def __init__(self, name: str, port: int,
                 command: tuple[list[str], str, dict[str, str]] | None = None) -> None:
        cmd, self.route, env = command or server_command(name, port)
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = OUT / f"{name}.log"
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), **env}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                         cwd=REPO)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                resp = httpx.post(self.url + self.route, json={"model": "bench", "input": ["hi"]},
                                  timeout=10)
                if resp.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout}s")

    def cpu_seconds(self) -> float:
        """User and system CPU of the server and its worker processes (granian forks one)."""
        return sum(_cpu_ticks(pid) for pid in _tree(self.proc.pid)) / CLK_TCK

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        found = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _tree(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        children += [int(c) for c in task.read_text().split()]
    return [pid] + [p for child in children for p in _tree(child)]


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


# -- measuring ----------------------------------------------------------------------------------


def wrk(server: Running, sc: Scenario, seconds: float) -> dict:
    if shutil.which("wrk") is None:
        raise SystemExit("the load generator wrk is not installed: apt-get install wrk (the "
                         "Debian package), or build it from its sources")
    env = {**os.environ, "BENCH_ROUTE": server.route, "BENCH_INPUTS": str(sc.inputs),
           "BENCH_MIN_WORDS": str(sc.min_words), "BENCH_MAX_WORDS": str(sc.max_words),
           "BENCH_BODIES": str(bodies_file(sc))}
    cmd = ["wrk", "-t1", f"-c{sc.clients}", f"-d{seconds:.0f}s", "--timeout", "60s",
           "-s", str(BENCH / "embed.lua"), server.url]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(server: Running, sc: Scenario, seconds: float) -> Result:
    wrk(server, sc, 2)  # warm-up: caches, thread pools, allocator
    padded_before = real_before = 0.0
    if server.name.startswith("embedsvc"):
        padded_before = server.metric("embedsvc_batch_tokens_sum")
        real_before = server.metric("embedsvc_input_tokens_total")
    cpu_before = server.cpu_seconds()
    stats = wrk(server, sc, seconds)
    cpu = server.cpu_seconds() - cpu_before
    padding = None
    if server.name.startswith("embedsvc"):
        padded = server.metric("embedsvc_batch_tokens_sum") - padded_before
        real = server.metric("embedsvc_input_tokens_total") - real_before
        padding = real / padded if padded else None
    return Result(server.name, sc, stats["requests"] / stats["seconds"], stats["p50_ms"],
                  stats["p99_ms"], stats["errors"], cpu, stats["requests"], padding)


@dataclass
class Offline:
    """Inputs/s of the served encoder in this process, by batch size, and one input's latency."""

    backend: str
    sentences: dict[int, float]  # 10-word sentences (the short scenarios' texts)
    latency_ms: float  # one sentence at a time, median
    chunks: dict[int, float]  # the RAG chunks
    chunk_tokens: float  # tokens per chunk after the model's cut, mean

    @property
    def best_chunk_batch(self) -> int:
        return max(self.chunks, key=self.chunks.__getitem__)

    def limit(self, sc: Scenario) -> float | None:
        """The offline rate ``sc`` is compared with."""
        if sc.chunks:
            return self.chunks[self.best_chunk_batch]
        return self.sentences.get(sc.offline_batch or -1)


def offline_limits(seconds: float) -> Offline:
    """The model's own pace on the scenarios' texts: the encoder embedsvc serves (on the CPU,
    ONNX Runtime), on pre-tokenized batches (the tokenizer's cut at the model's limit), one
    session run per batch: padding, the run and pooling, without HTTP, queueing or tokenizing."""
    from embedsvc.model import runtime
    from embedsvc.model.backend import load_encoder
    from embedsvc.settings import Settings

    encoder = load_encoder(Settings.from_env(os.environ, device=os.environ["EMBEDSVC_DEVICE"]))
    room = encoder.info.max_input_tokens - encoder.special_tokens
    short = [encoder.wrap(ids) for ids in encoder.tokenize(texts(SCENARIOS[1]), room)]
    chunks = [encoder.wrap(ids) for ids in encoder.tokenize(chunk_texts(), room)]
    sliced, runtime.RUN_TOKENS = runtime.RUN_TOKENS, 1 << 30  # each batch in one run
    try:
        sentences = {size: _rate(encoder, short, size, seconds) for size in (1, 32, 128)}
        latencies = []
        for ids in short[:100]:
            started = time.perf_counter()
            encoder.encode([ids])
            latencies.append((time.perf_counter() - started) * 1000)
        by_batch = {size: _rate(encoder, chunks, size, seconds) for size in CHUNK_BATCHES}
    finally:
        runtime.RUN_TOKENS = sliced
    info = encoder.info
    return Offline(f"{info.backend} on {info.device}", sentences, median(latencies), by_batch,
                   sum(map(len, chunks)) / len(chunks))


def _rate(encoder: Any, batch: list[list[int]], size: int, seconds: float,
          windows: int = 3) -> float:
    """Inputs/s of ``encoder.encode`` on consecutive runs of ``size`` inputs of ``batch``: the
    best of ``windows`` spans sharing ``seconds``, since the limit is what the machine does
    when nothing else takes its cores (one slow span had put batch 32 at 0.7 of its rate)."""
    encoder.encode(batch[:size])
    best, done = 0.0, 0
    for _ in range(windows):
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds / windows:
            start = done % (len(batch) - size + 1)
            encoder.encode(batch[start:start + size])
            done += size
            count += size
        best = max(best, count / (time.perf_counter() - started))
    return best


# -- reporting ----------------------------------------------------------------------------------


# with the sim* servers: no model
_SIM_SERVERS = ("bare", "bare-handoff", "bare-handoff-python", "infinity-debug")


def simulated(server: str) -> bool:
    return server.startswith("sim") or server in _SIM_SERVERS


def table(results: list[Result], offline: Offline | None) -> str:
    by = {(r.server, r.scenario.name): r for r in results}
    lines = ["| scenario | server | inputs/s | req/s | p50 ms | p99 ms | errors | vs offline "
             "| vs naive | vs Infinity |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if simulated(r.server):
            continue
        limit = offline and offline.limit(r.scenario)
        cells = [f"{r.inputs_per_s / limit:.2f}" if limit else ""]
        for peer in ("naive", "infinity"):
            other = by.get((peer, r.scenario.name))
            ok = other and other.inputs_per_s and r.server != peer
            cells.append(f"{r.inputs_per_s / other.inputs_per_s:.2f}x" if ok else "")
        lines.append(f"| {r.scenario.name} | {r.server} | {r.inputs_per_s:.1f} | {r.rps:.1f} | "
                     f"{r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.errors} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sim_table(results: list[Result]) -> str:
    lines = ["| scenario | server | req/s | inputs/s | p50 ms | p99 ms | errors | server CPU "
             "us/request | us/input |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if not simulated(r.server):
            continue
        per_req = r.cpu_s / r.requests * 1e6 if r.requests else 0.0
        lines.append(f"| {r.scenario.name} | {r.server} | {r.rps:.0f} | {r.inputs_per_s:.0f} | "
                     f"{r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.errors} | {per_req:.0f} | "
                     f"{per_req / r.scenario.inputs:.0f} |")
    return "\n".join(lines)


def offline_line(offline: Offline) -> str:
    s, c = offline.sentences, offline.chunks
    best = offline.best_chunk_batch
    return (f"Offline ({offline.backend}, this process, pre-tokenized, one run per batch; "
            f"inputs/s): sentences batch 1 {s[1]:.1f}, batch 32 {s[32]:.1f}, batch 128 "
            f"{s[128]:.1f}; single-input latency p50 {offline.latency_ms:.2f} ms. RAG chunks "
            f"({offline.chunk_tokens:.0f} tokens each on average after the cut): "
            + ", ".join(f"batch {b} {r:.1f}" for b, r in c.items())
            + f"; best batch {best}.")


def targets(results: list[Result], offline: Offline | None) -> str:
    by = {(r.server, r.scenario.name): r for r in results}
    rows = []

    def row(name: str, value: float | None, goal: float, fmt: str, higher: bool = True) -> None:
        if value is None:
            rows.append(f"| {name} | not measured | {fmt.format(goal)} | - |")
            return
        met = value >= goal if higher else value <= goal
        rows.append(f"| {name} | {fmt.format(value)} | {fmt.format(goal)} | "
                    f"{'met' if met else 'MISSED'} |")

    def vs_offline(scenario: str) -> float | None:
        r = by.get(("embedsvc", scenario))
        limit = offline and r and offline.limit(r.scenario)
        return r.inputs_per_s / limit if r and r.requests and limit else None

    e1 = by.get(("embedsvc", "1x1"))
    e32, inf32 = by.get(("embedsvc", "32x1")), by.get(("infinity", "32x1"))
    mixed = by.get(("embedsvc", "mixed 32x1"))
    sim, granian = by.get(("sim", "sim 64x1")), by.get(("sim-granian", "sim 64x1"))
    bare = by.get(("bare", "sim 64x1"))
    for sc in SIM_SCENARIOS:
        now, base = by.get(("sim", sc.name)), by.get(("sim-baseline", sc.name))
        if now and base and now.requests and base.requests:
            ratio = (now.cpu_s / now.requests) / (base.cpu_s / base.requests)
            row(f"{sc.name}: server CPU per request / baseline", ratio, 1.0, "{:.2f}",
                higher=False)
    row("32x1 / offline batch 32", vs_offline("32x1"), 0.90, "{:.2f}")
    row("rag 4x8 / offline at its best batch", vs_offline("rag 4x8"), 0.90, "{:.2f}")
    row("4x32 / offline batch 128", vs_offline("4x32"), 1.12, "{:.2f}")
    row("1x1 p50 - offline single latency (ms)",
        e1 and offline and e1.p50_ms - offline.latency_ms, 2.0, "{:.2f}", higher=False)
    row("32x1 / Infinity 32x1", e32 and inf32 and e32.inputs_per_s / inf32.inputs_per_s, 2.0,
        "{:.2f}")
    row("mixed padding efficiency", mixed and mixed.padding, 0.8, "{:.2f}")
    row("simulated device / bare waitress app, 1-input req/s",
        sim and bare and bare.rps and sim.rps / bare.rps, 0.60, "{:.2f}")
    row("simulated zero-cost device, 1-input req/s", sim and sim.rps, 2000, "{:.0f}")
    row("the same under granian instead of waitress", granian and granian.rps, 2000, "{:.0f}")
    return "| target | measured | goal | |\n|---|---:|---:|---|\n" + "\n".join(rows)


def rounds_line(results: list[Result]) -> str:
    """Server CPU per request of each round, per server and scenario, in order."""
    by: dict[tuple[str, str], list[str]] = {}
    for r in results:
        if r.requests:
            by.setdefault((r.server, r.scenario.name), []).append(
                f"{r.cpu_s / r.requests * 1e6:.0f}")
    return "Rounds, server CPU us per request: " + "; ".join(
        f"{server} {scenario}: {', '.join(values)}" for (server, scenario), values in by.items())


def pooled(results: list[Result]) -> list[Result]:
    """One result per server and scenario: CPU and requests summed over the rounds (so CPU per
    request is pooled), rates and latencies their median."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.server, r.scenario.name), []).append(r)
    out = []
    for rounds in groups.values():
        first = rounds[0]
        out.append(dataclasses.replace(
            first, rps=median(r.rps for r in rounds),
            p50_ms=median(r.p50_ms for r in rounds),
            p99_ms=median(r.p99_ms for r in rounds),
            errors=sum(r.errors for r in rounds), cpu_s=sum(r.cpu_s for r in rounds),
            requests=sum(r.requests for r in rounds)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=15, help="seconds per scenario")
    parser.add_argument("--only", default="embedsvc,naive,infinity,sim",
                        help="comma-separated: embedsvc, embedsvc-onnx-torch, naive, infinity, "
                        "sim (with the bare app beside it), bare")
    parser.add_argument("--scenarios", help="comma-separated scenario names (default: all), "
                        "such as '32x1,rag 4x8'")
    parser.add_argument("--offline-seconds", type=float, default=3,
                        help="seconds per offline rate")
    parser.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ... for every server")
    parser.add_argument("--baseline", metavar="REV",
                        help="also run the simulated device on git revision REV")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --baseline: measure REV's and this tree's simulated device "
                        "this many times, alternately, and compare their pooled CPU per "
                        "request (one run's noise on a shared machine is 10-20%%)")
    args = parser.parse_args(argv)
    global _baseline
    _baseline = args.baseline
    os.environ["EMBEDSVC_DEVICE"] = args.device
    OUT.mkdir(exist_ok=True)
    wanted = args.only.split(",")
    if "infinity" in wanted and not ensure_infinity():
        wanted.remove("infinity")

    chosen = args.scenarios.split(",") if args.scenarios else None

    def pick(scenarios: list[Scenario]) -> list[Scenario]:
        return [sc for sc in scenarios if chosen is None or sc.name in chosen]

    results: list[Result] = []
    plan = [(n, pick(SCENARIOS)) for n in ("embedsvc", "embedsvc-onnx-torch", "naive",
                                           "infinity") if n in wanted]
    plan += [(n, pick(SCENARIOS)) for n in wanted if n.startswith("embedsvc-tokens-")]
    offline = None
    if any(scenarios for _, scenarios in plan):
        print("offline limit ...", flush=True)
        offline = offline_limits(args.offline_seconds)
        print("  " + offline_line(offline), flush=True)
    if "sim" in wanted and args.baseline:
        plan.append(("sim-baseline", pick(SIM_SCENARIOS)))
    if "bare" in wanted or "sim" in wanted:  # beside the simulated device: its floor
        plan.append(("bare", pick(BARE_SCENARIOS)))
    if "sim" in wanted:
        plan.append(("sim", pick(SIM_SCENARIOS)))
        if args.baseline:  # the later rounds: the two trees alternately
            plan += [(name, pick(SIM_SCENARIOS)) for _ in range(args.rounds - 1)
                     for name in ("sim-baseline", "sim")]
        if (VENV_BIN / "granian").exists():
            plan.append(("sim-granian", pick(SIM_SCENARIOS)))
        else:
            print("sim-granian left out: pip install -e '.[bench]' to compare with granian")
        if "infinity" in wanted:
            plan.append(("infinity-debug", pick(SIM_SCENARIOS)))
    for port, (name, scenarios) in enumerate(plan, start=18801):
        if not scenarios:
            continue
        print(f"{name} ...", flush=True)
        try:
            server = Running(name, port)
        except RuntimeError as exc:
            print(f"  left out: {exc}"[:500])
            continue
        try:
            for sc in scenarios:
                results.append(measure(server, sc, args.duration))
                r = results[-1]
                print(f"  {sc.name}: {r.inputs_per_s:.1f} inputs/s, p50 {r.p50_ms:.1f} ms, "
                      f"errors {r.errors}", flush=True)
        finally:
            server.stop()

    if args.rounds > 1:
        print("\n" + rounds_line(results))
        results = pooled(results)
    report = "\n\n".join([offline_line(offline) if offline else "Offline: not measured.",
                          table(results, offline), sim_table(results),
                          targets(results, offline)])
    print("\n" + report)
    if args.record:
        command = "python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        header = (f"\n## {when}: `{command}`\n\n{os.cpu_count()} cores, {platform.machine()}, "
                  f"device {args.device}; wrk and the server share the cores. "
                  f"{args.duration:.0f} s per scenario after a 2 s warm-up.\n\n")
        with open(BENCH / "RESULTS.md", "a") as f:
            f.write(header + report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
