"""Issue 26's single-request attacks, one at a time, against a live `embedsvc serve`: the
answer's status and time and the peak growth of the server's resident memory.

    PYTHONPATH=$PWD .venv/bin/python bench/attacks.py
    PYTHONPATH=$PWD .venv/bin/python bench/attacks.py --only rerank
    PYTHONPATH=$PWD .venv/bin/python bench/attacks.py --only embedding --match "invalid 2 MB"

(PYTHONPATH: the server it starts runs this checkout's code even when the venv's editable
install points at another checkout.)

The embedding attacks run against the bundled model; the rerank ones against a random BERT
of ms-marco-MiniLM-L6-v2's shape (bench/rerank.py builds it; 512-token limit). Each attack
is sent alone, after the server's high-water mark is reset (/proc/PID/clear_refs, "5"); the
growth is VmHWM minus VmRSS at the reset. Concurrent attacks (twelve /decode bodies, three
document bodies) send their bodies at once. Meanwhile a prober GETs /health on the probe port
(HEALTH_PORT) every 20 ms, each on a new connection as a kubelet's probe; the slowest answer
is the last column, the CPU time the server spent (user and system, /proc/PID/stat) before it.
Clients and server share this machine's cores.

After the embedding attacks, the body lane (api/lane.py): a legitimate 1 MiB /embed sent
50 ms after a large body that its parse refuses; the seconds the legitimate one took.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rerank import minilm_shaped_reranker  # noqa: E402
from soak import start_server  # noqa: E402

MiB = 1 << 20
INVALID_IDS = [1] * 999_999 + [1.5]  # 2 MB
EMBEDDING = [
    ("invalid 2 MB list", "/embed", orjson.dumps({"inputs": INVALID_IDS}), 1),
    ("invalid 2 MB list in Cohere's texts", "/v2/embed", orjson.dumps({"texts": INVALID_IDS}),
     1),
    ("invalid 2 MB list in Cohere's embedding_types", "/v2/embed",
     orjson.dumps({"texts": ["a"], "embedding_types": INVALID_IDS}), 1),
    ("invalid 2 MB list in Ollama's input", "/api/embed", orjson.dumps({"input": INVALID_IDS}),
     1),
    ("16 MB /decode, 12 at once", "/decode", orjson.dumps({"ids": [[1] * 4090] * 2048}), 12),
    ("/embed_all, 33 inputs (over the cap)", "/embed_all",
     orjson.dumps({"inputs": ["!" * 254] * 33}), 1),
    ("/embed_all, 32 inputs of 256 tokens", "/embed_all",
     orjson.dumps({"inputs": ["!" * 254] * 32}), 1),
    ("16 MB of OpenAI ids (128 spaces each)", "/v1/embeddings",
     orjson.dumps({"input": [[58040] * 1364] * 2048}), 1),
    ("/tokenize, 2048 x 8,000 characters", "/tokenize",
     orjson.dumps({"inputs": ["word " * 1600] * 2048}), 1),
]
RERANK = [
    ("200 KB query x 192 texts", "/rerank",
     orjson.dumps({"query": "!" * 199_990, "texts": ["a"] * 192}), 1),
    ("one pair, two 20,000-'!' sides", "/rerank",
     orjson.dumps({"query": "!" * 20_000, "texts": ["!" * 19_999]}), 1),
    ("2048 pairs of 600 tokens, a 100,000-'!' query", "/v2/rerank",
     orjson.dumps({"query": "!" * 100_000,
                   "documents": ["berlin museums ! " * 200] * 2048}), 1),
    ("16 MB of documents, 3 at once", "/v1/rerank",
     orjson.dumps({"query": "which document?",
                   "documents": ["many words in a long document " * 266] * 2048}), 3),
]


# refused in its parse: Cohere's texts (before the fix: 4 CPU-s), 16 MB of ids ending in a
# float (0.3 s at most: what shut the lane for three times that after the fix of issue 26)
BAD_BODIES = [
    ("Cohere's texts, 2 MB invalid", "/v2/embed", orjson.dumps({"texts": INVALID_IDS})),
    ("/embed ids, 16 MB invalid", "/embed",
     orjson.dumps({"inputs": [[1] * 4000] * 2047 + [[1] * 3999 + [1.5]]})),
]
# 1.1 MiB that the model computes in a moment: six texts of 190,000 characters, each cut to
# its first 256 tokens
LEGIT = orjson.dumps({"inputs": ["word " * 38_000] * 6})


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status_kib(pid: int, key: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1))


def start(model: str | None, log: Path) -> tuple[subprocess.Popen, str, int]:
    """The server, its URL and its probe port."""
    proc, url = start_server(log, ["--health-port", "0", *(["--model", model] if model else [])],
                             timeout=300)
    deadline = time.monotonic() + 30
    while not (found := re.search(r"probes on http://127\.0\.0\.1:(\d+)",
                                  log.read_text(errors="replace"))):
        if time.monotonic() > deadline:
            raise SystemExit(f"no probe port logged:\n{log.read_text()}")
        time.sleep(0.1)
    return proc, url, int(found.group(1))


def probe_seconds(port: int) -> float:
    """One GET /health on a new connection, as a kubelet's probe; its seconds."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200, resp.status
    finally:
        conn.close()
    return time.monotonic() - started


