"""Peak memory of `embedsvc embed` against the size of the file it embeds.

    .venv/bin/python bench/embed_memory.py --lines 10000 40000
    .venv/bin/python bench/embed_memory.py --lines 10000 80000 --parquet

For each size, writes a text file (or with --parquet a Parquet file, read in record batches,
written to Parquet in committed parts) of random 3-20 word lines, runs `embedsvc embed` on it in
a fresh process (the bundled model, CPU) and prints the process's peak resident size
(ru_maxrss), the largest resident size sampled in each quarter of the run, the time and
the rate. Flat peaks mean the file is streamed, not loaded.
"""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon")
RUN = """
import resource, sys
from embedsvc.cli import main
code = main(["embed", sys.argv[1], "--output", sys.argv[2]])
print("peak_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "code", code)
"""


def rss_mib(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    found = re.search(r"VmRSS:\s+(\d+)", status)
    return int(found.group(1)) / 1024 if found else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[10_000, 40_000])
    parser.add_argument("--parquet", action="store_true", help="Parquet in and out")
    args = parser.parse_args()
    suffix = ".parquet" if args.parquet else ".npy"
    rng = random.Random(0)
    print("| lines | output | peak RSS (MiB) | largest RSS per quarter of the run (MiB) "
          "| seconds | inputs/s |")
    print("|---:|---|---:|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for lines in args.lines:
            texts = [" ".join(rng.choices(WORDS, k=rng.randint(3, 20))) for _ in range(lines)]
            if args.parquet:
                source = Path(tmp) / f"corpus-{lines}.parquet"
                pq.write_table(pa.table({"text": texts}), source)
            else:
                source = Path(tmp) / f"corpus-{lines}.txt"
                source.write_text("\n".join(texts) + "\n")
            target = Path(tmp) / f"vectors-{lines}{suffix}"
            started = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-c", RUN, str(source), str(target)],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            samples = []
            while proc.poll() is None:
                samples.append(rss_mib(proc.pid))
                time.sleep(0.5)
            out = proc.stdout.read()
            seconds = time.monotonic() - started
            peak = int(out.split("peak_kib")[1].split()[0]) / 1024
            samples = [s for s in samples if s]
            quarters = [max(samples[i * len(samples) // 4:(i + 1) * len(samples) // 4] or [0])
                        for i in range(4)]
            print(f"| {lines} | {target.stat().st_size / 2**20:.1f} MiB {suffix} | {peak:.0f} | "
                  f"{', '.join(f'{q:.0f}' for q in quarters)} | {seconds:.1f} | "
                  f"{lines / seconds:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
