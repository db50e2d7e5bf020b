"""`embedsvc embed` at its limits, on the fake encoder (tests/integration/fake_embed.py): the
peak RSS of a job whose input holds one huge row, and what a 2,000-line job keeps when it is
stopped at half.

    .venv/bin/python bench/bulk_limits.py
    PYTHONPATH=/tmp/trees/base .venv/bin/python bench/bulk_limits.py   # another tree's code

Rows: a text and a JSONL file with a 1 GB line (a hole in a sparse file: no disk), and a
Parquet file of 1024 cells of 2 MB (one dictionary value, a few hundred bytes). The job's
peak RSS comes from ``wait4`` on that one process. Stopped at half: the defaults (chunks of
256, four in flight), a device batch a second; SIGINT or SIGKILL once 1,000 rows are
computed; kept is what the manifest lists as done.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
GB = 1 << 30
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi",
         "chi", "psi", "omega"]


def job(argv: list[str], work: Path, **env: str) -> subprocess.Popen:
    # run from ``work``, so that PYTHONPATH, not the current directory, picks embedsvc
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))
    return subprocess.Popen([sys.executable, "-m", "tests.integration.fake_embed", "embed",
                             *argv], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": path, **env})


def long_rows(work: Path) -> None:
    with open(work / "long.txt", "wb") as f:
        f.write(b"a short line\n")
        f.seek(GB)
        f.write(b"\na short line\n")
    with open(work / "long.jsonl", "wb") as f:
        f.write(b'{"text": "short"}\n{"text": "short", "unused": [')
        f.seek(GB)
        f.write(b']}\n{"text": "short"}\n')
    cell = pa.array(["word " * (2 * (1 << 20) // 5)])
    cells = pa.DictionaryArray.from_arrays(pa.array([0] * 1024, pa.int32()), cell)
    pq.write_table(pa.table({"text": cells}), work / "cells.parquet", compression="zstd",
                   store_schema=False)
    print("| input | exit | peak RSS (GiB) | CPU (s) | last line |\n|---|---:|---:|---:|---|")
    for name in ("long.txt", "long.jsonl", "cells.parquet"):
        proc = job([name, "-o", "out.npy"], work)
        out = proc.stdout.read().decode(errors="replace")  # type: ignore[union-attr]
        _, status, usage = os.wait4(proc.pid, 0)
        last = out.strip().splitlines()[-1][:120]
        print(f"| {name} | {os.waitstatus_to_exitcode(status)} | "
              f"{usage.ru_maxrss / (1 << 20):.2f} | {usage.ru_utime + usage.ru_stime:.1f} | "
              f"{last} |", flush=True)


def stopped_at_half(work: Path) -> None:
    rng = random.Random(2000)  # lines of 3-12 words, as tests/integration/test_bulk_resume's
    (work / "in.txt").write_text("".join(
        " ".join(rng.choices(WORDS, k=rng.randint(3, 12))) + "\n" for _ in range(2000)))
    print("\n| signal | computed | kept |\n|---|---:|---:|")
    for sig in (signal.SIGINT, signal.SIGKILL):
        parts, count = work / "half.npy.parts", work / "count"
        count.unlink(missing_ok=True)
        proc = job(["in.txt", "-o", "half.npy", "--restart"], work,
                   FAKE_EMBED_DELAY_S="1", FAKE_EMBED_COUNT=str(count))
        while (computed := sum(map(int, count.read_text().split())) if count.exists()
               else 0) < 1000:
            time.sleep(0.02)
        proc.send_signal(sig)
        proc.wait(60)
        try:
            kept = json.loads((parts / "manifest.json").read_text())["done"]["records"]
        except FileNotFoundError:
            kept = 0
        print(f"| {sig.name} | {computed} | {kept} |", flush=True)


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="embedsvc-bulk-limits-"))
    long_rows(work)
    stopped_at_half(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
