"""``embedsvc embed``: check the whole command first (files, options, limits, an unfinished
job's identity), and only then load a model, call a server or start Ray.

Exit codes: 0 done, 1 the job failed (a bad row, a server error, an unreachable server),
2 the command cannot run as given; 130 interrupted. Every message is one line.
"""

from __future__ import annotations

import os
import shlex
import signal
import stat
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from ..logs import quiet_model_libraries
from ..settings import Settings
from .errors import BulkError, UsageError
from .interrupt import Interrupted, StopSignals
from .job import Summary, embed_file, open_checkpoint
from .kinds import SPARSE_ON_RAY, dtype_problem, expected_kind, image_problem, kind_problem
from .options import BulkOptions, option_default
from .parts import PARQUET, output_kind
from .records import (
    IMAGE_FLAG,
    IMAGE_SUFFIXES,
    TABLES,
    TEXT,
    TEXT_FLAG,
    check_table,
    count_images,
    count_records,
    image_files,
    input_kind,
)

# Settings that a job through --url sends along or uses itself; the others shape the
# in-process model, and with --url the server's own apply.
_REMOTE_SETTINGS = ("api_key", "log_level", "log_format")
_RAY_OPTIONS = ("actors", "actor_cpus")


def run(options: BulkOptions, settings: Settings) -> int:
    """Run ``embedsvc embed``; the exit code. After SIGINT or SIGTERM it ends the process
    itself, once what was computed is saved (see ``_interrupted``); a signal that comes once
    the output is in place ends nothing, and the last line says so."""
    with StopSignals() as stop:
        try:
            with stop.interruptible():
                check_options(options, settings)
                if settings.log_level != "debug":
                    quiet_model_libraries()  # no weight-loading bars and warnings between lines
            if options.on_ray:
                from .cluster import run_on_ray

                summary = run_on_ray(options, settings, stop)
            else:
                summary = _run_file(options, settings, stop)
        except UsageError as exc:
            return _fail(exc, 2)
        except (BulkError, OSError) as exc:
            return _fail(exc, 1)
        except Interrupted as exc:
            _interrupted(exc, options)
        except KeyboardInterrupt:  # where no handler could be installed (not the main thread)
            return _fail("interrupted: rerun the same command to continue where it stopped", 130)
        late = "" if stop.signum is None else (
            f" ({signal.Signals(stop.signum).name} came as the job finished: the output is "
            "complete)")
        print(f"embedsvc: {summary} -> {options.output}{late}", file=sys.stderr)
    return 0


def _interrupted(exc: Interrupted, options: BulkOptions) -> None:
    """Say what was saved and how to go on, then exit at once: the chunks still in flight
    (threads in the engine, or waiting on a server) would hold a normal exit until they
    finish, for rows that are dropped anyway."""
    saved = exc.saved or "nothing was computed yet"
    again = shlex.join(["embedsvc", *(a for a in options.argv if a != "--restart")])
    _fail(f"interrupted by {exc}: {saved}; to continue, run: {again}", exc.exit_code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exc.exit_code)


def _fail(problem: object, code: int) -> int:
    text = " ".join(str(problem).split())  # one line, whatever the exception held
    print(f"embedsvc: {text}", file=sys.stderr)
    return code


def check_options(options: BulkOptions, settings: Settings) -> None:
    """Everything that can be refused before any work starts, as ``UsageError``."""
    if options.url and options.on_ray:
        raise UsageError("--url and --ray exclude each other: --url sends to one server, "
                         "--ray runs the model on a Ray cluster")
    _check_images(options)
    if not options.on_ray:
        given = [f"--{o.replace('_', '-')}" for o in _RAY_OPTIONS
                 if getattr(options, o) is not None]
        if given:
            raise UsageError(f"{given[0]} applies to --ray only: add --ray or drop it")
    if options.url:
        given = sorted(options.setting_flags - set(_REMOTE_SETTINGS))
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} shapes the in-process model; with "
                             "--url the server's settings apply: drop it, or drop --url")
    elif "api_key" in options.setting_flags:
        raise UsageError("--api-key is sent to the server of --url: add --url or drop it")
    else:
        check_limits(options.chunk_size, settings)
    if not options.on_ray:
        _check_extras(options)
        _check_files(options)
    elif output_kind(Path(options.output)) not in (None, PARQUET):
        raise UsageError("with --ray, --output is a directory of Parquet shards, not "
                         f"{Path(options.output).name!r}")
    if not options.url:  # the kind from the model's config files; a server's, once asked
        _check_kind(expected_kind(settings), options)


def _check_images(options: BulkOptions) -> None:
    """An image job (a folder of images, or a table with --image-field) runs the image-text
    model in this process and reads no text field."""
    if not options.images:
        return
    source = Path(options.input)
    for flag, given in (("--url", options.url), ("--ray", options.on_ray)):
        if given:
            raise UsageError(f"{flag} embeds texts; images (a folder of images, or "
                             f"--image-field) are embedded in this process: drop {flag}")
    if source.is_dir():
        if options.image_field is not None:
            raise UsageError(f"input {str(source)!r} is a folder, whose image files are the "
                             "inputs: drop --image-field (it names a column of image paths "
                             "in a JSONL, Parquet or Arrow file)")
        if options.id_field is not None:
            raise UsageError("a folder's ids are its images' paths, relative to it: drop "
                             "--id-field")
        if not image_files(source):
            raise UsageError(f"no image files ({', '.join(IMAGE_SUFFIXES)}) in the folder "
                             f"{str(source)!r} (a folder of Parquet or JSONL files needs --ray)")
    elif input_kind(source) == TEXT:
        raise UsageError(f"--image-field names a field of a JSONL, Parquet or Arrow file, not "
                         f"of {source.name!r}")
    if options.text_field != option_default("text_field"):
        raise UsageError("an image job reads no text: drop --text-field")
    if find_spec("PIL") is None:
        from ..image import MISSING

        raise UsageError(MISSING)


