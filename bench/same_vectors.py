"""The bundled model's answers from this tree, in one process and under ``--workers 2``,
against one process of another revision: the same floats, or not.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/same_vectors.py --baseline 9a4287e

For a change that moves where vectors are computed or shaped (normalising with the batch,
the engine's answer frames) without meaning to change them. Each server answers: five
one-input requests on /v1/embeddings, the five texts in one request, a `dimensions` cut,
TEI's /embed with `normalize: false` and with three inputs. The JSON answers are compared
as parsed, float for float.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.run import baseline_tree  # noqa: E402 - the path above makes the repository importable

TEXTS = ["How do I reset my password?", "The quick brown fox jumps over the lazy dog.",
         "Embeddings map text to vectors of numbers.", "Paris is the capital of France.",
         "A batch of requests shares one forward pass on the device."]


def answers(port: int) -> list[Any]:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        out: list[Any] = [c.post("/v1/embeddings", json={"input": t, "model": "m"})
                          .json()["data"][0]["embedding"] for t in TEXTS]
        out.append([d["embedding"] for d in c.post(
            "/v1/embeddings", json={"input": TEXTS, "model": "m"}).json()["data"]])
        out.append(c.post("/v1/embeddings", json={"input": TEXTS[0], "model": "m",
                                                   "dimensions": 128}).json())
        out.append(c.post("/embed", json={"inputs": TEXTS[1], "normalize": False}).json())
        out.append(c.post("/embed", json={"inputs": TEXTS[:3]}).json())
    return out


def served(tree: Path, port: int, *extra: str) -> list[Any]:
    """``answers`` of ``embedsvc serve`` run from ``tree`` (its own package first)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tree)}
    proc = subprocess.Popen([sys.executable, "-m", "embedsvc", "serve", "--port", str(port),
                             "--log-level", "warning", *extra], cwd=tree, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"{tree}: the server did not come up on port {port}")
            time.sleep(0.1)
        return answers(port)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the revision to compare with")
    parser.add_argument("--port", type=int, default=18301)
    args = parser.parse_args()
    base = served(baseline_tree(args.baseline), args.port)
    for name, extra in (("one process", ()), ("--workers 2", ("--workers", "2"))):
        got = served(REPO, args.port + 1, *extra)
        same = sum(a == b for a, b in zip(got, base, strict=True))
        print(f"this tree, {name}: {same} of {len(base)} answers the same as "
              f"{args.baseline}'s one process, float for float")


if __name__ == "__main__":
    main()
