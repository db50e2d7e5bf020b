"""One engine, many fronts (issue 38): ``--workers N`` against one process, and -w N's memory.

    flock /tmp/embedsvc-bench.lock .venv/bin/python bench/workers.py sim --rounds 3 --duration 10
    flock /tmp/embedsvc-bench.lock .venv/bin/python bench/workers.py model --rounds 3 --duration 10
    flock /tmp/embedsvc-bench.lock .venv/bin/python bench/workers.py memory --workers 4
    flock /tmp/embedsvc-bench.lock .venv/bin/python bench/workers.py frames --rounds 3 --duration 6

``sim``: 32 clients x 1 input (wrk and bench/embed.lua, as bench/run.py drives them) against
embedsvc in one process, ``--workers 2`` and ``--workers 4`` over the simulated zero-cost device
(bench/sim_server.py), a bare waitress app and the same bare app under ``gunicorn -w 2``
(bench/bare_server.py; ``--only ...,bare-adapter`` adds the bare app served by embedsvc's
own waitress adapter, its HTTP layer without its request path; ``bare-handoff`` the bare app
with the one hand-off
to another thread that embedsvc's batcher makes, ``bare-handoff-python`` the same with 100
us of plain Python a request, about embedsvc's own request path, and ``bare-gunicorn-w4`` the
bare app under ``gunicorn -w 4``: what four HTTP processes on these cores cost against two,
beside ``--workers 4`` against ``--workers 2``); with each server's CPU per
request (every process of it) and, for ``--workers``, the engine process's own
(``/proc/PID/stat``'s utime and stime before and after the measured seconds, over the
requests answered). The engine's figure in µs moves with the host's speed from one window
to the next, as one process's does; its share of the server's CPU, and its CPU a request
over one process's in the same round, do not, and are printed beside it.

``--clients 32,1`` runs the ``sim`` rounds at each count of clients (1: latency alone, where
``--workers 2``'s p50 is compared with one process's). ``BENCH_ENGINE_PROFILE=DIR`` in the
environment has the engine process profile its loop and batcher thread into DIR
(bench/sim_server.py).

``--trees REV,...`` adds each git revision REV (a checkout under bench/out/, its own
bench/sim_server.py and package) to the ``sim`` rounds: ``embedsvc --workers 2`` as
``sim-w2@REV`` where ``sim-w2`` runs, and one process as ``sim@REV`` where ``sim`` runs; the
rate, and the CPU a request (the engine's, and the whole server's), of one tree against
another's, in one run. ``--inputs 32 --clients 4`` makes the rounds 4 clients x 32 inputs (the
bare app answers one input only: leave it out there).

``model``: the bundled model on ONNX Runtime (the CPU), 32 x 1 and 4 x 32, ``embedsvc
serve`` against ``embedsvc serve --workers 2``; ``--trees REV`` adds REV's two as
``embedsvc@REV`` and ``embedsvc-w2@REV``.

Both start every server anew each round and alternate them (reversed every other round), so
that a drift of the shared machine touches all; ratios are taken within a round.

``frames``: the engine process alone (a ``Service`` over the simulated zero-cost device and its
``EngineServer``), driven straight on its socket in the two ways a front can send: a socket
a request, one request in flight on each (32 x 1: how fronts send today, a socket per
request thread), and a socket a front, 16 requests in flight on each (2 x 16: ``Submits``
bursts out, ``Answers`` back, one frame a front a batch), beside one request at a time (1 x 1:
what a wake-up of the engine costs, with nothing to share it); the engine's CPU a request by
thread.

``memory``: ``embedsvc serve --workers N``, ``gunicorn -w N embedsvc:app`` with and without
``--preload``, and the same two under ``EMBEDSVC_ENGINE=inline`` (each worker its own model,
as before the engine process), each after ``--load`` seconds of 32 x 1 traffic so that every
worker has served: the processes that map ONNX Runtime (``/proc/PID/maps``), and the RSS and
PSS (``/proc/PID/smaps_rollup``) of every process of the server.
"""

