"""The engine loop's own CPU a request, in process: this tree against another revision.

    .venv/bin/python bench/engine_path.py --baseline 69a5778 --rounds 5
    .venv/bin/python bench/engine_path.py --baseline 69a5778 --valgrind 500

Each round starts one process per tree. It builds that tree's engine (``EngineServer``) over
the zero-cost simulated device (bench/sim_server.py's), with one front's connection as a
socketpair, and runs for each burst what the engine's loop runs for one read, without the
poll: the frames read and decoded, checked, admitted and queued, computed by the loop itself
(``Batcher.here``, as over this device), answered and sent back. A burst holds 1 or 10
one-input requests (a 13-token query each, a flow each), sent as a front sends them. The
thread's CPU clock over ``--requests`` requests, divided by them, is the figure; the best of
seven, since on shared cores a slice of another process only ever adds to it. The trees
alternate round by round.

This is the engine's code alone: ``bench/workers.py frames`` adds the poll and a process of
its own, and ``bench/workers.py sim`` puts it beside fronts and wrk on the same cores, where
the same Python cost about three times as much (bench/RESULTS.md, 2026-12-06 21:35).

``--gap-ms G`` also runs this tree's bursts each after a wait of G ms (a sleep, as the loop
waits in its poll between wake-ups), each burst timed on its own: the same calls, run as a
serving engine that is not saturated runs them, against back to back.

With ``--valgrind N`` it counts instructions instead (valgrind's callgrind): the difference
between a process that runs N + 100 bursts and one that runs 100, so that start-up cancels,
with the hash seed fixed. It does not move with the machine's load, but still by a few
percent from one process to the next: the engine's branches follow its clock (the rate it
measures, the deadlines) and objects hash by their addresses. Take the median of several.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.run import (  # noqa: E402 - the path above makes the repository importable
    baseline_parser,
    baseline_rows,
    baseline_tree,
    callgrind_delta,
)

BURSTS = (1, 10)  # requests a burst

# Run in the child, with the tree first on sys.path: argv burst, requests (0: count the
# bursts below instead of timing), bursts, and the wait before each burst (seconds; 0: none,
# the round timed whole).
CHILD = r"""
import itertools, json, logging, math, socket, sys, tempfile, time
from pathlib import Path
from bench.sim_server import fake_encoder
from embedsvc.remote import wire
from embedsvc.remote.place import engine_address, private_dir
from embedsvc.remote.server import EngineServer
from embedsvc.remote.stream import Stream
from embedsvc.service import Service
from embedsvc.settings import Settings

logging.disable(logging.WARNING)
size, requests, bursts = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
gap = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
service = Service(Settings(log_level="warning"), encoder=fake_encoder())
service.start(background=False)
runner = service.runner
server = EngineServer(runner, engine_address(private_dir(Path(tempfile.mkdtemp()))), card={},
                      state=lambda: "ready", metrics=service.metrics)
runner.batcher.here = True  # as the loop sets it over a device that costs nothing
mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
peer, front = b"1", Stream(theirs)
server._streams[peer] = Stream(mine, server._frame_limit)
server._by_fd[mine.fileno()] = peer
server._poller.register(mine.fileno(), 1)
ids = wire.pack_ids([[101, *([7] * 11), 102]])
numbers = itertools.count(1)

# as a front sends a normalised embedding's request (where the tree's frames say so)
unit = {"unit": True} if "unit" in wire.Submit.__struct_fields__ else {}

def frame():
    items = [wire.Submit(next(numbers), "embed", *ids, timeout=30.0, flow=repr(("c", i)),
                         **unit) for i in range(size)]
    return wire.encode(items[0] if size == 1 else wire.Submits(items))

def burst(data):
    front.send(data)
    server._read([peer])
    server._start_granted()
    runner.batcher.compute_here()
    server._answer_done()
    server._flush()
    if not front.read():
        raise RuntimeError("no answer")

for _ in range(300 if requests else 0):
    burst(frame())
if not requests:
    for data in [frame() for _ in range(bursts)]:
        burst(data)
    sys.exit()
best = math.inf
for _ in range(7):
    frames = [frame() for _ in range(max(1, requests // size))]
    used, started = 0.0, time.thread_time()
    for data in frames:
        if gap:
            time.sleep(gap)
            started = time.thread_time()
        burst(data)
        if gap:
            used += time.thread_time() - started
    if not gap:
        used = time.thread_time() - started
    best = min(best, used / (len(frames) * size) * 1e6)
print(json.dumps(best))
"""


def run_child(tree: Path, size: int, requests: int, bursts: int = 0,
              wrapper: tuple[str, ...] = (), gap_s: float = 0.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*wrapper, sys.executable, "-c", CHILD, str(size), str(requests),
                           str(bursts), str(gap_s)], cwd=tree, env=env, check=True,
                          capture_output=True, text=True)


def instructions(tree: Path, size: int, bursts: int) -> float:
    """Instructions a request in bursts of ``size``: the difference of ``bursts`` + 100
    bursts and 100, divided by the requests in ``bursts``."""
    return callgrind_delta(lambda n, wrapper: run_child(tree, size, 0, n, wrapper), 100,
                           bursts + 100) / (bursts * size)


def main() -> None:
    parser = baseline_parser(__doc__)
    parser.add_argument("--requests", type=int, default=2000,
                        help="requests in each of a round's seven timings")
    parser.add_argument("--valgrind", type=int, metavar="N",
                        help="count instructions instead, over N bursts of each size (slow; "
                             "--rounds is then the number of counts per tree)")
    parser.add_argument("--gap-ms", type=float, default=0.0, metavar="G",
                        help="also time this tree's bursts each after a G ms wait")
    args = parser.parse_args()
    trees = {"baseline": baseline_tree(args.baseline), "this": args.tree}
    if args.gap_ms and not args.valgrind:
        trees[f"this, after {args.gap_ms:g} ms"] = args.tree
    found: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for size in BURSTS:
            for name, tree in trees.items():
                if args.valgrind:
                    got = instructions(tree, size, args.valgrind)
                else:
                    gap = args.gap_ms / 1000 if name.startswith("this, after") else 0.0
                    got = json.loads(run_child(tree, size, args.requests, gap_s=gap)
                                     .stdout.splitlines()[-1])
                found.setdefault((name, size), []).append(got)
                print(f"round {r + 1} {name}, bursts of {size}: {got:,.1f} "
                      + ("instructions" if args.valgrind else "us") + " a request", flush=True)
    what = (f"Instructions a request (valgrind callgrind, {args.valgrind} bursts"
            if args.valgrind else f"Thread CPU us a request (best of seven timings of "
            f"{args.requests} requests")
    print(f"\n{what}, median of {args.rounds}; {args.baseline} vs {args.tree}):\n")
    print("| requests a burst | baseline | this | this / baseline |")
    print("|---:|---:|---:|---:|")
    print("\n".join(baseline_rows(BURSTS, found, ",.1f")))
    waited = f"this, after {args.gap_ms:g} ms"
    if any(name == waited for name, _ in found):
        print(f"\nThis tree's bursts back to back and each after a {args.gap_ms:g} ms wait "
              "(each burst timed on its own), median of the rounds:\n")
        print(f"| requests a burst | back to back | after {args.gap_ms:g} ms | ratio |")
        print("|---:|---:|---:|---:|")
        for size in BURSTS:
            back, after = median(found["this", size]), median(found[waited, size])
            print(f"| {size} | {back:,.1f} | {after:,.1f} | {after / back:.2f}x |")


if __name__ == "__main__":
    main()
