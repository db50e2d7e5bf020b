"""The request path's own CPU, in process: this tree against another revision, alternately.

    .venv/bin/python bench/request_path.py --baseline bac1306 --rounds 5 --requests 4000

Each round starts one process per tree. It builds that tree's ``bench.sim_server`` app (the
zero-cost fake device), then calls the WSGI app directly, one request after the other, with no
HTTP server and no load generator: what is left is the route, validation, admission, the
handoff to the batcher thread and back, metrics, the access log and the JSON answer. The CPU
time of the whole process (every thread) is divided by the requests. The trees alternate
round by round, so a drift of the machine's speed touches both. Each body is sent
``--requests`` times after 200 unmeasured ones.

With ``--traces`` a third arm runs this tree with traces on (api/tracing.py), exported over
OTLP/HTTP to a collector stand-in in this process that decodes and counts the spans (its CPU
is not the server's); each request carries a caller's ``traceparent``, in every arm, and the
exporter's flush of the last spans is inside the measured time.

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
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
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
otlp = sys.argv[5] if len(sys.argv) > 5 else ""

bodies, count, warm = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
calls, counting = collections.Counter(), [False]

def profile(frame, event, arg):  # every thread's Python and C calls, while counting
    if counting[0] and event in ("call", "c_call"):
        calls[event] += 1

if sys.argv[4] == "calls":  # before the app starts its batcher thread
    threading.setprofile(profile)
    sys.setprofile(profile)
app = make_app()
tracing = None
if otlp:
    from embedsvc.api.tracing import Tracing
    app.wsgi_app.tracing = tracing = Tracing(otlp)

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
        "HTTP_TRACEPARENT": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
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
    if tracing is not None:
        tracing.provider.force_flush()  # the spans of these requests, sent
    cpu, counting[0] = time.process_time() - cpu, False
    result[name] = ({"python": calls["call"] / count, "c": calls["c_call"] / count}
                    if sys.argv[4] == "calls" else cpu / count * 1e6)
print(json.dumps(result))
"""


def run_child(tree: Path, bodies: dict, count: int, warm: int, mode: str = "cpu",
              wrapper: tuple[str, ...] = (), otlp: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*wrapper, sys.executable, "-c", CHILD, json.dumps(bodies),
                           str(count), str(warm), mode, otlp],
                          cwd=tree, env=env, check=True, capture_output=True, text=True)


def measure(tree: Path, count: int, mode: str = "cpu", otlp: str = "") -> dict:
    out = run_child(tree, BODIES, count, warm=200, mode=mode, otlp=otlp)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    module = Path(result.pop("module")).resolve()
    if tree.resolve() not in module.parents:
        raise RuntimeError(f"{tree} ran the embedsvc of {module}, not its own")
    return result


def instructions(tree: Path, body: str, count: int) -> float:
    """Instructions per request of ``body``, counted by valgrind (callgrind): the difference
    between a process that sends ``count`` + 20 requests and one that sends 20, so that
    start-up and imports cancel out. Unlike CPU time it does not move with the machine."""
    return callgrind_delta(lambda n, wrapper: run_child(tree, {body: BODIES[body]}, n, warm=0,
                                                       wrapper=wrapper), 20, count + 20) / count


def main() -> None:
    parser = baseline_parser(__doc__)
    parser.add_argument("--requests", type=int, default=4000, help="measured calls per body")
    parser.add_argument("--calls", action="store_true",
                        help="count the function calls per request instead (Python and C, "
                             "every thread): which code a change added to the path")
    parser.add_argument("--traces", action="store_true",
                        help="a third arm: this tree with traces on, sent over OTLP/HTTP to a "
                             "collector stand-in here")
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
    if args.traces:
        with Collector() as collector:
            cpu_rounds(trees, args, collector)
    else:
        cpu_rounds(trees, args)


def cpu_rounds(trees: dict[str, Path], args: argparse.Namespace,
               collector: Collector | None = None) -> None:
    """CPU per request of each arm, the arms alternating round by round."""
    arms = [(name, tree, "") for name, tree in trees.items()]
    if collector is not None:
        arms.append(("this, traced", trees["this"], collector.url))
    rounds: dict[str, list[dict]] = {name: [] for name, _, _ in arms}
    for r in range(args.rounds):
        for name, tree, otlp in arms:
            rounds[name].append(measure(tree, args.requests, otlp=otlp))
            print(f"round {r + 1} {name}: " + ", ".join(
                f"{body} {us:.0f} us" for body, us in rounds[name][-1].items()), flush=True)
    print(f"\nCPU us per request, median of {args.rounds} rounds "
          f"({args.requests} requests each; {args.baseline} vs {args.tree}):\n")
    names = [name for name, _, _ in arms]
    print("| body | " + " | ".join(names) + " | " + " | ".join(
        f"{name} / baseline" for name in names[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(names) - 1))
    for body in BODIES:
        us = [median(r[body] for r in rounds[name]) for name in names]
        print(f"| {body} | " + " | ".join(f"{u:.0f}" for u in us) + " | " + " | ".join(
            f"{u / us[0]:.3f}" for u in us[1:]) + " |")
    if collector is not None:
        runs = args.rounds * len(BODIES)
        print(f"\nSpans received: {collector.spans} in {collector.posts} exports, "
              f"{collector.spans / (runs * (args.requests + 200)):.2f} per traced request")


class Collector:
    """An OTLP/HTTP collector stand-in on loopback: counts the spans it decodes."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        self.spans = self.posts = 0
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                collector.posts += 1
                collector.spans += sum(len(scope.spans) for rs in request.resource_spans
                                       for scope in rs.scope_spans)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Collector:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


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
    print("\n".join(baseline_rows(BODIES, found, ",.0f")))


if __name__ == "__main__":
    main()