def attack(url: str, pid: int, probes: int, route: str, body: bytes,
           copies: int) -> tuple[str, float, float, float, float]:
    """Statuses, seconds until the last answer, peak RSS growth (MiB), slowest probe (s),
    the server's CPU seconds."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    base = status_kib(pid, "VmRSS")
    cpu = cpu_seconds(pid)
    statuses: list[int] = []
    barrier = threading.Barrier(copies)
    probed: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            probed.append(probe_seconds(probes))
            time.sleep(0.02)

    def send() -> None:
        barrier.wait(60)
        resp = httpx.post(url + route, content=body, timeout=300,
                          headers={"content-type": "application/json"})
        statuses.append(resp.status_code)

    prober = threading.Thread(target=probe)
    prober.start()
    started = time.monotonic()
    threads = [threading.Thread(target=send) for _ in range(copies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - started
    done.set()
    prober.join()
    growth = (status_kib(pid, "VmHWM") - base) / 1024
    counted = ", ".join(f"{statuses.count(s)} x {s}" for s in sorted(set(statuses)))
    return counted, took, growth, max(probed, default=float("nan")), cpu_seconds(pid) - cpu


def run(model: str | None, attacks: list, log: Path, lane: bool = False) -> None:
    proc, url, probes = start(model, log)
    try:
        for name, route, body, copies in attacks:
            counted, took, growth, slowest, cpu = attack(url, proc.pid, probes, route, body,
                                                         copies)
            print(f"| {name} | {route} | {len(body) / MiB:.1f} | {counted} | {took:.2f} | "
                  f"{growth:.0f} | {slowest * 1000:.0f} | {cpu:.2f} |", flush=True)
        if lane:
            print("\n| refused body | its answer (s) | legitimate 1 MiB /embed behind it (s) |")
            print("|---|---|---|")
            for name, route, body in BAD_BODIES:
                print(f"| {name} | {behind(url, route, body)} |", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)


def behind(url: str, route: str, bad: bytes) -> str:
    """The refused body's status and seconds, then the legitimate body's, sent 50 ms after."""
    answers: dict[str, tuple[int, float]] = {}

    def send(key: str, path: str, body: bytes) -> None:
        started = time.monotonic()
        resp = httpx.post(url + path, content=body, timeout=120,
                          headers={"content-type": "application/json"})
        answers[key] = (resp.status_code, time.monotonic() - started)

    first = threading.Thread(target=send, args=("bad", route, bad))
    first.start()
    time.sleep(0.05)
    send("legit", "/embed", LEGIT)
    first.join()
    (bad_status, bad_s), (status, seconds) = answers["bad"], answers["legit"]
    return f"{bad_status} in {bad_s:.2f} | {status} in {seconds:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("embedding", "rerank"), help="one model's attacks")
    parser.add_argument("--match", default="", help="only the attacks whose name holds this")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="embedsvc-attacks-"))
    print("| attack | route | body (MiB) | answers | seconds | peak RSS growth (MiB) "
          "| slowest probe (ms) | server CPU (s) |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    if args.only != "rerank":
        run(None, [a for a in EMBEDDING if args.match in a[0]], work / "embedding.log",
            lane=True)
    if args.only != "embedding":
        model = minilm_shaped_reranker(work / "reranker")
        run(str(model), [a for a in RERANK if args.match in a[0]], work / "reranker.log")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
