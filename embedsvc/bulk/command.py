"""``embedsvc embed``: check the whole command first (files, options, limits, an unfinished
job's identity), and only then load a model, call a server or start Ray.

Exit codes: 0 done, 1 the job failed (a bad row, a server error, an unreachable server),
2 the command cannot run as given; 130 interrupted. Every message is one line.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from ..logs import quiet_model_libraries
from ..model import quantize
from ..model.graph_cache import cache_root
from ..settings import Settings
from .errors import BulkError, UsageError
from .job import Summary, embed_file, open_checkpoint
from .kinds import SPARSE_ON_RAY, expected_kind, kind_problem
from .parts import PARQUET, output_kind
from .records import TABLES, count_records, input_kind, table_id_column

# Settings that only shape the in-process model; with --url the server's own apply.
_MODEL_SETTINGS = ("model", "device", "dtype", "max_batch_tokens", "max_batch_size",
                   "max_wait_ms", "max_queue", "max_inputs_per_request", "max_input_chars",
                   "auto_truncate", "kind")
_RAY_OPTIONS = ("actors", "actor_cpus")


def run(args: Any, settings: Settings) -> int:
    """Run ``embedsvc embed`` with parsed arguments; the exit code."""
    try:
        check_options(args, settings)
        if settings.log_level != "debug":
            quiet_model_libraries()  # no weight-loading bars and warnings between our lines
        if args.ray is not None:
            from .cluster import run_on_ray

            summary = run_on_ray(args, settings)
        else:
            summary = _run_file(args, settings)
    except UsageError as exc:
        return _fail(exc, 2)
    except (BulkError, OSError) as exc:
        return _fail(exc, 1)
    except KeyboardInterrupt:
        return _fail("interrupted: rerun the same command to continue where it stopped", 130)
    print(f"embedsvc: {summary} -> {args.output}", file=sys.stderr)
    return 0


def _fail(problem: object, code: int) -> int:
    text = " ".join(str(problem).split())  # one line, whatever the exception held
    print(f"embedsvc: {text}", file=sys.stderr)
    return code


def check_options(args: Any, settings: Settings) -> None:
    """Everything that can be refused before any work starts, as ``UsageError``."""
    if args.url and args.ray is not None:
        raise UsageError("--url and --ray exclude each other: --url sends to one server, "
                         "--ray runs the model on a Ray cluster")
    if args.ray is None:
        given = [f"--{o.replace('_', '-')}" for o in _RAY_OPTIONS if getattr(args, o) is not None]
        if given:
            raise UsageError(f"{given[0]} applies to --ray only: add --ray or drop it")
    if args.url:
        given = [n for n in _MODEL_SETTINGS if getattr(args, n, None) is not None]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} shapes the in-process model; with "
                             "--url the server's settings apply: drop it, or drop --url")
    elif getattr(args, "api_key", None) is not None:
        raise UsageError("--api-key is sent to the server of --url: add --url or drop it")
    else:
        check_limits(args.chunk_size, settings)
    if args.ray is None:
        _check_files(Path(args.input), Path(args.output), args)
    elif output_kind(Path(args.output)) not in (None, PARQUET):
        raise UsageError("with --ray, --output is a directory of Parquet shards, not "
                         f"{Path(args.output).name!r}")
    if not args.url:  # the kind from the model's config files; a server's, once asked
        _check_kind(expected_kind(settings), args)
    if output_dtype(args) != quantize.FLOAT and (args.url or args.ray is not None):
        raise UsageError("--output-dtype quantizes in this process, with the model's own "
                         "calibration: drop --url and --ray, or ask the server's /v2/embed "
                         "for embedding_types")


def output_dtype(args: Any) -> str:
    return getattr(args, "output_dtype", None) or quantize.FLOAT


class Quantized:
    """An in-process embedder whose rows come out as ``dtype`` codes (model/quantize.py):
    int8/uint8 from the model's calibration, cached as the server caches it."""

    def __init__(self, embedder: Any, dtype: str, settings: Settings) -> None:
        if embedder.kind != "embedding":
            raise BulkError(f"--output-dtype {dtype} quantizes dense embeddings; this is a "
                            f"{embedder.kind} model: drop --output-dtype")
        self.embedder, self.dtype, self.kind = embedder, dtype, embedder.kind
        self.identity = {**embedder.identity, "output_dtype": dtype}
        self.ranges = None
        if dtype in (quantize.INT8, quantize.UINT8):
            engine = embedder.engine

            def raw(texts: list[str]) -> np.ndarray:
                return engine.embed(texts, normalize=False, truncate=True).vectors

            step = min(64, settings.max_inputs_per_request)
            self.ranges = quantize.calibrate(cache_root(settings.cache_dir), engine.info, raw,
                                             batch=step).ranges()

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, int]:
        rows, tokens = self.embedder(texts)
        return quantize.quantize(rows, self.dtype, self.ranges), tokens

    def close(self) -> None:
        self.embedder.close()


