"""The command line: ``embedsvc serve``, ``embed`` and ``export``; ``main(argv)`` -> exit code."""

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
    export = commands.add_parser(
        "export",
        help="export the model to ONNX (and int8 with --quantize int8) into CACHE_DIR, ahead "
        "of time, for images and read-only file systems",
        description="Builds what a CPU server would build on its first start, and checks it "
        "as a start does. Point --cache-dir (EMBEDSVC_CACHE_DIR) at the directory the "
        "servers will read.",
    )
    Settings.add_arguments(export)
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
    if args.command == "export":
        return _export(settings)
    from .server import serve

    return serve(settings)


def _export(settings: Settings) -> int:
    from .backend import export
    from .logs import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    try:
        print(export(settings))
    except RuntimeError as exc:
        print(f"embedsvc: {exc}", file=sys.stderr)
        return 1
    return 0