from __future__ import annotations

import argparse
import itertools
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
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import run  # noqa: E402 - the path above makes the repository importable

SIM = {"sim": "embedsvc, one process", "sim-w2": "embedsvc --workers 2",
       "sim-w4": "embedsvc --workers 4",
       "bare": "bare waitress app", "bare-gunicorn-w2": "bare app, gunicorn -w 2",
       "bare-gunicorn-w4": "bare app, gunicorn -w 4",
       "bare-adapter": "bare app, embedsvc's waitress adapter",
       "bare-handoff": "bare app, a thread hand-off a request",
       "bare-handoff-python": "bare app, a hand-off and 100 us of Python a request"}
# run where --only names them, never by default
ASKED_FOR = {"bare-gunicorn-w4", "bare-adapter", "bare-handoff", "bare-handoff-python"}
MODEL = {"embedsvc": "embedsvc, one process", "embedsvc-w2": "embedsvc --workers 2"}


def sim_scenario(clients: int, inputs: int = 1) -> run.Scenario:
    return run.Scenario(f"sim {clients}x{inputs}", clients, inputs)


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
    # the engine loop's thread: seconds runnable but not running (waiting for a core), sleeps
    # (its poll waiting for frames: about one a turn) and preemptions (``loop_sched``)
    engine_loop: tuple[float, int, int] | None = None

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


def loop_sched(pid: int) -> tuple[float, int, int]:
    """The engine loop's thread (the main one): seconds it was runnable but not running (as
    its ``embedsvc_engine_loop_waiting_seconds_total`` reads them), and its voluntary and
    involuntary context switches: sleeps in its poll, about one a turn, and preemptions by
    another thread on its core."""
    from embedsvc.metrics import thread_waiting_seconds

    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/task/{pid}/status").read_text().splitlines() if ":" in line)
    return (thread_waiting_seconds(pid, pid) or 0.0, int(status["voluntary_ctxt_switches"]),
            int(status["nonvoluntary_ctxt_switches"]))


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
    loop_before = loop_sched(engine) if engine else None
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(run.wrk, server, sc, seconds)
        time.sleep(min(1.0, seconds / 2))
        split = connections(int(server.url.rsplit(":", 1)[1]))
        stats = load.result()
    engine_cpu = (run._cpu_ticks(engine) - engine_before) / run.CLK_TCK if engine else None
    threads = {role: s - threads_before.get(role, 0.0)
               for role, s in (threads_cpu_s(engine) if engine else {}).items()}
    loop = None
    if engine and loop_before is not None:
        after = loop_sched(engine)
        loop = (after[0] - loop_before[0], after[1] - loop_before[1], after[2] - loop_before[2])
    return Measured(server.name, sc, round_no, stats["requests"] / stats["seconds"],
                    stats["p50_ms"], stats["p99_ms"], stats["errors"], stats["requests"],
                    server.cpu_seconds() - cpu_before, engine_cpu, split, threads, loop)


def tree_command(name: str, port: int) -> tuple[list[str], str, dict[str, str]] | None:
    """``sim@REV``, ``sim-w2@REV``: revision REV's simulated device in one process, or under
    ``--workers 2``; ``embedsvc@REV``, ``embedsvc-w2@REV``: the same on the bundled model
    (``embedsvc serve`` of that tree); None for the servers of bench/run.py."""
    if "@" not in name:
        return None
    base, rev = name.split("@", 1)
    tree = run.baseline_tree(rev)
    workers = ["--workers", "2"] if base.endswith("-w2") else []
    if base.startswith("embedsvc"):
        return [sys.executable, "-m", "embedsvc", "serve", "--port", str(port), "--threads",
                "64", *workers, "--log-level", "warning"], "/v1/embeddings", \
            {"PYTHONPATH": str(tree)}
    return [sys.executable, str(tree / "bench" / "sim_server.py"), "--port", str(port),
            *workers], "/v1/embeddings", {"PYTHONPATH": str(tree)}


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
                          + (f" (its loop waited {got.engine_loop[0] / got.requests * 1e6:.0f}"
                             " us/req for a core)" if got.engine_loop and got.requests else "")
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


