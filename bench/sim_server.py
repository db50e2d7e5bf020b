"""embedsvc over a simulated device: the server's own cost, without the model's.

    .venv/bin/python bench/sim_server.py --port 8091 --fixed-ms 0 --per-token-us 0

The encoder spends ``fixed_ms + per_token_us x padded tokens`` in time.sleep (the GIL
released, as during CUDA kernels) and returns deterministic 384-dimensional vectors, so all
CPU the process uses is the server's: HTTP, parsing, validation, batching, serialising.
"""

from __future__ import annotations

import argparse

from flask import Flask

from embedsvc.api.wsgi import create_app
from embedsvc.logs import configure_logging
from embedsvc.model.fake import FakeEncoder
from embedsvc.service import Service
from embedsvc.serving.server import Server
from embedsvc.settings import Settings


def build_service(settings: Settings, fixed_ms: float = 0.0, per_token_us: float = 0.0
                  ) -> Service:
    encoder = FakeEncoder(dimension=384, max_input_tokens=256, delay_s=fixed_ms / 1000,
                          per_token_s=per_token_us / 1e6, record=False)
    service = Service(settings, encoder=encoder)
    service.start(background=False)
    return service


def make_app() -> Flask:
    """The same app for another WSGI server: ``granian --interface wsgi --factory
    bench.sim_server:make_app`` (zero-cost device)."""
    settings = Settings(log_level="warning")
    configure_logging(settings.log_level, settings.log_format)
    return create_app(settings, service=build_service(settings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--fixed-ms", type=float, default=0.0, help="cost of each batch")
    parser.add_argument("--per-token-us", type=float, default=0.0, help="cost per padded token")
    args = parser.parse_args()
    settings = Settings(port=args.port, threads=args.threads, log_level="warning")
    configure_logging(settings.log_level, settings.log_format)
    Server(settings, build_service(settings, args.fixed_ms, args.per_token_us)).run()


if __name__ == "__main__":
    main()
