"""The command line: ``embedsvc serve``, ``embed``, ``export`` and ``tiktoken-cache``;
``main(argv)`` -> exit code."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from . import __version__
from .settings import Settings, SettingsError

if TYPE_CHECKING:
    from .bulk.options import BulkOptions


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line with the fix, exit code 2 (argparse prints the whole usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"embedsvc: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="embedsvc",
        description="Self-hosted text embeddings: one process, one model, a micro-batcher.",
    )
    parser.add_argument("--version", action="version", version=f"embedsvc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=_Parser)
    serve = commands.add_parser(
        "serve",
        help="load the model, then serve HTTP with waitress",
        description="Every flag also reads from EMBEDSVC_<NAME>; a flag wins over the variable.",
    )
    Settings.add_arguments(serve, command="serve")
    _add_embed(commands)
    export = commands.add_parser(
        "export",
        help="export the model to ONNX (and int8 with --quantize int8) into CACHE_DIR, ahead "
        "of time, for images and read-only file systems",
        description="Builds what a CPU server would build on its first start, and checks it "
        "as a start does. Point --cache-dir (EMBEDSVC_CACHE_DIR) at the directory the "
        "servers will read.",
    )
    Settings.add_arguments(export, command="export")
    _add_children(commands)
    tokens = commands.add_parser("tiktoken-cache", help="write tiktoken's cl100k_base and "
                                 "o200k_base files where OpenAI clients find them offline")
    tokens.add_argument("directory", nargs="?", help="default: TIKTOKEN_CACHE_DIR, else "
                        "tiktoken's own default ($TMPDIR/data-gym-cache)")
    return parser


def _add_children(commands: argparse._SubParsersAction) -> None:
    """``engine`` and ``front``: the processes of ``embedsvc serve --workers N`` and of
    ``gunicorn -w N``, started by embedsvc itself with every setting in the environment;
    unlisted, since nobody types them."""
    for name in ("engine", "front"):
        child = commands.add_parser(name)
        child.add_argument("--runtime-dir", required=True)
        child.add_argument("--watch-pid", type=int, action="append", default=[])
        if name == "engine":  # which of several models (catalog.py)
            child.add_argument("--model-index", type=int, default=0)
        if name == "front":
            child.add_argument("--fd", type=int, required=True)
            child.add_argument("--probe-fd", type=int)


def _add_embed(commands: argparse._SubParsersAction) -> None:
    from .bulk.options import OUTPUT_DTYPES
    from .bulk.options import option_default as default

    embed = commands.add_parser(
        "embed",
        help="embed a file (text, JSONL, Parquet, Arrow) or a folder of images in this "
        "process, via --url or on Ray",
        description="Embeds every input of INPUT into --output, in committed parts: Ctrl-C "
        "keeps what is computed, and rerunning the same command after an interrupt or a "
        "crash continues (--restart starts over). The settings flags shape the in-process "
        "model (also read from EMBEDSVC_<NAME>); with --url the server's settings apply. "
        "Images (a folder, or --image-field) need an image-text model (CLIP, SigLIP) in "
        "this process.",
    )
    embed.add_argument("input", help="a text file (one input per line), .jsonl/.ndjson, "
                       ".parquet or .arrow/.feather, or a folder of images (.png, .jpg, "
                       ".jpeg, .webp, .gif, .bmp, in its subfolders too; the id is the path "
                       "relative to it); with --ray a Parquet or JSONL file, directory or "
                       "glob on any filesystem pyarrow reads")
    embed.add_argument("--output", "-o", required=True,
                       help=".npy, .jsonl or .parquet file; with --ray a directory of Parquet "
                       "shards")
    embed.add_argument("--text-field", default=default("text_field"),
                       help="JSONL field or table column holding the text (default: %(default)s)")
    embed.add_argument("--id-field", default=None,
                       help="JSONL field or column copied to the output's id (default: 'id' "
                       "where present, else the line or row number)")
    embed.add_argument("--image-field", default=None,
                       help="JSONL field or column holding image file paths (relative ones "
                       "from the input file's folder): embeds the images, with an "
                       "image-text model, instead of a text field")
    embed.add_argument("--url", help="send to a running server at this URL instead")
    embed.add_argument("--chunk-size", type=_positive(int), default=default("chunk_size"),
                       help="inputs per call to the model or server (default: %(default)s)")
    embed.add_argument("--concurrency", type=_positive(int), default=default("concurrency"),
                       help="chunks in flight (default: %(default)s)")
    embed.add_argument("--part-size", type=_positive(int), default=default("part_size"),
                       help="commit a part of the output after this many rows... "
                       "(default: %(default)s)")
    embed.add_argument("--part-seconds", type=_positive(float), default=default("part_seconds"),
                       help="...or this many seconds after it was opened, whichever comes "
                       "first (a run's first parts sooner: after 2 s, then after as long as "
                       "the run has taken so far): a crash loses at most one part's work, "
                       "half of what it computed at most, an interrupt none that was "
                       "computed (default: %(default)s)")
    embed.add_argument("--restart", action="store_true",
                       help="discard an unfinished run of this output and start over")
    embed.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                       help="run on Ray Data: a local Ray, or RAY_ADDRESS, or the cluster at "
                       "ADDRESS (put --ray after INPUT, or write --ray=ADDRESS)")
    embed.add_argument("--actors", type=_positive(int), default=None,
                       help="with --ray: model replicas (default: one per GPU in the "
                       "cluster, else 1)")
    embed.add_argument("--actor-cpus", type=_positive(float), default=None,
                       help="with --ray: CPUs for each replica without a GPU (default: 1)")
    embed.add_argument("--output-dtype", default=default("output_dtype"), choices=OUTPUT_DTYPES,
                       help="write quantized rows: int8/uint8 codes on the model's "
                       "calibrated scale, or binary/ubinary packed sign bits; .npy and "
                       "Parquet hold the integer type (default: %(default)s)")
    Settings.add_arguments(embed, command="embed")


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                "expected a whole number" if kind is int else "expected a number") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError("must be greater than 0")
        return value

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse would point at the top-level --help; the command's says more
        parser.exit(2, f"embedsvc: unrecognized arguments: {' '.join(extra)} "
                    f"(see 'embedsvc {args.command} --help')\n")
    if args.command == "tiktoken-cache":  # no setting applies
        from .api.openai_tokens import cache_command

        return cache_command(args.directory, os.environ)
    if args.command in ("engine", "front"):
        return _child(args)
    try:
        settings = Settings.from_args(args, os.environ)
    except SettingsError as exc:
        print(f"embedsvc: {exc}", file=sys.stderr)
        return 2
    if args.command == "embed":
        from .bulk.command import run
        from .bulk.errors import UsageError

        try:
            options = _bulk_options(args, argv)
        except UsageError as exc:  # options that exclude each other
            print(f"embedsvc: {exc}", file=sys.stderr)
            return 2
        return run(options, settings)
    if args.command == "export":
        return _export(settings)
    return _serve(settings)


def _bulk_options(args: argparse.Namespace, argv: Sequence[str]) -> BulkOptions:
    """The job's options from the parsed flags: what bulk/ takes instead of a Namespace."""
    from .bulk.options import BulkOptions

    given = vars(args)
    names = {f.name for f in dataclasses.fields(BulkOptions)} - {"setting_flags", "argv"}
    flags = {f.name for f in Settings.for_command("embed") if given.get(f.name) is not None}
    return BulkOptions(**{n: given[n] for n in names}, setting_flags=frozenset(flags),
                       argv=tuple(argv))


