"""Memory of one service of three models against three one-model services (issue 49).

    flock /tmp/embedsvc-bench.lock env HF_HUB_OFFLINE=1 PYTHONPATH=$PWD \\
        .venv/bin/python bench/models_memory.py --rounds 2 --record

The models: the bundled all-MiniLM-L6-v2, a tiny random reranker and a tiny random SPLADE
encoder (tests/models.py), built once under bench/out/models-memory/ with every model's record
exported into one cache directory there, so that no server of the run loads PyTorch.

For each launch (``embedsvc serve``, one process; ``embedsvc serve --workers 2``), each round
starts (a) one service of the three models (``--models``) alone, and (b) the three one-model
services side by side (the same flags, ``--model`` each, a port each), as a host would run
them. Every model then gets warm-up requests (``/embed``, ``/rerank``, ``/embed_sparse``, 16
each over 4 threads, a new connection each, so that both fronts of ``--workers 2`` serve),
and each server's whole process tree (its pid and every descendant) is measured from
``/proc/PID/smaps_rollup``: RSS, PSS (each shared page divided among the processes that map
it: the fair figure where processes share pages) and USS (private pages only). The
configurations alternate (a, b; then b, a) from round to round; only one configuration runs
at a time, so (b)'s three trees share their pages with each other and with nothing of (a)'s.

Printed: each configuration's processes, RSS, PSS and USS; (a) / (b) for each launch and
round; and the last round's figures by server and role (the one process; the supervisor, the
fronts, the engines of ``--workers``).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from bench.engine_kill import tree  # noqa: E402 - the path above makes the repository importable

OUT = BENCH / "out" / "models-memory"
BIN = Path(sys.executable).parent
BASE_PORT = 18640
LAUNCHES = {"one process": [], "--workers 2": ["--workers", "2"]}
EMBEDDER = "all-MiniLM-L6-v2"
TEXTS = ["a first text to warm the model with", "and a second, a little longer than the first",
         "short"]
WARMUP = {  # kind: (route, body)
    "embedding": ("/embed", {"inputs": TEXTS}),
    "reranker": ("/rerank", {"query": "which text is first?", "texts": TEXTS}),
    "sparse": ("/embed_sparse", {"inputs": TEXTS}),
}
ROLES = ("server", "supervisor", "front", "engine", "other")
CONFIGURATIONS = ("(a) one service, three models", "(b) three one-model services")


def build(out: Path) -> dict[str, str]:
    """The models' sources by kind and the cache directory, built and exported once."""
    dirs = {"reranker": out / "reranker", "sparse": out / "sparse"}
    cache = out / "cache"
    if not (out / "built").exists():
        sys.path.insert(0, str(REPO))
        from embedsvc.model.backend import export
        from embedsvc.settings import Settings
        from tests.models import build_reranker, build_sparse

        build_reranker(dirs["reranker"])
        build_sparse(dirs["sparse"])
        for model in ("", str(dirs["reranker"]), str(dirs["sparse"])):
            export(Settings.from_env(os.environ, model=model, cache_dir=str(cache)))
        (out / "built").touch()
    return {"embedding": "", "reranker": str(dirs["reranker"]), "sparse": str(dirs["sparse"]),
            "cache": str(cache)}


@dataclass
class Memory:
    processes: int = 0
    rss_kib: int = 0
    pss_kib: int = 0
    uss_kib: int = 0

    def add(self, other: Memory) -> None:
        self.processes += other.processes
        self.rss_kib += other.rss_kib
        self.pss_kib += other.pss_kib
        self.uss_kib += other.uss_kib


def role(pid: int, top: int, workers: bool) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    if pid == top:
        return "supervisor" if workers else "server"
    for name in (b"engine", b"front"):
        if name in argv[1:4]:
            return name.decode()
    return "other"


def rollup(pid: int) -> Memory:
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    return Memory(1, fields["Rss"], fields["Pss"],
                  fields["Private_Clean"] + fields["Private_Dirty"])


def measure(top: int, workers: bool) -> dict[str, Memory]:
    """The tree's memory by role."""
    by_role: dict[str, Memory] = defaultdict(Memory)
    for pid in tree(top):
        try:
            by_role[role(pid, top, workers)].add(rollup(pid))
        except OSError:  # it ended meanwhile
            continue
    return by_role


