"""One resumable bulk job: stream the input in chunks through an embedder, a bounded number
of chunks in flight, and hand the rows in input order to the checkpoint.

Example (loads the model)::

    embed_file(BulkOptions("corpus.txt", "vectors.npy"), LocalEmbedder(Settings()))
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..rules import InputRefused
from .checkpoint import Checkpoint, fingerprint
from .embedders import Embedder, Quantized
from .errors import BulkError, UsageError
from .interrupt import POLL_S, Interrupted, StopSignals
from .options import BulkOptions
from .parts import output_kind
from .records import TEXT, Position, Record, id_type, input_kind, read_images, read_records

Chunk = list[tuple[Record, Position]]
IN_FLIGHT_SHARE = 8  # the chunks in flight hold at most an eighth of a job's inputs...
MIN_CHUNK = 16  # ...in chunks of at least this many


@dataclass(frozen=True)
class Summary:
    inputs: int  # embedded by this run
    tokens: int | None  # None where not counted (on Ray)
    seconds: float
    resumed: int = 0  # done by earlier runs of the same job

    def __str__(self) -> str:
        rate = self.inputs / self.seconds if self.seconds else 0.0
        earlier = f"; {self.resumed} done by an earlier run" if self.resumed else ""
        tokens = "" if self.tokens is None else f", {self.tokens} tokens"
        return (f"{self.inputs} inputs{tokens} in {self.seconds:.1f}s "
                f"({rate:.1f} inputs/s){earlier}")


def job_identity(source: Path, target: Path, engine: dict[str, Any], text_field: str,
                 id_field: str | None, image_field: str | None = None) -> dict[str, Any]:
    """What the output depends on (see checkpoint.py); a resumed job must match it."""
    identity: dict[str, Any] = {
        "input": {"path": str(source.resolve()), **fingerprint(source)},
        "output format": output_kind(target),
        "model": engine,
    }
    if image_field is not None:
        identity["fields"] = {"image": image_field, "id": id_field}
    elif input_kind(source) != TEXT and not source.is_dir():  # a folder's ids are its paths
        identity["fields"] = {"text": text_field, "id": id_field}
    return identity


def open_checkpoint(options: BulkOptions, engine: dict[str, Any]) -> Checkpoint:
    """The job's checkpoint, checked against this run's options (no model needed yet)."""
    source, target = Path(options.input), Path(options.output)
    kind = output_kind(target)
    if kind is None:
        raise UsageError(f"--output must end in .npy, .jsonl or .parquet, not {target.name!r}")
    identity = job_identity(source, target, engine, options.text_field, options.id_field,
                            options.image_field)
    if options.output_dtype != "float":  # float jobs keep the identity they always had
        identity["output dtype"] = options.output_dtype
    return Checkpoint.open(target, kind, identity, part_size=options.part_size,
                           part_seconds=options.part_seconds, restart=options.restart)


def embed_file(options: BulkOptions, embedder: Embedder, *,
               progress: Callable[[int], None] | None = None,
               checkpoint: Checkpoint | None = None, stop: StopSignals | None = None,
               total: int | None = None) -> Summary:
    """Embed every input of ``options.input`` into ``options.output``, continuing an
    unfinished run. On a signal that ``stop`` caught, the rows computed are committed and
    ``Interrupted`` says how many are saved; one that comes once the output is in place only
    sets ``stop.signum``. ``total``, the inputs the file holds where the caller counted them,
    makes the chunks of a small job smaller (``chunk_size``). With ``options.output_dtype``
    other than float, ``embedder`` must be a ``LocalEmbedder``: its rows are quantized
    here. An image job (``options.images``) needs ``LocalEmbedder(settings, images=True)``,
    which reads the image files that the records name."""
    if options.images != getattr(embedder, "images", False):
        raise UsageError("an image job (a folder of images, or --image-field) embeds with "
                         "LocalEmbedder(settings, images=True), and only an image job does")
    checkpoint = checkpoint or open_checkpoint(options, embedder.identity)
    source = Path(options.input)
    if not source.is_dir():
        checkpoint.id_type = id_type(source, options.image_field or options.text_field,
                                     options.id_field)
    if options.output_dtype != "float":
        embedder = Quantized(embedder, options.output_dtype)
    stop = stop or StopSignals()  # not entered: catches nothing, so never stops the job
    start = checkpoint.done
    started = time.monotonic()
    if options.images:
        records = read_images(source, options.image_field, options.id_field, start,
                              max_chars=embedder.max_chars)
    else:
        records = read_records(source, options.text_field, options.id_field, start,
                               max_chars=embedder.max_chars)
    job = _Job(checkpoint, progress)
    size = chunk_size(options, None if total is None else total - start.records)
    try:
        job.run(_chunks(records, size), embedder, options.concurrency, source, stop)
    except Interrupted as exc:
        exc.saved = f"{checkpoint.saved} inputs saved in {checkpoint.dir}"
        raise
    except BaseException:
        checkpoint.abort()
        raise
    total = checkpoint.finish(joining=stop.interruptible,
                              dimension=getattr(embedder, "dimension", None),
                              dtype=getattr(embedder, "row_type", "<f4"))
    if total != start.records + job.inputs:
        raise BulkError(f"wrote {total} rows for {start.records + job.inputs} inputs")
    return Summary(job.inputs, job.tokens, time.monotonic() - started, start.records)


def chunk_size(options: BulkOptions, left: int | None) -> int:
    """``options.chunk_size``, smaller for a job with ``left`` inputs to go where the chunks in
    flight would hold more than ``IN_FLIGHT_SHARE`` of them (never under ``MIN_CHUNK``): an
    interrupt drops those, and chunks sent together come back together (the batcher gives
    them turns), so at the defaults a 2,000-line job stopped at half kept nothing."""
    if left is None:
        return options.chunk_size
    share = -(-left // (IN_FLIGHT_SHARE * options.concurrency))  # rounded up
    return min(options.chunk_size, max(MIN_CHUNK, share))


class _Job:
    """Chunks through the embedder, at most ``concurrency`` in flight, their rows handed in
    input order to the checkpoint; on ``Interrupted``, the rows computed are committed."""

    def __init__(self, checkpoint: Checkpoint, progress: Callable[[int], None] | None) -> None:
        self.checkpoint, self.progress = checkpoint, progress
        self.inputs = self.tokens = 0

    def run(self, chunks: Iterator[Chunk], embedder: Embedder, concurrency: int, source: Path,
            stop: StopSignals) -> None:
        # Not a `with` block: its exit would wait for the chunks in flight, whose rows an
        # interrupted or failed job drops anyway.
        pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="embed")
        pending: deque[tuple[Chunk, Future]] = deque()
        try:
            for chunk in chunks:
                pending.append((chunk, pool.submit(embedder, [r.text for r, _ in chunk])))
                while pending and (len(pending) >= concurrency or pending[0][1].done()):
                    self._write_first(pending, source, stop)
                stop.check()
            while pending:
                self._write_first(pending, source, stop)
        except Interrupted:
            # only chunks in input order from the first: one still computing stops it, so
            # that no row after a gap is committed (the resume would start past the gap)
            while pending and _succeeded(pending[0][1]):
                self._write_first(pending, source, stop)
            self.checkpoint.commit()
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _write_first(self, pending: deque[tuple[Chunk, Future]], source: Path,
                     stop: StopSignals) -> None:
        """The first chunk in flight written, then taken off: an interrupt while it is
        waited for leaves it first, not written and not skipped."""
        self._write(*pending[0], source, stop)
        pending.popleft()

    def _write(self, chunk: Chunk, future: Future, source: Path, stop: StopSignals) -> None:
        rows, used = _result(chunk, future, source, stop)
        self.checkpoint.write([r for r, _ in chunk], rows, chunk[-1][1])
        self.inputs, self.tokens = self.inputs + len(chunk), self.tokens + used
        if self.progress:
            self.progress(len(chunk))


def _succeeded(future: Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _result(chunk: Chunk, future: Future, source: Path, stop: StopSignals) -> Any:
    """The chunk's (rows, tokens); a signal is seen within ``POLL_S`` while it computes."""
    while True:
        try:
            return future.result(timeout=POLL_S)
        except TimeoutError:
            stop.check()
        except InputRefused as exc:  # the engine's rule, told with the record it refused
            record = chunk[exc.index][0]
            raise BulkError(f"{source}: record {record.id}: the input {exc.detail}") from None


def _chunks(records: Iterator[tuple[Record, Position]], size: int) -> Iterator[Chunk]:
    chunk: Chunk = []
    for item in records:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
