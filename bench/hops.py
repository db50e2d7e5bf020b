"""How far a request's inputs travel: the calls from the route to the queue, tree by tree.

    .venv/bin/python bench/hops.py --trees 67d76ea,56f566e

One ``POST /v1/embeddings`` of one input goes through each tree's WSGI app in process, over
the simulated zero-cost device (bench/sim_server.py), with a profile hook on every thread.
When the inputs reach the place where they leave the request's hands, the hook takes the
Python stack there and keeps embedsvc's frames from the route function down:

- one process: the route, down to the batcher's ``submit`` (``embedsvc/batching/``: its
  queue; ``submit_many`` where a tree queues a burst at once);
- ``--workers`` (an engine and a front in this process, on an ``ipc://`` socket, as
  tests/unit/test_remote.py builds them): the front, the route down to its port's
  ``submit`` (where the work is handed to the engine's socket), and the engine, its loop's
  ``run`` down to the batcher's ``submit``.

``functions`` is the number of frames on that stretch; ``hops`` the number of times it passes
from one file of the package to another (the rooms ``farm-studio walk`` counts, measured on
a running request instead of read from the code, so calls through an interface are
followed). A tree without an engine process has no ``--workers`` row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.run import baseline_tree  # noqa: E402 - the path above makes the repository importable

CHILD = r"""
import io, json, sys, threading, time
import embedsvc
from bench.sim_server import make_app

ROOT = embedsvc.__path__[0] + "/"
BODY = json.dumps({"model": "bench", "input": "the quick brown fox jumps over the lazy dog"})
stacks = {}


def rel(frame):
    return frame.f_code.co_filename[len(ROOT):]


def stretch(frame, start):
    # embedsvc's frames from the first one ``start`` accepts down to ``frame``
    chain = []
    while frame is not None:
        if frame.f_code.co_filename.startswith(ROOT):
            chain.append((rel(frame), frame.f_code.co_name))
            if start(chain[-1]):
                return chain[::-1]
        frame = frame.f_back
    return None


def route(entry):
    return entry[0].startswith("api/") and entry[1] == "embeddings"


def engine_loop(entry):
    return entry[0] == "remote/server.py" and entry[1] == "run"


def hook(frame, event, arg):
    if event != "call" or not frame.f_code.co_filename.startswith(ROOT):
        return
    where = rel(frame)
    if where.startswith("batching/") and frame.f_code.co_name in ("submit", "submit_many"):
        for name, start in (("one process", route), ("engine", engine_loop)):
            found = name not in stacks and stretch(frame, start)
            if found:
                stacks[name] = found
    elif where == "remote/client.py" and frame.f_code.co_name == "submit" \
            and "front" not in stacks:
        found = stretch(frame, route)
        if found:
            stacks["front"] = found


def call(app):
    raw = BODY.encode()
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


def measured(build):
    threading.setprofile(hook)  # before the app starts its threads (the engine's loop)
    app = build()
    sys.setprofile(hook)
    call(app)
    sys.setprofile(None)
    threading.setprofile(None)


def remote_app():
    # the engine and a front in this process, as tests/unit/test_remote.py builds them
    import tempfile
    from pathlib import Path
    from bench.sim_server import fake_encoder
    from embedsvc.api.wsgi import create_app
    from embedsvc.metrics import Metrics
    from embedsvc.model.text import describe, text_spec
    from embedsvc.remote.place import engine_address, private_dir
    from embedsvc.remote.server import EngineServer
    from embedsvc.service import Service
    from embedsvc.settings import Settings
    from prometheus_client import CollectorRegistry

    encoder = fake_encoder(0.0, 0.0)
    engine = Service(Settings(), encoder=encoder, metrics=Metrics(CollectorRegistry()))
    engine.start(background=False)
    runner = engine.runner
    address = engine_address(private_dir(Path(tempfile.mkdtemp(dir="/tmp")) / "run"))
    server = EngineServer(runner, address, state=lambda: engine.state, metrics=engine.metrics,
                          card={"info": describe(runner.info), "text": text_spec(encoder)})
    stop = threading.Event()
    threading.Thread(target=server.run, args=(stop,), daemon=True).start()
    settings = Settings(log_level="warning")
    front = Service(settings, engine_address=address, metrics=Metrics(CollectorRegistry()))
    front.start(background=True)
    assert front.ready(10) is not None
    return create_app(settings, service=front)


measured(make_app)
try:
    import embedsvc.remote.server  # noqa: F401
except ImportError:
    pass  # no engine process in this tree
else:
    measured(remote_app)
print(json.dumps({"module": embedsvc.__file__, "stacks": stacks}))
"""


def stacks_of(tree: Path) -> dict[str, list[list[str]]]:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=tree, env=env, check=True,
                         capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if tree.resolve() not in Path(result["module"]).resolve().parents:
        raise RuntimeError(f"{tree} ran the embedsvc of {result['module']}, not its own")
    return result["stacks"]


def hops(chain: list[list[str]]) -> int:
    return sum(a[0] != b[0] for a, b in zip(chain, chain[1:], strict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", default="", help="git revisions to measure beside this tree")
    parser.add_argument("--show", action="store_true", help="print each stretch's frames")
    args = parser.parse_args()
    trees = {rev: baseline_tree(rev) for rev in filter(None, args.trees.split(","))}
    trees["this tree"] = REPO
    print("| tree | stretch | functions | hops (files crossed) |")
    print("|---|---|---:|---:|")
    for name, tree in trees.items():
        for stretch, chain in stacks_of(tree).items():
            print(f"| {name} | {stretch} | {len(chain)} | {hops(chain)} |")
            if args.show:
                print("  " + " > ".join(f"{f}:{fn}" for f, fn in chain), file=sys.stderr)


if __name__ == "__main__":
    main()
