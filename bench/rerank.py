"""Rerank throughput, in one run: ``CrossEncoder.predict`` offline against embedsvc's /rerank.

    .venv/bin/python bench/rerank.py --duration 60 --record

The workload: 1 query x 32 documents of about 100 tokens per request; offline,
``CrossEncoder.predict`` on the same 32 pairs at batch size 32; served, 8 concurrent clients
posting that request to ``embedsvc serve`` on loopback for ``--duration`` seconds, with the
default settings and with MAX_BATCH_SIZE=32 (device batches the size of offline's). No
reranker's weights can be downloaded here, so the model is a randomly initialised BERT of
the shape of cross-encoder/ms-marco-MiniLM-L6-v2 (6 layers, 384 wide, 12 heads), saved as a
CrossEncoder: the same compute as the real one, meaningless scores. ``--model`` takes a
real CrossEncoder directory instead. Clients and server share this machine's cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
OUT = BENCH / "out"
VENV_BIN = Path(sys.executable).parent
QUERY = "how does a reranker order the documents that a vector search returned"
DOCS = 32
CLIENTS = 8
_DEADLINE_S = 600
_PORT = re.compile(r"serving on http://127\.0\.0\.1:(\d+)")


def minilm_shaped_reranker(path: Path) -> Path:
    """A random BERT with ms-marco-MiniLM-L6-v2's shape, saved as a one-label CrossEncoder."""
    if (path / "config_sentence_transformers.json").exists():
        return path
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from embedsvc.model.encoder import bundled_model_path

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=384, num_hidden_layers=6,
                        num_attention_heads=12, intermediate_size=1536, num_labels=1)
    raw = path.with_name(path.name + "-hf")
    BertForSequenceClassification(config).save_pretrained(raw)
    tokenizer.save_pretrained(raw)
    CrossEncoder(str(raw), device="cpu", max_length=512).save_pretrained(str(path))
    return path


def documents(tokenizer, n: int = DOCS, tokens: int = 100) -> list[str]:
    """``n`` different documents of about ``tokens`` tokens each."""
    words = ("retrieval", "document", "search", "vector", "ranking", "query", "index", "model",
             "score", "passage", "relevant", "answer", "question", "token", "batch", "server")
    docs = []
    for i in range(n):
        text, k = "", i
        while len(tokenizer.tokenize(text)) < tokens:
            text += words[k % len(words)] + " "
            k = k * 7 + 3
        docs.append(text.strip())
    return docs


def offline(model: str, pairs: list[tuple[str, str]], seconds: float) -> float:
    """Pairs/s of ``CrossEncoder.predict`` at batch size 32, on the CPU, for ``seconds``."""
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(model, device="cpu")
    ce.predict(pairs, batch_size=DOCS)  # warm up
    done, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        ce.predict(pairs, batch_size=DOCS)
        done += len(pairs)
    return done / (time.monotonic() - started)


def served(model: str, docs: list[str], seconds: float, log: Path, *flags: str
           ) -> tuple[float, str, float]:
    """Pairs/s, failures and p50 latency (ms) of 8 clients posting /rerank for ``seconds``."""
    cmd = [str(VENV_BIN / "embedsvc"), "serve", "--model", model, "--port", "0",
           "--threads", "16", "--device", "cpu",
           # 8 clients x 32 pairs queue ~256 pairs: on a slow shared CPU that is more than the
           # default 30 s deadline, and a 504 would measure the deadline, not the throughput
           "--request-timeout-s", str(_DEADLINE_S), *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = _wait(proc, log)
        body = {"query": QUERY, "texts": docs}
        httpx.post(url + "/rerank", json=body, timeout=60).raise_for_status()  # warm up
        latencies: list[float] = []
        failed: list[str] = []
        stop = time.monotonic() + seconds

        def client() -> None:
            with httpx.Client(timeout=_DEADLINE_S + 60) as c:
                while time.monotonic() < stop:
                    t = time.monotonic()
                    try:
                        status = c.post(url + "/rerank", json=body).status_code
                    except httpx.HTTPError as exc:
                        failed.append(type(exc).__name__)
                        continue
                    if status == 200:
                        latencies.append(time.monotonic() - t)
                    else:
                        failed.append(str(status))

        started = time.monotonic()
        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        latencies.sort()
        p50 = latencies[len(latencies) // 2] * 1000 if latencies else float("nan")
        return len(latencies) * len(docs) / elapsed, ", ".join(sorted(failed)) or "0", p50
    finally:
        proc.terminate()
        proc.wait(60)


def _wait(proc: subprocess.Popen, log: Path, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _PORT.search(log.read_text(errors="replace"))
        if found:
            url = f"http://127.0.0.1:{found.group(1)}"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            raise RuntimeError(f"embedsvc exited:\n{log.read_text()}")
        time.sleep(0.2)
    raise RuntimeError(f"embedsvc not healthy after {timeout}s:\n{log.read_text()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60, help="seconds per measurement")
    parser.add_argument("--model", help="a CrossEncoder directory (default: MiniLM-L6-shaped)")
    parser.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    OUT.mkdir(exist_ok=True)
    model = args.model or str(minilm_shaped_reranker(OUT / "reranker-minilm-l6-shape"))
    from transformers import AutoTokenizer

    docs = documents(AutoTokenizer.from_pretrained(model))
    pairs = [(QUERY, d) for d in docs]
    offline_rate = offline(model, pairs, args.duration)
    rows = [
        ("default settings", served(model, docs, args.duration, OUT / "rerank-serve.log")),
        (f"MAX_BATCH_SIZE={DOCS}", served(model, docs, args.duration, OUT / "rerank-serve.log",
                                          "--max-batch-size", str(DOCS))),
    ]
    section = report(args, offline_rate, rows)
    print(section)
    if args.record:
        with open(BENCH / "RESULTS.md", "a") as f:
            f.write("\n" + section)
    return 0


def report(args: argparse.Namespace, offline_rate: float,
           rows: list[tuple[str, tuple[float, str, float]]]) -> str:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    which = args.model or "random BERT of ms-marco-MiniLM-L6-v2's shape (6 x 384, 12 heads)"
    return (
        f"## {when}: `python bench/rerank.py --duration {args.duration:g}"
        f"{' --record' if args.record else ''}` (preliminary)\n\n"
        f"Rerank throughput, 1 query x {DOCS} documents of ~100 tokens per request. "
        f"{os.cpu_count()} cores, {platform.machine()}, device cpu, shared with other work "
        f"while it ran (load average {os.getloadavg()[0]:.1f} at the end), one run: "
        "preliminary. "
        f"Model: {which}.\n\n"
        "| what | pairs/s | vs offline | p50 ms/request | errors |\n|---|---:|---:|---:|---:|\n"
        f"| `CrossEncoder.predict`, offline, batch {DOCS} | {offline_rate:.1f} | 1.00 | | |\n"
        + "".join(
            f"| embedsvc `/rerank`, {CLIENTS} concurrent clients, {name} | {rate:.1f} "
            f"| {rate / offline_rate:.2f} | {p50:.0f} | {errors} |\n"
            for name, (rate, errors, p50) in rows
        )
    )


if __name__ == "__main__":
    sys.exit(main())