def _check_extras(options: BulkOptions) -> None:
    """A feature whose library is an extra that is not installed: one line naming the extra
    (--ray's is said where Ray is imported)."""
    if options.url and find_spec("httpx") is None:
        raise UsageError("--url needs httpx: pip install 'embedsvc[remote]'")
    tables = [p.name for p in (Path(options.input), Path(options.output))
              if input_kind(p) in TABLES or output_kind(p) == PARQUET]
    if tables and find_spec("pyarrow") is None:
        raise UsageError(f"{tables[0]}: Parquet and Arrow files need pyarrow: pip install "
                         "'embedsvc[parquet]'")


def _check_kind(kind: str | None, options: BulkOptions) -> None:
    output = PARQUET if options.on_ray else output_kind(Path(options.output))
    problem = (image_problem(kind) if options.images else None) or kind_problem(
        kind, output) or dtype_problem(kind, options.output_dtype, options.images)
    if problem and options.on_ray and kind == "sparse":
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


def _check_files(options: BulkOptions) -> None:
    source, target = Path(options.input), Path(options.output)
    _check_input(source, folder=options.images)
    _check_output(target)
    if target.exists() and target.resolve() == source.resolve():
        raise UsageError("--output is the input file: choose another output")
    if input_kind(source) in TABLES and not source.is_dir():
        if options.image_field is not None:
            check_table(source, options.image_field, options.id_field, IMAGE_FLAG)
        else:
            check_table(source, options.text_field, options.id_field, TEXT_FLAG)


def _check_input(source: Path, folder: bool = False) -> None:
    name = str(source)
    try:
        mode = source.stat().st_mode
    except FileNotFoundError:
        dangling = " (a symbolic link to nothing)" if source.is_symlink() else ""
        raise UsageError(f"input file {name!r} not found{dangling}") from None
    except OSError as exc:  # a loop of symbolic links, a path through a file
        raise UsageError(f"input file {name!r} cannot be opened: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        if folder:  # a folder of images: its files are read as the job comes to them
            return
        raise UsageError(f"input file {name!r} is a directory (a directory needs --ray)")
    if not stat.S_ISREG(mode):
        raise UsageError(f"input {name!r} is {_special(mode)}, not a file: the job reads its "
                         "input twice (to count it, then to embed it) and seeks in it to "
                         "resume; save the data to a file and embed that")
    if not os.access(source, os.R_OK):
        raise UsageError(f"input file {name!r} cannot be read (permission denied)")


def _special(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "a socket" if stat.S_ISSOCK(mode) else "a special file"


def _check_output(target: Path) -> None:
    """Refused now what would otherwise fail once the whole job has run."""
    if output_kind(target) is None:
        raise UsageError(f"--output must end in .npy, .jsonl or .parquet, not {target.name!r}")
    if not target.parent.is_dir():
        raise UsageError(f"the output's directory {str(target.parent)!r} does not exist")
    if target.is_dir():
        raise UsageError(f"--output {str(target)!r} is a directory: name a file, such as "
                         f"{str(target / ('vectors' + target.suffix))!r}")
    try:  # the parts and the output are written beside it
        with tempfile.TemporaryFile(dir=target.parent):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write in the output's directory {str(target.parent)!r} "
                         f"({exc.strerror}): choose another --output") from None


def _run_file(options: BulkOptions, settings: Settings, stop: StopSignals) -> Summary:
    """The job in this process or through ``options.url``: the checks, loading the model and
    counting the input are stopped at once by a signal; the job itself (embed_file) keeps
    the rows computed."""
    from .embedders import LocalEmbedder, RemoteEmbedder, local_identity
    from .progress import progress_bar

    embedder: Any = None
    try:
        with stop.interruptible():
            if options.url:  # its GET /info tells the kind
                embedder = RemoteEmbedder(options.url, settings.api_key,
                                          max_chars=settings.max_input_chars)
                _check_kind(embedder.kind, options)
            # an unfinished job is checked before the model loads
            identity = embedder.identity if embedder else local_identity(settings)
            checkpoint = open_checkpoint(options, identity)
        total: int | None = None
        try:
            with stop.interruptible():
                if embedder is None:
                    embedder = LocalEmbedder(settings, images=options.images)
                    _check_kind(embedder.kind, options)  # the config files may not have told
                count = count_images if options.images else count_records
                total = count(Path(options.input))
            with progress_bar(total=total, initial=checkpoint.done.records) as bar:
                return embed_file(options, embedder, progress=bar.update,
                                  checkpoint=checkpoint, stop=stop, total=total)
        except Interrupted as exc:  # rows of earlier runs count too, whenever it came
            of = "" if total is None else f" of {total}"
            exc.saved = f"{checkpoint.saved}{of} inputs saved in {checkpoint.dir}"
            raise
    finally:
        if embedder is not None and not stop.raised:  # interrupted: the process ends
            embedder.close()
