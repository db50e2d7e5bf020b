"""One model's engine killed under load, many times: are the other models' requests slower?

    flock /tmp/embedsvc-bench.lock env HF_HUB_OFFLINE=1 PYTHONPATH=$PWD \\
        .venv/bin/python bench/models_kill.py --kills 10

Issue 49 asks that, when one model's engine is SIGKILLed under load, the other models'
requests all answer 200 and none takes more than twice their unloaded p99. A test sees one
kill; this bench sees many, and beside each kill a control: the same window with no kill, so
that what the kill costs is told apart from what this machine's other work costs.

The service: the bundled all-MiniLM-L6-v2, a tiny random reranker and a tiny random SPLADE
encoder (bench/models_memory.py builds and exports them), under ``embedsvc serve --workers 2``
and ``gunicorn -w 2 --threads 8``. Two client threads per other model (the embedder's
``/v1/embeddings`` and the sparse model's ``/embed_sparse``, one light input each) send back
to back the whole run (``--threads``, ``--pause-ms``: fewer, or with a pause between an answer
and the next request, for a load that leaves the cores idle part of the time). Then,
alternating, a **kill** window (the reranker's engine SIGKILLed, then ``/rerank`` polled
every 0.1 s until it answers 200 again after a 503) and a **control** window as long, with
no kill; each window takes in the 0.5 s after it too. For each window:
the others' p99 in the 3 s before it (the "unloaded" p99: the same load, no failure), the
slowest request of the window, and how many went past twice that p99.

Printed: one line a window, then for each launch the windows with a request past 2x p99, kill
against control, the largest ratio of each, and the replacement's time to 200.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from bench.engine_kill import wait_ok  # noqa: E402 - the path above
from bench.models_memory import BIN, EMBEDDER, OUT, build  # noqa: E402

BASE_PORT = 18660
OTHERS = {EMBEDDER: ("/v1/embeddings", {"input": ["a light text"], "model": EMBEDDER}),
          "sparse": ("/embed_sparse", {"inputs": ["a light text"]})}
BEFORE_S = 3.0  # the p99 a window is judged by: this long before it


@dataclass
class Window:
    launch: str
    what: str  # "kill" or "control"
    p99: dict[str, float]
    slowest: dict[str, float]
    past: int  # the others' requests past 2x their p99 in the window
    errors: int  # the others' answers that were not 200
    recovered_s: float | None  # a kill's: from the kill to the reranker's 200


def launches(sources: dict[str, str], port: int) -> dict[str, list[str]]:
    models = (f"{EMBEDDER}={sources['embedding']},reranker={sources['reranker']},"
              f"sparse={sources['sparse']}")
    return {
        "--workers 2": [str(BIN / "embedsvc"), "serve", "--port", str(port), "--models",
                        models, "--workers", "2"],
        "gunicorn -w 2": [str(BIN / "gunicorn"), "-w", "2", "--threads", "8", "-b",
                          f"127.0.0.1:{port}", "embedsvc:app"],
    }, models


class Load:
    """``threads`` a model, each sending its next request ``pause_s`` after its last answer;
    every answer kept as (model, status, end, seconds)."""

    def __init__(self, url: str, threads: int, pause_s: float) -> None:
        self.url, self.seen, self.pause_s = url, [], pause_s
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(name,))
                        for name in OTHERS for _ in range(threads)]

    def _run(self, name: str) -> None:
        route, body = OTHERS[name]
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                status = client.post(self.url + route, json=body).status_code
                ended = time.monotonic()
                self.seen.append((name, status, ended, ended - started))
                if self.pause_s:
                    time.sleep(self.pause_s)

    def judge(self, launch: str, what: str, start: float, end: float,
              recovered: float | None) -> Window:
        seen = list(self.seen)
        p99, slowest, past, errors = {}, {}, 0, 0
        for name in OTHERS:
            before = [s for n, _, at, s in seen if n == name and start - BEFORE_S <= at < start]
            during = [(status, s) for n, status, at, s in seen if n == name and start <= at < end]
            p99[name] = statistics.quantiles(before, n=100)[98]
            slowest[name] = max(s for _, s in during)
            past += sum(s > 2 * p99[name] for _, s in during)
            errors += sum(status != 200 for status, _ in during)
        return Window(launch, what, p99, slowest, past, errors, recovered)


def kill_window(url: str, engine: int) -> float:
    """SIGKILL the reranker's engine; the seconds until /rerank answers 200 after a 503."""
    killed = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    refused = False
    with httpx.Client(timeout=60) as client:
        while time.monotonic() - killed < 60:
            status = client.post(url + "/rerank", json={"query": "q", "texts": ["a"]}).status_code
            refused = refused or status == 503
            if status == 200 and refused:
                return time.monotonic() - killed
            time.sleep(0.1)
    raise RuntimeError("the reranker did not come back within 60 s")