def _check_kind(kind: str | None, args: Any) -> None:
    output = PARQUET if args.ray is not None else output_kind(Path(args.output))
    problem = kind_problem(kind, output)
    if problem and args.ray is not None and kind == "sparse":
        problem = SPARSE_ON_RAY
    if problem:
        raise UsageError(problem)


def check_limits(chunk_size: int, settings: Settings) -> None:
    """A chunk is one request to the in-process engine, so it must fit the request limit
    (chunks beyond MAX_QUEUE wait for admission rather than fail)."""
    if chunk_size > settings.max_inputs_per_request:
        raise UsageError(f"--chunk-size ({chunk_size}) is larger than MAX_INPUTS_PER_REQUEST "
                         f"({settings.max_inputs_per_request}): lower --chunk-size or raise "
                         "--max-inputs-per-request")


def _check_files(source: Path, target: Path, args: Any) -> None:
    if not source.is_file():
        what = "is a directory (a directory needs --ray)" if source.is_dir() else "not found"
        raise UsageError(f"input file {str(source)!r} {what}")
    if output_kind(target) is None:
        raise UsageError(f"--output must end in .npy, .jsonl or .parquet, not {target.name!r}")
    if not target.parent.is_dir():
        raise UsageError(f"the output's directory {str(target.parent)!r} does not exist")
    if target.exists() and target.resolve() == source.resolve():
        raise UsageError("--output is the input file: choose another output")
    if input_kind(source) in TABLES:
        table_id_column(source, args.text_field, args.id_field)


def _run_file(args: Any, settings: Settings) -> Summary:
    from .embedders import LocalEmbedder, RemoteEmbedder, local_identity
    from .progress import progress_bar

    source, target = Path(args.input), Path(args.output)
    embedder: Any = RemoteEmbedder(args.url, settings.api_key) if args.url else None
    try:
        if embedder is not None:  # its GET /info told the kind
            _check_kind(embedder.kind, args)
        # an unfinished job is checked before the model loads
        identity = embedder.identity if embedder else local_identity(settings)
        dtype = output_dtype(args)
        if dtype != quantize.FLOAT:  # float jobs keep the identity they always had
            identity = {**identity, "output_dtype": dtype}
        checkpoint = open_checkpoint(source, target, identity, text_field=args.text_field,
                                     id_field=args.id_field, part_size=args.part_size,
                                     restart=args.restart)
        if embedder is None:
            embedder = LocalEmbedder(settings)
            _check_kind(embedder.kind, args)  # the config files may not have told it
            if dtype != quantize.FLOAT:
                embedder = Quantized(embedder, dtype, settings)
        done = checkpoint.done.records
        with progress_bar(total=count_records(source), initial=done) as bar:
            return embed_file(source, target, embedder, text_field=args.text_field,
                              id_field=args.id_field, chunk_size=args.chunk_size,
                              concurrency=args.concurrency, progress=bar.update,
                              checkpoint=checkpoint)
    finally:
        if embedder is not None:
            embedder.close()
