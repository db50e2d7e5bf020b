"""Rows/s of `embedsvc embed` in-process against Ray Data with 1 and 2 actors, and peak memory.

    .venv/bin/python bench/bulk_ray.py --rows 10000 80000 --actors 1 2

For each size, writes a Parquet dataset of random 3-20 word rows (8 files), then embeds it
(the bundled model, CPU): in-process (`embedsvc embed all.parquet -o out.parquet`, in a fresh
process; peak RSS from ru_maxrss) and on a local Ray started here with N one-CPU actors
(`embed_dataset`, the code behind `--ray`; peak RSS of each actor sampled every 0.2 s from
/proc). Ray's figures include starting the actors (model load), not starting Ray itself.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon")
FILES = 8
IN_PROCESS = """
import resource, sys
from embedsvc.cli import main
code = main(["embed", sys.argv[1], "--output", sys.argv[2], "--device", "cpu"])
print("peak_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "code", code)
"""


def write_dataset(directory: Path, rows: int, rng: random.Random) -> Path:
    directory.mkdir()
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(3, 20))) for _ in range(rows)]
    table = pa.table({"id": list(range(rows)), "text": texts})
    for f in range(FILES):
        part = table.slice(f * rows // FILES, (f + 1) * rows // FILES - f * rows // FILES)
        pq.write_table(part, directory / f"part-{f}.parquet")
    whole = directory.with_name(directory.name + ".parquet")
    pq.write_table(table, whole)
    return whole


def in_process(source: Path, target: Path) -> tuple[float, float]:
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", IN_PROCESS, str(source), str(target)],
                         capture_output=True, text=True, check=True).stdout
    return time.monotonic() - started, int(out.split("peak_kib")[1].split()[0]) / 1024


class ActorMemory:
    """The largest resident size of each Ray actor process, sampled in a thread."""

    def __init__(self) -> None:
        self.peaks: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ActorMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for proc in Path("/proc").glob("[0-9]*"):
                try:
                    if not (proc / "cmdline").read_bytes().startswith(b"ray::MapWorker"):
                        continue
                    if not _descends_from(int(proc.name), os.getpid()):
                        continue  # another Ray on the same machine
                    found = re.search(r"VmRSS:\s+(\d+)", (proc / "status").read_text())
                except OSError:
                    continue
                if found:
                    pid = int(proc.name)
                    self.peaks[pid] = max(self.peaks.get(pid, 0), int(found.group(1)) / 1024)


def _descends_from(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        found = re.search(r"PPid:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
        pid = int(found.group(1)) if found else 0
    return False


def on_ray(source: Path, target: Path, actors: int) -> tuple[float, list[float]]:
    import ray

    from embedsvc.bulk import BulkOptions
    from embedsvc.bulk.cluster import embed_dataset
    from embedsvc.settings import Settings

    ray.init(num_cpus=actors + 1, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        with ActorMemory() as memory:
            started = time.monotonic()
            embed_dataset(BulkOptions(str(source), str(target), ray="", actors=actors),
                          Settings(device="cpu"))
            seconds = time.monotonic() - started
    finally:
        ray.shutdown()
    return seconds, sorted(memory.peaks.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 80_000])
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    rng = random.Random(0)
    print("| rows | run | seconds | rows/s | peak RSS (MiB) |")
    print("|---:|---|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for rows in args.rows:
            whole = write_dataset(Path(tmp) / f"docs-{rows}", rows, rng)
            seconds, peak = in_process(whole, Path(tmp) / f"out-{rows}.parquet")
            print(f"| {rows} | in-process | {seconds:.1f} | {rows / seconds:.0f} | "
                  f"{peak:.0f} |", flush=True)
            for actors in args.actors:
                seconds, peaks = on_ray(whole.with_suffix(""), Path(tmp) / f"ray-{rows}-{actors}",
                                        actors)
                print(f"| {rows} | Ray, {actors} actor(s) | {seconds:.1f} | "
                      f"{rows / seconds:.0f} | {', '.join(f'{p:.0f}' for p in peaks)} "
                      "per actor |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