def _export(settings: Settings) -> int:
    from .logs import configure_logging
    from .model.backend import export

    configure_logging(settings.log_level, settings.log_format)
    try:
        print(export(settings))
    except RuntimeError as exc:
        print(f"embedsvc: {exc}", file=sys.stderr)
        return 1
    return 0


def _child(args: argparse.Namespace) -> int:
    """A process of a multi-process server; its settings are all in the environment."""
    from pathlib import Path

    from .serving.hangup import reload_keys_on_hangup

    reload_keys_on_hangup(None)  # before the imports below
    from .serving import children

    settings = Settings.from_env(os.environ)
    directory = Path(args.runtime_dir)
    if args.command == "engine":
        return children.run_engine(settings, directory, args.watch_pid, args.model_index)
    return children.run_front(settings, directory, args.fd, args.probe_fd, args.watch_pid)


def _serve(settings: Settings) -> int:
    """``embedsvc serve``: a user's mistake is one line and exit 2 (usage) or 1 (failure)."""
    from .serving.hangup import reload_keys_on_hangup

    reload_keys_on_hangup(None)  # before the imports below, which take seconds
    from .serving.preflight import LISTEN_ERRNOS, PreflightError, check_serving, listen_failure

    try:
        check_serving(settings)  # before the imports below, which take seconds
        if settings.workers > 1 or settings.engine == "process":
            from .serving.process import serving_process
            from .serving.supervisor import Supervisor

            serving_process(settings)
            return Supervisor(settings).run()
        from .serving.start import serve  # the model loads while the web stack is imported

        return serve(settings)
    except PreflightError as exc:
        print(f"embedsvc: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # the port was taken between the check and the bind
        if exc.errno not in LISTEN_ERRNOS:
            raise
        print(f"embedsvc: {listen_failure(settings.host, settings.port, exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while the model loads; once serving, it drains
        print("embedsvc: interrupted", file=sys.stderr)
        return 130
