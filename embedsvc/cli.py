"""The command line: ``embedsvc serve [--<setting> VALUE ...]``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import __version__
from .settings import Settings, SettingsError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embedsvc",
        description="Self-hosted text embeddings: one process, one model, a micro-batcher.",
    )
    parser.add_argument("--version", action="version", version=f"embedsvc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="load the model, then serve HTTP with waitress",
        description="Every flag also reads from EMBEDSVC_<NAME>; a flag wins over the variable.",
    )
    Settings.add_arguments(serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_args(args, os.environ)
    except SettingsError as exc:
        print(f"embedsvc: {exc}", file=sys.stderr)
        return 2
    from .server import serve

    return serve(settings)
