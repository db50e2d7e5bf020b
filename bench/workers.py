"""One engine, many fronts (issue 38): ``--workers N`` against one process, and -w N's memory.

    flock /tmp/embedsvc-bench.lock .venv/bin/python bench/workers.py sim --rounds 3 --duration 10
    flock /tmp/embedsvc-bench.lock .venv/bin/python bench/workers.py model --rounds 3 --duration 10
    flock /tmp/embedsvc-bench.lock .venv/bin/python bench/workers.py memory --workers 4

``sim``: 32 clients x 1 input (wrk and bench/embed.lua, as bench/run.py drives them) against
embedsvc in one process and ``--workers 2`` over the simulated zero-cost device
(bench/sim_server.py), a bare waitress app and the same bare app under ``gunicorn -w 2``
(bench/bare_server.py); with each server's CPU per request (every process of it) and, for
``--workers``, the engine process's own (``/proc/PID/stat``'s utime and stime before and after
the measured seconds, over the requests answered).

``--trees REV,...`` adds ``embedsvc --workers 2`` of each git revision REV (a checkout under
bench/out/, its own bench/sim_server.py and package) to the ``sim`` rounds, named
``sim-w2@REV``: the engine's CPU per request of one tree against another's, in one run.

``model``: the bundled model on ONNX Runtime (the CPU), 32 x 1 and 4 x 32, ``embedsvc
serve`` against ``embedsvc serve --workers 2``.

Both start every server anew each round and alternate them (reversed every other round), so
that a drift of the shared machine touches all; ratios are taken within a round.

``memory``: ``embedsvc serve --workers N``, ``gunicorn -w N embedsvc:app`` with and without
``--preload``, and the same two under ``EMBEDSVC_ENGINE=inline`` (each worker its own model,
as before the engine process), each after ``--load`` seconds of 32 x 1 traffic so that every
worker has served: the processes that map ONNX Runtime (``/proc/PID/maps``), and the RSS and
PSS (``/proc/PID/smaps_rollup``) of every process of the server.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import run  # noqa: E402 - the path above makes the repository importable

SIM = {"sim": "embedsvc, one process", "sim-w2": "embedsvc --workers 2",
       "bare": "bare waitress app", "bare-gunicorn-w2": "bare app, gunicorn -w 2"}
MODEL = {"embedsvc": "embedsvc, one process", "embedsvc-w2": "embedsvc --workers 2"}
SIM_32X1 = run.Scenario("sim 32x1", 32, 1)
MODEL_SCENARIOS = [sc for sc in run.SCENARIOS if sc.name in ("32x1", "4x32")]
ENGINE_GOAL_US = 40.0
_PID = re.compile(r"pid=(\d+)")
WORKERS_GOAL = 1.3


@dataclass
class Measured:
    server: str
    scenario: run.Scenario
    round: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int
    cpu_s: float  # every process of the server
    engine_cpu_s: float | None  # the engine process's, where it is one of its own
    split: list[int] = field(default_factory=list)  # connections by process (``connections``)
    engine_threads: dict[str, float] = field(default_factory=dict)  # seconds, by ``thread_role``

    def per_request_us(self, seconds: float | None) -> float | None:
        return None if seconds is None or not self.requests else seconds / self.requests * 1e6


def engine_pid(server: run.Running) -> int | None:
    """The server's engine process (``embedsvc engine``), if it has one."""
    for pid in run._tree(server.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"engine" in argv[1:4]:
            return pid
    return None


def thread_role(pid: int, tid: int, name: str) -> str:
    """Which of the engine's threads: its loop (the main thread, ``EngineServer.run``),
    ZeroMQ's I/O thread, or the others (the batcher's above all, the watchdog's)."""
    if tid == pid:
        return "loop"
    return "ZeroMQ I/O" if name.startswith("ZMQbg") else "batcher and others"


def threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid``'s threads by ``thread_role`` (the scheduler's nanoseconds)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
        except OSError:  # a thread that just ended
            continue
        role = thread_role(pid, int(task.name), name)
        out[role] = out.get(role, 0.0) + ns / 1e9
    return out


