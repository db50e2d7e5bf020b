"""What the test suite costs: wall time, the CPU-seconds of all its processes, and where they go.

    .venv/bin/python bench/suite.py                  # `make test`, as .ci/run runs it
    .venv/bin/python bench/suite.py -- .venv/bin/python -m pytest -n 3 --dist loadfile tests/unit

The command runs with a ``sitecustomize`` on PYTHONPATH that writes one line as each Python
process exits normally: its own CPU time, its command line, the test that started it
(PYTEST_CURRENT_TEST) and whether it imported PyTorch or ONNX Runtime. The CPU in all is user
plus system time of every process the command waited for; tests/conftest.py makes the pytest
controller the subreaper of the shared servers, so theirs is counted too. What the ledger
does not name: processes that are not Python (nginx, chromium, promtool ...), those killed
with SIGKILL, those started with an environment of their own (the README's newcomer), and
each process's interpreter teardown after its exit handlers ran.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Written into a temporary directory put first on PYTHONPATH; SUITE_LEDGER_OF_EMBEDSVC names
# the file its lines go to.
SITECUSTOMIZE = '''
import atexit, json, os, sys
def _ledger():
    path = os.environ.get("SUITE_LEDGER_OF_EMBEDSVC")
    if not path:
        return
    t = os.times()
    row = {"cpu": t.user + t.system, "argv": " ".join(sys.argv)[:200],
           "worker": sys.argv[:1] == ["-c"] and "execnet" in sys.modules,
           "torch": "torch" in sys.modules, "ort": "onnxruntime" in sys.modules,
           "test": os.environ.get("PYTEST_CURRENT_TEST", "")}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\\n")
atexit.register(_ledger)
'''


def run(command: list[str]) -> tuple[float, float, int, str, list[dict]]:
    """Wall seconds, CPU-seconds of all waited-for processes, exit code, the output's
    summary line, and the ledger's rows."""
    with tempfile.TemporaryDirectory(prefix="embedsvc-suite-") as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        ledger = Path(tmp) / "ledger.jsonl"
        env = {**os.environ, "SUITE_LEDGER_OF_EMBEDSVC": str(ledger),
               "PYTHONPATH": os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        rows = [json.loads(line) for line in ledger.read_text().splitlines()] \
            if ledger.exists() else []
    found = re.findall(r"^=+ (.*(?:passed|failed|error).*) =+$", proc.stdout, re.M)
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
    return wall, cpu, proc.returncode, (found or last)[-1], rows


def kind(row: dict) -> str:
    if row["worker"]:
        return "pytest's xdist workers (their tests, collection, fixtures)"
    if row["torch"]:
        return "other processes that imported PyTorch"
    if row["ort"]:
        return "other processes with ONNX Runtime, without PyTorch"
    return "other Python processes"


def report(wall: float, cpu: float, code: int, summary: str, rows: list[dict],
           top: int) -> str:
    by: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for row in rows:
        tally = by[kind(row)]
        tally[0] += 1
        tally[1] += row["cpu"]
    named = sum(row["cpu"] for row in rows)
    lines = [f"{wall:.1f} s wall, {cpu:.1f} CPU-s (user + system), exit code {code}: {summary}",
             "", "| processes | count | CPU-s |", "|---|---:|---:|"]
    for name, (count, seconds) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {name} | {count:.0f} | {seconds:.1f} |")
    lines.append(f"| not in the ledger (not Python, killed, a clean environment, teardown) | | "
                 f"{cpu - named:.1f} |")
    lines += ["", f"The {top} costliest processes that are not workers:", "",
              "| CPU-s | PyTorch | command | started during |", "|---:|---|---|---|"]
    others = sorted((r for r in rows if not r["worker"]), key=lambda r: -r["cpu"])[:top]
    for row in others:
        command = row["argv"].replace(str(REPO) + "/", "").replace("|", "/")[:90]
        test = row["test"].rsplit("/", 1)[-1].replace("|", "/")[:90]
        lines.append(f"| {row['cpu']:.1f} | {'yes' if row['torch'] else ''} | `{command}` | "
                     f"{test} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=15, help="processes listed by name")
    parser.add_argument("command", nargs="*", default=["make", "test"],
                        help="what to run, after -- (default: make test)")
    args = parser.parse_args()
    wall, cpu, code, summary, rows = run(args.command)
    print(f"`{' '.join(args.command)}` on {os.cpu_count()} cores:\n")
    print(report(wall, cpu, code, summary, rows, args.top))
    return code


if __name__ == "__main__":
    sys.exit(main())