def sim_report(results: list[Measured], labels: dict[str, str]) -> str:
    lines = [server_table(results, labels), ""]
    for sc in dict.fromkeys(m.scenario.name for m in results):
        lines += sim_lines(results, labels, sc)
    return "\n".join(lines)


def sim_lines(results: list[Measured], labels: dict[str, str], sc: str) -> list[str]:
    """The ratios of scenario ``sc`` and each ``--workers`` server's engine CPU."""
    lines = ["- " + ratio_line(results, sc, "sim-w2", "sim") + f"; goal {WORKERS_GOAL}x",
             "- " + ratio_line(results, sc, "bare-gunicorn-w2", "bare"),
             "- " + ratio_line(results, sc, "sim", "bare"),
             "- " + ratio_line(results, sc, "sim-w2", "bare-gunicorn-w2")]
    if _of(results, "bare-adapter", sc):  # embedsvc's HTTP layer alone, and the rest
        lines += ["- " + ratio_line(results, sc, "bare-adapter", "bare"),
                  "- " + ratio_line(results, sc, "sim", "bare-adapter")]
    if _of(results, "bare-handoff", sc):  # the hand-off's own cost, and what is left
        lines += ["- " + ratio_line(results, sc, "bare-handoff", "bare"),
                  "- " + ratio_line(results, sc, "sim", "bare-handoff")]
    if _of(results, "bare-handoff-python", sc):  # and with a request path's Python beside it
        lines += ["- " + ratio_line(results, sc, "bare-handoff-python", "bare"),
                  "- " + ratio_line(results, sc, "sim", "bare-handoff-python")]
    if _of(results, "sim-w4", sc):  # more fronts than cores: no lower than --workers 2
        lines.append("- " + ratio_line(results, sc, "sim-w4", "sim-w2"))
    if _of(results, "bare-gunicorn-w4", sc):  # what more HTTP processes than cores cost alone
        lines.append("- " + ratio_line(results, sc, "bare-gunicorn-w4", "bare-gunicorn-w2"))
    lines += tree_lines(results, labels, sc)
    lines += ["- " + p50_line(results, sc, name) for name in labels
              if name.startswith("sim-w") and _of(results, name, sc) and _of(results, "sim", sc)]
    for name in (n for n in labels if n.startswith("sim-w")):
        runs = _of(results, name, sc)
        requests = sum(m.requests for m in runs)
        if requests:
            lines.append("- " + engine_line(runs, requests, f"{labels[name]}, {sc}"))
            lines.append("- " + engine_share_line(runs, _of(results, "sim", sc),
                                                  f"{labels[name]}, {sc}"))
    return lines


def tree_lines(results: list[Measured], labels: dict[str, str], sc: str) -> list[str]:
    """Each server of this tree against the same server at each ``--trees`` revision: the
    rate and the CPU a request."""
    lines = []
    for tree in (n for n in labels if "@" in n and _of(results, n, sc)):
        lines += ["- " + ratio_line(results, sc, tree.split("@")[0], tree),
                  "- " + cpu_line(results, sc, tree.split("@")[0], tree)]
    return lines


