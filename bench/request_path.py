"""The request path's own CPU, in process: this tree against another revision, alternately.

    .venv/bin/python bench/request_path.py --baseline bac1306 --rounds 5 --requests 4000

Each round starts one process per tree. It builds that tree's ``bench.sim_server`` app (the
zero-cost fake device), then calls the WSGI app directly, one request after the other, with no
HTTP server and no load generator: what is left is the route, validation, admission, the
handoff to the batcher thread and back, metrics, the access log and the JSON answer. The CPU
time of the whole process (every thread) is divided by the requests. The trees alternate
round by round, so a drift of the machine's speed touches both. Each body is sent
``--requests`` times after 200 unmeasured ones.

With ``--calls`` it counts the function calls per request instead (Python and C, in every
thread), which say exactly what a change added to the path. With ``--valgrind N`` it counts
instructions instead (valgrind's callgrind), which do not
move with the machine's load: on a shared 2-core machine, CPU time per request drifts by
10-20% between rounds, more than the differences this is meant to see.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.run import baseline_tree  # noqa: E402 - the path above makes the repository importable

BODIES = {
    "1 input": {"model": "bench", "input": "the quick brown fox jumps over the lazy dog"},
    "32 inputs": {"model": "bench", "input": [f"the quick brown fox number {i} jumps over the "
                                              "lazy dog" for i in range(32)]},
}

# Run in the child, with the tree first on sys.path.
CHILD = r"""
import collections, io, json, sys, threading, time
import embedsvc
from bench.sim_server import make_app

bodies, count, warm = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
calls, counting = collections.Counter(), [False]

def profile(frame, event, arg):  # every thread's Python and C calls, while counting
    if counting[0] and event in ("call", "c_call"):
        calls[event] += 1

if sys.argv[4] == "calls":  # before the app starts its batcher thread
    threading.setprofile(profile)
    sys.setprofile(profile)
app = make_app()

def call(raw):
    status = []
    environ = {
        "REQUEST_METHOD": "POST", "PATH_INFO": "/v1/embeddings", "QUERY_STRING": "",
        "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8080", "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "127.0.0.1", "REMOTE_PORT": "40000",
        "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(raw)),
        "wsgi.input": io.BytesIO(raw), "wsgi.url_scheme": "http", "wsgi.errors": sys.stderr,
        "wsgi.multithread": True, "wsgi.multiprocess": False, "wsgi.run_once": False,
        "wsgi.version": (1, 0),
    }
    body = b"".join(app(environ, lambda s, h, e=None: status.append(s)))
    assert status[0].startswith("200"), (status, body[:200])

result = {"module": embedsvc.__file__}
for name, body in bodies.items():
    raw = json.dumps(body).encode()
    for _ in range(warm):
        call(raw)
    calls.clear()
    counting[0], cpu = True, time.process_time()
    for _ in range(count):
        call(raw)
    cpu, counting[0] = time.process_time() - cpu, False
    result[name] = ({"python": calls["call"] / count, "c": calls["c_call"] / count}
                    if sys.argv[4] == "calls" else cpu / count * 1e6)
print(json.dumps(result))
"""


def run_child(tree: Path, bodies: dict, count: int, warm: int, mode: str = "cpu",
              wrapper: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*wrapper, sys.executable, "-c", CHILD, json.dumps(bodies),
                           str(count), str(warm), mode],
                          cwd=tree, env=env, check=True, capture_output=True, text=True)


def measure(tree: Path, count: int, mode: str = "cpu") -> dict:
    out = run_child(tree, BODIES, count, warm=200, mode=mode)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    module = Path(result.pop("module")).resolve()
    if tree.resolve() not in module.parents:
        raise RuntimeError(f"{tree} ran the embedsvc of {module}, not its own")
    return result


def instructions(tree: Path, body: str, count: int) -> float:
    """Instructions per request of ``body``, counted by valgrind (callgrind): the difference
    between a process that sends ``count`` + 20 requests and one that sends 20, so that
    start-up and imports cancel out. Unlike CPU time it does not move with the machine."""
    totals = []
    for n in (20, count + 20):
        out = run_child(tree, {body: BODIES[body]}, n, warm=0,
                        wrapper=("valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"))
        found = re.search(r"Collected : (\d+)", out.stderr)
        if not found:
            raise RuntimeError(out.stderr[-2000:])
        totals.append(int(found.group(1)))
    return (totals[1] - totals[0]) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, metavar="REV")
    parser.add_argument("--tree", type=Path, default=REPO,
                        help="the tree measured against the baseline (default: this one)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=4000, help="measured calls per body")
    parser.add_argument("--calls", action="store_true",
                        help="count the function calls per request instead (Python and C, "
                             "every thread): which code a change added to the path")
    parser.add_argument("--valgrind", type=int, metavar="N",
                        help="count instructions instead, over N requests per body (slow: "
                             "about 50x; --rounds is then the number of counts per tree)")
    args = parser.parse_args()
    trees = {"baseline": baseline_tree(args.baseline), "this": args.tree}
    if args.valgrind:
        count_instructions(trees, args.valgrind, args.rounds, args.baseline)
        return
    if args.calls:
        print(f"Function calls per request, every thread ({args.requests} requests; "
              f"{args.baseline} vs {args.tree}):\n")
        print("| body | baseline Python | baseline C | this Python | this C |")
        print("|---|---:|---:|---:|---:|")
        base, this = measure(trees["baseline"], args.requests, "calls"), \
            measure(trees["this"], args.requests, "calls")
        for body in BODIES:
            print(f"| {body} | {base[body]['python']:.2f} | {base[body]['c']:.2f} | "
                  f"{this[body]['python']:.2f} | {this[body]['c']:.2f} |")
        return
    rounds: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            rounds[name].append(measure(tree, args.requests))
            print(f"round {r + 1} {name}: " + ", ".join(
                f"{body} {us:.0f} us" for body, us in rounds[name][-1].items()), flush=True)
    print(f"\nCPU us per request, median of {args.rounds} rounds "
          f"({args.requests} requests each; {args.baseline} vs {args.tree}):\n")
    print("| body | baseline | this | this / baseline |")
    print("|---|---:|---:|---:|")
    for body in BODIES:
        base = median(r[body] for r in rounds["baseline"])
        this = median(r[body] for r in rounds["this"])
        print(f"| {body} | {base:.0f} | {this:.0f} | {this / base:.3f} |")


def count_instructions(trees: dict[str, Path], count: int, rounds: int, baseline: str) -> None:
    found: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        for body in BODIES:
            for name, tree in trees.items():
                per = instructions(tree, body, count)
                found.setdefault((name, body), []).append(per)
                print(f"round {r + 1} {name} {body}: {per:,.0f} instructions per request",
                      flush=True)
    print(f"\nInstructions per request (valgrind callgrind, {count} requests, median of "
          f"{rounds}; {baseline} vs {trees['this']}):\n")
    print("| body | baseline | this | this / baseline |")
    print("|---|---:|---:|---:|")
    for body in BODIES:
        base, this = median(found["baseline", body]), median(found["this", body])
        print(f"| {body} | {base:,.0f} | {this:,.0f} | {this / base:.3f} |")


if __name__ == "__main__":
    main()
