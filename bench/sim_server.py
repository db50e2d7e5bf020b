"""embedsvc over a simulated device: the server's own cost, without the model's.

    .venv/bin/python bench/sim_server.py --port 8091 --fixed-ms 0 --per-token-us 0
    .venv/bin/python bench/sim_server.py --port 8091 --workers 2

The encoder spends ``fixed_ms + per_token_us x padded tokens`` in time.sleep (the GIL
released, as during CUDA kernels) and returns deterministic 384-dimensional vectors, so all
CPU the process uses is the server's: HTTP, parsing, validation, batching, serialising.

With ``--workers N`` it is ``embedsvc serve --workers N`` itself: one engine process holding
the simulated device and the batcher, N HTTP fronts. The engine and the fronts are this
program again (``serving/children.py``'s ``child_command``) with the subcommand ``engine`` or
``front``; the device's costs reach them in the environment.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flask import Flask

from embedsvc.api.wsgi import create_app
from embedsvc.cli import main as embedsvc_main
from embedsvc.logs import configure_logging
from embedsvc.model import backend
from embedsvc.model.fake import FakeEncoder
from embedsvc.service import Service
from embedsvc.serving.server import Server
from embedsvc.settings import Settings

_COSTS = ("BENCH_SIM_FIXED_MS", "BENCH_SIM_PER_TOKEN_US")  # to the engine process
# a folder: the engine process profiles its loop and its batcher thread (cProfile, one file
# each, written as it exits), to see where its CPU a request goes
_PROFILE = "BENCH_ENGINE_PROFILE"


_KNOWN_MOST = 8192  # rows FreeDevice remembers (1.5 KiB each at 384 dimensions)


class FreeDevice(FakeEncoder):
    """The simulated device at zero cost, which says so (``Runner.device_free``).

    A device computes on itself, not on the host's CPU, so what the host pays for a batch
    should be what a server pays to hand it over and take its rows back. The fake's rows
    (a gather, a product and a sum over every token, in numpy) cost the process that runs
    them about a sixth of the engine loop's instructions a request: charged to the server,
    they measured the fake. This one remembers each input's row by its ids (the benches send
    a pool of 1,024 texts), so that a batch costs a lookup an input and one copy; the rows
    are the fake's, to the bit (a row is the same in any batch)."""

    free = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._known: dict[tuple[int, ...], np.ndarray] = {}

    def encode(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        if self.fail is not None or self.record:  # what the fake does with a batch first
            return super().encode(batch)
        return self._rows(batch)

    def _rows(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        known = self._known
        keys = [tuple(ids) for ids in batch]
        missing = list(dict.fromkeys(k for k in keys if k not in known))
        if missing:
            if len(known) + len(missing) > _KNOWN_MOST:
                known.clear()
            known.update(zip(missing, super()._rows(missing), strict=True))
        return np.array([known[k] for k in keys])


def fake_encoder(fixed_ms: float = 0.0, per_token_us: float = 0.0) -> FakeEncoder:
    kind = FreeDevice if fixed_ms == 0 and per_token_us == 0 else FakeEncoder
    return kind(dimension=384, max_input_tokens=256, delay_s=fixed_ms / 1000,
                per_token_s=per_token_us / 1e6, record=False)


def build_service(settings: Settings, fixed_ms: float = 0.0, per_token_us: float = 0.0
                  ) -> Service:
    service = Service(settings, encoder=fake_encoder(fixed_ms, per_token_us))
    service.start(background=False)
    return service


def make_app() -> Flask:
    """The same app for another WSGI server: ``granian --interface wsgi --factory
    bench.sim_server:make_app`` (zero-cost device)."""
    settings = Settings(log_level="warning")
    configure_logging(settings.log_level, settings.log_format)
    return create_app(settings, service=build_service(settings))


def as_embedsvc(argv: list[str]) -> int:
    """``embedsvc`` with ``argv``, every model it loads the simulated device (as
    tests/integration/fake_serve.py does for the tests)."""
    encoder = fake_encoder(*(float(os.environ.get(name, "0")) for name in _COSTS))
    if argv[:1] == ["engine"] and os.environ.get(_PROFILE):
        profile_engine(Path(os.environ[_PROFILE]))
    # every load goes through it, `embedsvc serve`'s loading thread's too
    backend.load_encoder = lambda settings, preloaded=None: encoder  # type: ignore[assignment]
    return embedsvc_main(argv)


def profile_engine(folder: Path) -> None:
    """The engine's loop (``EngineServer.run``) and batcher thread (``Batcher._run``) each
    under its own cProfile (a profile sees only the thread that enabled it), timed by the
    thread's CPU clock: on shared cores a wall clock charged a call the time its thread
    was preempted in it (a send that woke another thread, a poll's return)."""
    from embedsvc.batching.batcher import Batcher
    from embedsvc.remote.server import EngineServer

    folder.mkdir(parents=True, exist_ok=True)

    def profiled(method: Callable[..., None], name: str) -> Callable[..., None]:
        def run(*args: object) -> None:
            profile = cProfile.Profile(time.thread_time)
            profile.enable()
            try:
                method(*args)
            finally:
                profile.disable()
                profile.dump_stats(folder / f"{name}-{os.getpid()}.prof")
        return run

    EngineServer.run = profiled(EngineServer.run, "loop")  # type: ignore[method-assign]
    Batcher._run = profiled(Batcher._run, "batcher")  # type: ignore[method-assign]


def main() -> int:
    if sys.argv[1:2] in (["engine"], ["front"]):  # a process of --workers N
        return as_embedsvc(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--fixed-ms", type=float, default=0.0, help="cost of each batch")
    parser.add_argument("--per-token-us", type=float, default=0.0, help="cost per padded token")
    parser.add_argument("--workers", type=int, default=1,
                        help="HTTP processes in front of one engine process (embedsvc serve "
                        "--workers N); 1: one process")
    args = parser.parse_args()
    if args.workers > 1:
        os.environ.update(zip(_COSTS, (str(args.fixed_ms), str(args.per_token_us)),
                              strict=True))
        return as_embedsvc(["serve", "--port", str(args.port), "--threads", str(args.threads),
                            "--workers", str(args.workers), "--log-level", "warning"])
    settings = Settings(port=args.port, threads=args.threads, log_level="warning")
    configure_logging(settings.log_level, settings.log_format)
    Server(settings, build_service(settings, args.fixed_ms, args.per_token_us)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
