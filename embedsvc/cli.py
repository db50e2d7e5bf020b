"""The command line: ``embedsvc serve`` and ``embedsvc embed``; ``main(argv)`` -> exit code."""

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
    embed = commands.add_parser(
        "embed",
        help="embed a text or JSONL file into .npy or JSONL, in this process or via --url",
        description="Embeds every non-blank line of INPUT (a text file, or .jsonl/.ndjson). "
        "Settings flags apply to the in-process model.",
    )
    embed.add_argument("input", help="text file (one input per line) or .jsonl/.ndjson")
    embed.add_argument("--output", "-o", required=True, help=".npy or .jsonl file to write")
    embed.add_argument("--text-field", default="text", help="JSONL field holding the text")
    embed.add_argument("--id-field", default="id",
                       help="JSONL field copied to the output's id (default: the line number)")
    embed.add_argument("--url", help="send to a running server at this URL instead")
    embed.add_argument("--chunk-size", type=int, default=256, help="inputs per request")
    embed.add_argument("--concurrency", type=int, default=4, help="chunks in flight")
    Settings.add_arguments(embed)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_args(args, os.environ)
    except SettingsError as exc:
        print(f"embedsvc: {exc}", file=sys.stderr)
        return 2
    if args.command == "embed":
        from .bulk import run

        return run(args, settings)
    from .server import serve

    return serve(settings)