def cpu_line(results: list[Measured], sc: str, top: str, bottom: str) -> str:
    """``top``'s CPU a request (every process of the server) over ``bottom``'s, pooled over
    the rounds and round by round."""
    tops, bottoms = _of(results, top, sc), _of(results, bottom, sc)
    if not tops or not bottoms:
        return f"CPU a request, {top} / {bottom}: not measured"

    def pooled(runs: list[Measured]) -> float:
        return sum(m.cpu_s for m in runs) / sum(m.requests for m in runs) * 1e6

    rounds = [(a.per_request_us(a.cpu_s) or 0.0) / (b.per_request_us(b.cpu_s) or 1.0)
              for a, b in zip(tops, bottoms, strict=True)]
    return (f"CPU a request, {top} / {bottom} ({sc}): {pooled(tops):.0f} / {pooled(bottoms):.0f} "
            f"us pooled ({pooled(tops) / pooled(bottoms):.2f}x; rounds: "
            + ", ".join(f"{r:.2f}" for r in rounds) + ")")


def p50_line(results: list[Measured], sc: str, name: str) -> str:
    """``name``'s p50 latency over one process's, round by round."""
    pairs = [a.p50_ms / b.p50_ms for a, b in zip(_of(results, name, sc), _of(results, "sim", sc),
                                                  strict=True) if b.p50_ms]
    return (f"p50 {name} / sim ({sc}): median {median(pairs):.2f}x (rounds: "
            + ", ".join(f"{p:.2f}" for p in pairs) + ")") if pairs else f"p50 {name}: -"


def engine_line(runs: list[Measured], requests: int, label: str) -> str:
    engine = sum(m.engine_cpu_s or 0.0 for m in runs)
    roles = dict.fromkeys(role for m in runs for role in m.engine_threads)
    by_thread = ", ".join(
        f"{role} {sum(m.engine_threads.get(role, 0.0) for m in runs) / requests * 1e6:.1f}"
        for role in roles)
    return (f"the engine process's own CPU, {label}: {engine / requests * 1e6:.1f} us a "
            f"request, pooled over the rounds (goal at most {ENGINE_GOAL_US:.0f}); each round: "
            + ", ".join(f"{m.per_request_us(m.engine_cpu_s):.1f}" for m in runs)
            + f"; by thread (us a request): {by_thread}; its ceiling: "
            f"{requests / engine:,.0f} requests a second (1e6 / us a request), whatever the "
            "device" + loop_line(runs, requests))


def engine_share_line(runs: list[Measured], ones: list[Measured], label: str) -> str:
    """The engine's CPU as figures that do not move with the host's speed: its share of the
    server's (every process's) CPU, and its CPU a request over one process's in the same
    round. Each process takes about the same CPU in every round while what a tick gets done
    changes from one window to the next, so the µs a request of both move together
    (bench/RESULTS.md, 2026-12-07 23:55)."""
    shares = [m.engine_cpu_s / m.cpu_s for m in runs if m.engine_cpu_s and m.cpu_s]
    line = (f"the engine's share of the server's CPU, {label}: median {median(shares):.2f} "
            "(rounds: " + ", ".join(f"{s:.2f}" for s in shares) + ")") if shares else \
        f"the engine's share of the server's CPU, {label}: not measured"
    pairs = [(m.per_request_us(m.engine_cpu_s) or 0.0) / one_us
             for m, one in zip(runs, ones, strict=False)
             if (one_us := one.per_request_us(one.cpu_s))]
    if pairs:
        line += ("; its CPU a request over one process's in the same round: median "
                 f"{median(pairs):.2f} (rounds: " + ", ".join(f"{p:.2f}" for p in pairs) + ")")
    return line


def loop_line(runs: list[Measured], requests: int) -> str:
    """Whether the engine's loop had a core when it had work: its wait for one, and its
    sleeps (about one a turn: requests a turn) and preemptions, pooled over ``runs``."""
    loops = [m.engine_loop for m in runs if m.engine_loop is not None]
    if not loops or not requests:
        return ""
    waited, sleeps, preempted = (sum(x[i] for x in loops) for i in range(3))
    return (f"; its loop waited for a core {waited / requests * 1e6:.1f} us a request, slept "
            f"{sleeps / requests * 100:.0f} and was preempted {preempted / requests * 100:.0f} "
            f"times a 100 requests ({requests / max(1, sleeps):.1f} requests a sleep)")