def reranker_engine(url: str) -> int:
    about = httpx.get(url + "/info", timeout=30).json()
    return next(m["engine_pid"] for m in about["models"] if m["name"] == "reranker")


def run_launch(launch: str, line: list[str], models: str, cache: str, kills: int,
               port: int, load_args: tuple[int, float]) -> list[Window]:
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "EMBEDSVC_DEVICE": "cpu",
           "EMBEDSVC_CACHE_DIR": cache, "EMBEDSVC_MODELS": models}
    log = open(OUT / f"kill-{launch.replace(' ', '')}.log", "wb")  # noqa: SIM115 - kept open
    proc = subprocess.Popen(line, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)
    windows: list[Window] = []
    try:
        wait_healthy(url, proc)
        load = Load(url, *load_args)
        for thread in load.threads:
            thread.start()
        time.sleep(BEFORE_S + 1)  # warm, and a first p99
        for _ in range(kills):
            start = time.monotonic()
            recovered = kill_window(url, reranker_engine(url))
            windows.append(judged(load, launch, "kill", start, recovered))
            wait_healthy(url, proc)
            time.sleep(BEFORE_S)  # the next window's p99: its own 3 s before
            start = time.monotonic()
            time.sleep(recovered)  # as long as the kill's window, with no kill
            windows.append(judged(load, launch, "control", start, None))
            time.sleep(BEFORE_S)
        load.stop.set()
        for thread in load.threads:
            thread.join()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        log.close()
    return windows


def judged(load: Load, launch: str, what: str, start: float, recovered: float | None
           ) -> Window:
    time.sleep(0.5)  # what follows the window belongs to it
    window = load.judge(launch, what, start, time.monotonic(), recovered)
    print(line_of(window), flush=True)
    return window


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    if wait_ok(url, timeout) is None or proc.poll() is not None:
        raise RuntimeError(f"the service did not become healthy (exit code {proc.poll()})")


def line_of(window: Window) -> str:
    others = ", ".join(f"{name} p99 {window.p99[name] * 1e3:.0f} ms, slowest "
                       f"{window.slowest[name] * 1e3:.0f} ms" for name in OTHERS)
    back = "" if window.recovered_s is None else f"; reranker back in {window.recovered_s:.1f} s"
    return (f"{window.launch:14} {window.what:7} {others}; past 2x p99: {window.past}; "
            f"not 200: {window.errors}{back}")


def summary(windows: list[Window]) -> str:
    rows = ["| launch | windows | with a request past 2x p99 | largest slowest / p99 | "
            "reranker back in (median) |", "|---|---|---:|---:|---:|"]
    for launch in dict.fromkeys(w.launch for w in windows):
        for what in ("control", "kill"):
            mine = [w for w in windows if w.launch == launch and w.what == what]
            worst = max(w.slowest[n] / w.p99[n] for w in mine for n in OTHERS)
            back = [w.recovered_s for w in mine if w.recovered_s is not None]
            median = f"{statistics.median(back):.1f} s" if back else "-"
            rows.append(f"| {launch} | {what} x {len(mine)} | "
                        f"{sum(w.past > 0 for w in mine)} | {worst:.1f}x | {median} |")
    errors = sum(w.errors for w in windows)
    rows.append(f"\nThe other models' answers that were not 200, in every window: {errors}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=10, help="kill windows per launch")
    parser.add_argument("--launch", action="append", help="only these launches")
    parser.add_argument("--threads", type=int, default=2, help="client threads a model")
    parser.add_argument("--pause-ms", type=float, default=0.0,
                        help="each client's pause between an answer and its next request: "
                        "a load that leaves the cores idle part of the time")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    sources = build(OUT)
    lines, models = launches(sources, BASE_PORT)
    windows: list[Window] = []
    for launch, line in lines.items():
        if args.launch and launch not in args.launch:
            continue
        windows += run_launch(launch, line, models, sources["cache"], args.kills, BASE_PORT,
                              (args.threads, args.pause_ms / 1000))
    print()
    print(summary(windows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