class Server:
    def __init__(self, name: str, args: list[str], port: int, cache: str) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = OUT / f"{name}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "EMBEDSVC_DEVICE": "cpu",
               "EMBEDSVC_CACHE_DIR": cache}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([str(BIN / "embedsvc"), "serve", "--port", str(port),
                                          *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=REPO)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout} s: see {self.log}")

    def warm(self, kinds: list[str]) -> None:
        def one(kind: str) -> None:
            route, body = WARMUP[kind]
            resp = httpx.post(self.url + route, json=body, timeout=60)  # a new connection each
            if resp.status_code != 200:
                raise RuntimeError(f"{self.name} {route}: {resp.status_code} {resp.text[:300]}")

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, [kind for kind in kinds for _ in range(16)]))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def configurations(sources: dict[str, str]) -> dict[str, list[tuple[str, list[str]]]]:
    """Each configuration's servers: (the models it serves, its models' flags)."""
    models = (f"{EMBEDDER}={sources['embedding']},reranker={sources['reranker']},"
              f"sparse={sources['sparse']}")
    return {
        CONFIGURATIONS[0]: [("+".join(WARMUP), ["--models", models])],
        CONFIGURATIONS[1]: [(kind, ["--model", sources[kind]]) for kind in WARMUP],
    }


Measured = dict[tuple[str, str], Memory]  # (the server's models, a role): its processes' memory


def run_configuration(launch: str, servers: list[tuple[str, list[str]]], cache: str
                      ) -> Measured:
    """Start the configuration's servers together, warm every model, measure, stop them."""
    started = [Server(f"{'w2' if LAUNCHES[launch] else 'one'}-{models}",
                      [*flags, *LAUNCHES[launch]], BASE_PORT + n, cache)
               for n, (models, flags) in enumerate(servers)]
    try:
        for server in started:
            server.wait_ready()
        for server, (models, _) in zip(started, servers, strict=True):
            server.warm(models.split("+"))
        time.sleep(2)
        return {(models, name): memory
                for server, (models, _) in zip(started, servers, strict=True)
                for name, memory in measure(server.proc.pid, bool(LAUNCHES[launch])).items()}
    finally:
        for server in started:
            server.stop()


def mib(kib: int) -> str:
    return f"{kib / 1024:,.0f}"


def summed(measured: Measured) -> Memory:
    total = Memory()
    for memory in measured.values():
        total.add(memory)
    return total


def report(results: dict[tuple[int, str, str], Measured], rounds: int) -> str:
    lines = ["| round | launch | configuration | processes | RSS MiB | PSS MiB | USS MiB |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for (rnd, launch, config), measured in results.items():
        total = summed(measured)
        lines.append(f"| {rnd} | `{launch}` | {config} | {total.processes} | "
                     f"{mib(total.rss_kib)} | {mib(total.pss_kib)} | {mib(total.uss_kib)} |")
    lines += ["", "| round | launch | (a) / (b) RSS | PSS | USS | (b) - (a) PSS MiB |",
              "|---:|---|---:|---:|---:|---:|"]
    a_name, b_name = CONFIGURATIONS
    for rnd in range(1, rounds + 1):
        for launch in LAUNCHES:
            a, b = summed(results[rnd, launch, a_name]), summed(results[rnd, launch, b_name])
            lines.append(f"| {rnd} | `{launch}` | {a.rss_kib / b.rss_kib:.2f} | "
                         f"{a.pss_kib / b.pss_kib:.2f} | {a.uss_kib / b.uss_kib:.2f} | "
                         f"{mib(b.pss_kib - a.pss_kib)} |")
    lines += ["", f"Round {rounds} by server and role (in brackets: each process on average):",
              "", "| launch | configuration | server's models | role | processes | RSS MiB | "
              "PSS MiB | USS MiB |", "|---|---|---|---|---:|---:|---:|---:|"]
    for (rnd, launch, config), measured in results.items():
        if rnd != rounds:
            continue
        for (models, name), m in sorted(measured.items(),
                                        key=lambda kv: (kv[0][0], ROLES.index(kv[0][1]))):
            lines.append(
                f"| `{launch}` | {config[:3]} | {models} | {name} | {m.processes} | "
                f"{mib(m.rss_kib)} | {mib(m.pss_kib)} ({mib(m.pss_kib // m.processes)}) | "
                f"{mib(m.uss_kib)} ({mib(m.uss_kib // m.processes)}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    OUT.mkdir(parents=True, exist_ok=True)
    sources = build(OUT)
    configs = configurations(sources)
    results: dict[tuple[int, str, str], Measured] = {}
    for rnd in range(1, args.rounds + 1):
        order = list(configs) if rnd % 2 else list(reversed(configs))
        for launch in LAUNCHES:
            for config in order:
                print(f"round {rnd}: {launch}, {config} ...", flush=True)
                results[rnd, launch, config] = run_configuration(launch, configs[config],
                                                                 sources["cache"])
    results = dict(sorted(results.items(), key=lambda kv: (kv[0][0], list(LAUNCHES).index(
        kv[0][1]), kv[0][2])))
    table = report(results, args.rounds)
    print("\n" + table)
    if args.record:
        command = "python bench/models_memory.py " + " ".join(
            argv if argv is not None else sys.argv[1:])
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with open(BENCH / "RESULTS.md", "a") as f:
            f.write(f"\n## {when}: `{command}`\n\n{os.cpu_count()} cores, "
                    f"{platform.machine()}, device cpu, shared with other work (load average "
                    f"{os.getloadavg()[0]:.1f} at the end).\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