def model_report(results: list[Measured], labels: dict[str, str]) -> str:
    lines = [server_table(results, labels), ""]
    for sc in MODEL_SCENARIOS:
        lines += ["- " + ratio_line(results, sc.name, "embedsvc-w2", "embedsvc"),
                  *tree_lines(results, labels, sc.name)]
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


# -- frames: the engine alone, under the two ways a front can send ---------------------------

FRAME_PATTERNS = {  # name: (sockets, requests in flight on each)
    "one request at a time (1 x 1)": (1, 1),
    "a socket a request (32 x 1)": (32, 1),
    "a socket a front (2 x 16)": (2, 16),
}


def frames_engine(directory: str, ready: Any) -> None:
    """An engine process over the simulated zero-cost device (bench/sim_server.py's), its
    address sent back on ``ready``; it runs until killed."""
    import threading

    from bench.sim_server import fake_encoder
    from embedsvc.remote.place import engine_address, private_dir
    from embedsvc.remote.server import EngineServer
    from embedsvc.service import Service
    from embedsvc.settings import Settings

    service = Service(Settings(log_level="warning"), encoder=fake_encoder())
    service.start(background=False)
    assert service.runner is not None
    address = engine_address(private_dir(Path(directory)))
    server = EngineServer(service.runner, address, card={}, state=lambda: "ready",
                          metrics=service.metrics)
    ready.send(address)
    server.run(threading.Event())


def frames_drive(address: str, sockets: int, depth: int, seconds: float, pid: int
                 ) -> tuple[float, dict[str, float]]:
    """Keep ``depth`` single-input requests in flight on each of ``sockets`` connections,
    each connection's answers replaced by one frame of as many new requests (a ``Submits``
    for several); requests a second and the engine's CPU seconds a request by thread."""
    import select

    from embedsvc.remote import wire
    from embedsvc.remote.stream import connect

    ids = wire.pack_ids([[101, *([7] * 11), 102]])  # a 10-word sentence's 13 tokens
    numbers = itertools.count(1)

    def frame(n: int) -> bytes:
        items = [wire.Submit(next(numbers), "embed", *ids, timeout=30.0) for _ in range(n)]
        return wire.encode(items[0] if n == 1 else wire.Submits(items))

    streams = {}
    for _ in range(sockets):
        stream = connect(address)
        streams[stream.fileno()] = stream
        stream.send(frame(depth))
    poller = select.poll()
    for fd in streams:
        poller.register(fd, select.POLLIN)
    answered, start, before = 0, 0.0, {}
    warm_until = time.monotonic() + 1.0
    try:
        while not start or time.monotonic() < start + seconds:
            if not start and time.monotonic() >= warm_until:
                start, answered, before = time.monotonic(), 0, threads_cpu_s(pid)
            for fd, _ in poller.poll(1000):
                stream = streams[fd]
                for data in stream.read():
                    got = wire.decode_to_front(data)
                    items = got.items if isinstance(got, wire.Answers) else [got]
                    n = sum(len(i.ids) if isinstance(i, wire.Rows) else 1 for i in items)
                    answered += n
                    stream.send(frame(n))
        after = threads_cpu_s(pid)
    finally:
        for stream in streams.values():
            stream.close()
    return answered / seconds, {role: (s - before.get(role, 0.0)) / answered
                                for role, s in after.items()}