def connections(port: int) -> list[int]:
    """The clients' connections to ``port`` held by each process that holds any, most first
    (which front each keep-alive client landed on decides how the load divides)."""
    out = subprocess.run(["ss", "-Htnp", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True).stdout
    found = Counter(pid for line in out.splitlines() for pid in set(_PID.findall(line)))
    return sorted(found.values(), reverse=True)


def measure(server: run.Running, sc: run.Scenario, seconds: float, round_no: int
            ) -> Measured:
    run.wrk(server, sc, 2)  # warm-up: caches, thread pools
    engine = engine_pid(server)
    cpu_before = server.cpu_seconds()
    engine_before = run._cpu_ticks(engine) if engine else 0
    threads_before = threads_cpu_s(engine) if engine else {}
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(run.wrk, server, sc, seconds)
        time.sleep(min(1.0, seconds / 2))
        split = connections(int(server.url.rsplit(":", 1)[1]))
        stats = load.result()
    engine_cpu = (run._cpu_ticks(engine) - engine_before) / run.CLK_TCK if engine else None
    threads = {role: s - threads_before.get(role, 0.0)
               for role, s in (threads_cpu_s(engine) if engine else {}).items()}
    return Measured(server.name, sc, round_no, stats["requests"] / stats["seconds"],
                    stats["p50_ms"], stats["p99_ms"], stats["errors"], stats["requests"],
                    server.cpu_seconds() - cpu_before, engine_cpu, split, threads)


def tree_command(name: str, port: int) -> tuple[list[str], str, dict[str, str]] | None:
    """``sim-w2@REV``: revision REV's simulated device under ``--workers 2``; None for the
    servers of bench/run.py."""
    if "@" not in name:
        return None
    tree = run.baseline_tree(name.split("@", 1)[1])
    return [sys.executable, str(tree / "bench" / "sim_server.py"), "--port", str(port),
            "--workers", "2"], "/v1/embeddings", {"PYTHONPATH": str(tree)}


def rounds(names: list[str], scenarios: list[run.Scenario], count: int, seconds: float
           ) -> list[Measured]:
    """Every server in turn, ``count`` times, the order reversed every other round."""
    out: list[Measured] = []
    for r in range(count):
        for port, name in enumerate(names if r % 2 == 0 else names[::-1], start=18901):
            server = run.Running(name, port, tree_command(name, port))
            try:
                for sc in scenarios:
                    got = measure(server, sc, seconds, r)
                    out.append(got)
                    engine = got.per_request_us(got.engine_cpu_s)
                    print(f"round {r + 1} {name} {sc.name}: {got.rps:,.0f} req/s, p50 "
                          f"{got.p50_ms:.1f} ms, errors {got.errors}, server "
                          f"{got.per_request_us(got.cpu_s):.0f} us/req"
                          + (f", engine {engine:.1f} us/req" if engine is not None else "")
                          + f", connections {'/'.join(map(str, got.split))}", flush=True)
            finally:
                server.stop()
    return out


def _of(results: list[Measured], server: str, sc: str) -> list[Measured]:
    return [m for m in results if m.server == server and m.scenario.name == sc]


def server_table(results: list[Measured], labels: dict[str, str]) -> str:
    lines = ["| scenario | server | req/s (median) | each round | inputs/s | p50 ms | p99 ms "
             "| errors | server CPU us/req | engine CPU us/req |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for sc in dict.fromkeys(m.scenario.name for m in results):
        for name, label in labels.items():
            runs = _of(results, name, sc)
            if not runs:
                continue
            requests = sum(m.requests for m in runs)
            cpu = sum(m.cpu_s for m in runs) / requests * 1e6
            engines = [m.engine_cpu_s for m in runs if m.engine_cpu_s is not None]
            engine = f"{sum(engines) / requests * 1e6:.1f}" if engines else "-"
            rps = median(m.rps for m in runs)
            lines.append(
                f"| {sc} | {label} | {rps:,.0f} | {', '.join(f'{m.rps:,.0f}' for m in runs)} | "
                f"{rps * runs[0].scenario.inputs:,.0f} | {median(m.p50_ms for m in runs):.1f} | "
                f"{median(m.p99_ms for m in runs):.1f} | {sum(m.errors for m in runs)} | "
                f"{cpu:.0f} | {engine} |")
    return "\n".join(lines)


def ratio_line(results: list[Measured], sc: str, top: str, bottom: str) -> str:
    """``top`` / ``bottom``'s rate, round by round (each pair measured within one round)."""
    tops, bottoms = _of(results, top, sc), _of(results, bottom, sc)
    if not tops or not bottoms:
        return f"{top} / {bottom}: not measured"
    pairs = [a.rps / b.rps for a, b in zip(tops, bottoms, strict=True) if b.rps]
    if not pairs:
        return f"{top} / {bottom}: not measured"
    return (f"{top} / {bottom} ({sc}): median {median(pairs):.2f}x (rounds: "
            + ", ".join(f"{p:.2f}" for p in pairs) + ")")


def sim_scenarios(clients: str) -> list[run.Scenario]:
    """``sim Nx1`` for each N of ``clients`` (``--clients``: 1 for a lone client's latency)."""
    return [SIM_32X1 if n == "32" else run.Scenario(f"sim {int(n)}x1", int(n), 1)
            for n in clients.split(",")]


def sim_report(results: list[Measured], labels: dict[str, str]) -> str:
    lines = [server_table(results, labels), ""]
    for sc in dict.fromkeys(m.scenario.name for m in results):
        lines += ["- " + ratio_line(results, sc, "sim-w2", "sim") + f"; goal {WORKERS_GOAL}x",
                  "- " + ratio_line(results, sc, "bare-gunicorn-w2", "bare"),
                  "- " + ratio_line(results, sc, "sim", "bare"),
                  "- " + ratio_line(results, sc, "sim-w2", "bare-gunicorn-w2")]
        lines += ["- " + ratio_line(results, sc, "sim-w2", tree)
                  for tree in labels if "@" in tree]
    sc = SIM_32X1.name
    for name in (n for n in labels if n.startswith("sim-w2")):
        runs = _of(results, name, sc)
        requests = sum(m.requests for m in runs)
        if requests:
            engine = sum(m.engine_cpu_s or 0.0 for m in runs)
            roles = dict.fromkeys(role for m in runs for role in m.engine_threads)
            by_thread = ", ".join(
                f"{role} {sum(m.engine_threads.get(role, 0.0) for m in runs) / requests * 1e6:.1f}"
                for role in roles)
            lines.append(f"- the engine process's own CPU, {labels[name]}: "
                         f"{engine / requests * 1e6:.1f} us a request, pooled over the rounds "
                         f"(goal at most {ENGINE_GOAL_US:.0f}); each round: " + ", ".join(
                             f"{m.per_request_us(m.engine_cpu_s):.1f}" for m in runs)
                         + f"; by thread (us a request): {by_thread}; its ceiling: "
                         f"{requests / engine:,.0f} requests a second (1e6 / us a request), "
                         "whatever the device")
    return "\n".join(lines)


def model_report(results: list[Measured]) -> str:
    lines = [server_table(results, MODEL), ""]
    lines += ["- " + ratio_line(results, sc.name, "embedsvc-w2", "embedsvc")
              for sc in MODEL_SCENARIOS]
    return "\n".join(lines)


# -- memory ---------------------------------------------------------------------------------


def memory_launches(workers: int, port: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    gunicorn = [str(run.VENV_BIN / "gunicorn"), "-w", str(workers), "-b", f"127.0.0.1:{port}",
                "--timeout", "60", "--no-control-socket", "--log-level", "warning"]
    inline = {"EMBEDSVC_ENGINE": "inline"}
    return {
        f"embedsvc serve --workers {workers}": (
            [str(run.VENV_BIN / "embedsvc"), "serve", "--port", str(port), "--workers",
             str(workers), "--log-level", "warning"], {}),
        f"gunicorn -w {workers} embedsvc:app": ([*gunicorn, "embedsvc:app"], {}),
        f"gunicorn -w {workers} --preload embedsvc:app": (
            [*gunicorn, "--preload", "embedsvc:app"], {}),
        f"ENGINE=inline gunicorn -w {workers} embedsvc:app (before)": (
            [*gunicorn, "embedsvc:app"], inline),
        f"ENGINE=inline gunicorn -w {workers} --preload embedsvc:app (before)": (
            [*gunicorn, "--preload", "embedsvc:app"], inline),
    }


@dataclass
class Process:
    pid: int
    role: str
    rss_kib: int
    pss_kib: int
    maps_runtime: bool  # maps the library named by --maps (ONNX Runtime's, CUDA's)
    gpu_mib: int = 0


def role(pid: int, top: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    if b"engine" in argv[1:4]:
        return "engine"
    if b"front" in argv[1:4]:
        return "front"
    return ("supervisor" if b"serve" in argv else "master") if pid == top else "worker"


def _kib(path: str, key: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def gpu_memory() -> dict[int, int]:
    """MiB of device memory by pid, where nvidia-smi is there."""
    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    pairs = (line.split(",") for line in out.stdout.splitlines() if "," in line)
    return {int(pid): int(mib) for pid, mib in pairs}


def processes(top: int, library: str) -> list[Process]:
    out = []
    gpu = gpu_memory()
    for pid in run._tree(top):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            out.append(Process(pid, role(pid, top), _kib(f"/proc/{pid}/status", "VmRSS"),
                               _kib(f"/proc/{pid}/smaps_rollup", "Pss"), library in maps,
                               gpu.get(pid, 0)))
        except OSError:  # it ended meanwhile
            continue
    return out


def memory(workers: int, load_s: float, library: str) -> str:
    lines = [f"| launch | processes | mapping {library} | RSS, all processes | PSS, all "
             "processes | device memory | each process: role RSS/PSS MiB |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for n, label in enumerate(memory_launches(workers, 0), start=1):
        port = 18950 + n
        cmd, env = memory_launches(workers, port)[label]
        print(f"{label} ...", flush=True)
        try:
            server = run.Running(f"memory-{n}", port, (cmd, "/v1/embeddings", env))
        except RuntimeError as exc:  # ENGINE=inline --preload on CUDA, say: a row that says so
            lines.append(f"| `{label}` | did not serve: {str(exc)[-300:]!r} | | | | | |")
            continue
        try:
            run.wrk(server, run.SCENARIOS[1], load_s)  # every worker serves (and loads)
            time.sleep(1)
            found = processes(server.proc.pid, library)
        finally:
            server.stop()
        each = ", ".join(f"{p.role} {p.rss_kib / 1024:.0f}/{p.pss_kib / 1024:.0f}"
                         for p in sorted(found, key=_order))
        gpu = sum(p.gpu_mib for p in found)
        lines.append(f"| `{label}` | {len(found)} | {sum(p.maps_runtime for p in found)} | "
                     f"{sum(p.rss_kib for p in found) / 1024:,.0f} MiB | "
                     f"{sum(p.pss_kib for p in found) / 1024:,.0f} MiB | "
                     f"{f'{gpu:,} MiB' if gpu else '-'} | {each} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def _order(p: Process) -> tuple[int, int]:
    return (["supervisor", "master", "engine", "front", "worker"].index(p.role)
            if p.role != "gone" else 9, p.pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("sim", "model", "memory"))
    parser.add_argument("--duration", type=float, default=10, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ... for every server")
    parser.add_argument("--only", help="sim, model: comma-separated servers of "
                        + ", ".join([*SIM, *MODEL]) + " (default: all of the comparison)")
    parser.add_argument("--clients", default="32", help="sim: comma-separated numbers of "
                        "clients, each sending 1 input a request (32: the comparison's)")
    parser.add_argument("--trees", default="", help="sim: comma-separated git revisions whose "
                        "--workers 2 joins the rounds (sim-w2@REV)")
    parser.add_argument("--workers", type=int, default=4, help="memory: workers of each launch")
    parser.add_argument("--load", type=float, default=8, help="memory: seconds of traffic first")
    parser.add_argument("--maps", default="onnxruntime", help="memory: the library whose "
                        "mappers are counted (libcuda on a GPU)")
    parser.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args(argv)
    os.environ["EMBEDSVC_DEVICE"] = args.device
    run.OUT.mkdir(exist_ok=True)
    sim = {**SIM, **{f"sim-w2@{rev}": f"embedsvc --workers 2 at {rev}"
                     for rev in filter(None, args.trees.split(","))}}

    def servers(labels: dict[str, str]) -> list[str]:
        return [n for n in labels if args.only is None or n in args.only.split(",") or "@" in n]

    reports: dict[str, Callable[[], str]] = {
        "sim": lambda: sim_report(rounds(servers(sim), sim_scenarios(args.clients), args.rounds,
                                         args.duration), sim),
        "model": lambda: model_report(rounds(servers(MODEL), MODEL_SCENARIOS, args.rounds,
                                             args.duration)),
        "memory": lambda: memory(args.workers, args.load, args.maps),
    }
    report = reports[args.what]()
    print("\n" + report)
    if args.record:
        command = "python bench/workers.py " + " ".join(argv if argv is not None
                                                         else sys.argv[1:])
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with open(run.BENCH / "RESULTS.md", "a") as f:
            f.write(f"\n## {when}: `{command}`\n\n{os.cpu_count()} cores, "
                    f"{platform.machine()}, device {args.device}; wrk and the servers share "
                    f"the cores.\n\n{report}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