def frames(rounds_: int, seconds: float) -> str:
    """Each pattern against a fresh engine process, alternating, ``rounds_`` times."""
    import multiprocessing
    import tempfile

    got: dict[str, list[tuple[float, dict[str, float]]]] = {name: [] for name in FRAME_PATTERNS}
    spawn = multiprocessing.get_context("spawn")
    for r in range(rounds_):
        names = list(FRAME_PATTERNS)
        for name in names if r % 2 == 0 else names[::-1]:
            with tempfile.TemporaryDirectory() as directory:
                mine, theirs = spawn.Pipe()
                engine = spawn.Process(target=frames_engine, args=(directory, theirs))
                engine.start()
                try:
                    address = mine.recv()
                    assert engine.pid is not None
                    got[name].append(frames_drive(address, *FRAME_PATTERNS[name], seconds,
                                                  engine.pid))
                finally:
                    engine.kill()
                    engine.join()
            rate, cpu = got[name][-1]
            print(f"round {r + 1} {name}: {rate:,.0f} req/s, engine "
                  f"{sum(cpu.values()) * 1e6:.1f} us/req", flush=True)
    lines = ["| front pattern | req/s (median) | engine CPU us/req (median) | by thread |",
             "|---|---:|---:|---|"]
    for name, runs in got.items():
        total = median(sum(cpu.values()) for _, cpu in runs)
        roles = dict.fromkeys(role for _, cpu in runs for role in cpu)
        by = ", ".join(f"{role} {median(cpu.get(role, 0.0) for _, cpu in runs) * 1e6:.1f}"
                       for role in roles)
        lines.append(f"| {name} | {median(rate for rate, _ in runs):,.0f} | "
                     f"{total * 1e6:.1f} | {by} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("sim", "model", "memory", "frames"))
    parser.add_argument("--duration", type=float, default=10, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ... for every server")
    parser.add_argument("--only", help="sim, model: comma-separated servers of "
                        + ", ".join([*SIM, *MODEL]) + " (default: all of the comparison but "
                        + ", ".join(ASKED_FOR) + ")")
    parser.add_argument("--trees", default="", help="sim, model: comma-separated git "
                        "revisions whose one process (sim@REV, embedsvc@REV) and --workers 2 "
                        "(sim-w2@REV, embedsvc-w2@REV) join the rounds, beside this tree's "
                        "of each")
    parser.add_argument("--inputs", type=int, default=1, help="sim: inputs a request")
    parser.add_argument("--clients", default="32", help="sim: comma-separated client counts, "
                        "each a scenario of single-input requests (1 for latency alone)")
    parser.add_argument("--workers", type=int, default=4, help="memory: workers of each launch")
    parser.add_argument("--load", type=float, default=8, help="memory: seconds of traffic first")
    parser.add_argument("--maps", default="onnxruntime", help="memory: the library whose "
                        "mappers are counted (libcuda on a GPU)")
    parser.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args(argv)
    os.environ["EMBEDSVC_DEVICE"] = args.device
    run.OUT.mkdir(exist_ok=True)
    revs = list(filter(None, args.trees.split(",")))
    sim = {**SIM, **{f"sim@{rev}": f"embedsvc, one process at {rev}" for rev in revs},
           **{f"sim-w2@{rev}": f"embedsvc --workers 2 at {rev}" for rev in revs}}
    model = {**MODEL, **{f"embedsvc@{rev}": f"embedsvc, one process at {rev}" for rev in revs},
             **{f"embedsvc-w2@{rev}": f"embedsvc --workers 2 at {rev}" for rev in revs}}

    def servers(labels: dict[str, str]) -> list[str]:
        if args.only is None:
            return [n for n in labels if n not in ASKED_FOR]
        return [n for n in labels if n.split("@")[0] in args.only.split(",")]

    reports: dict[str, Callable[[], str]] = {
        "sim": lambda: sim_report(rounds(servers(sim), [sim_scenario(int(c), args.inputs)
                                                        for c in args.clients.split(",")],
                                         args.rounds, args.duration), sim),
        "model": lambda: model_report(rounds(servers(model), MODEL_SCENARIOS, args.rounds,
                                             args.duration), model),
        "memory": lambda: memory(args.workers, args.load, args.maps),
        "frames": lambda: frames(args.rounds, args.duration),
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
