"""One resumable bulk job: stream the input in chunks through an embedder, a bounded number
of chunks in flight, and hand the rows in input order to the checkpoint.

Example (loads the model)::

    embed_file(Path("corpus.txt"), Path("vectors.npy"), LocalEmbedder(Settings()))
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
from .embedders import Embedder
from .errors import BulkError, UsageError
from .parts import output_kind
from .records import TEXT, Position, Record, input_kind, read_records

Chunk = list[tuple[Record, Position]]


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
                 id_field: str | None) -> dict[str, Any]:
    """What the output depends on (see checkpoint.py); a resumed job must match it."""
    identity: dict[str, Any] = {
        "input": {"path": str(source.resolve()), **fingerprint(source)},
        "output format": output_kind(target),
        "model": engine,
    }
    if input_kind(source) != TEXT:
        identity["fields"] = {"text": text_field, "id": id_field}
    return identity


def open_checkpoint(source: Path, target: Path, engine: dict[str, Any], *,
                    text_field: str = "text", id_field: str | None = None,
                    part_size: int = 10_000, restart: bool = False) -> Checkpoint:
    """The job's checkpoint, checked against this run's options (no model needed yet)."""
    kind = output_kind(target)
    if kind is None:
        raise UsageError(f"--output must end in .npy, .jsonl or .parquet, not {target.name!r}")
    identity = job_identity(source, target, engine, text_field, id_field)
    return Checkpoint.open(target, kind, identity, part_size=part_size, restart=restart)


def embed_file(
    source: Path,
    target: Path,
    embedder: Embedder,
    *,
    text_field: str = "text",
    id_field: str | None = None,
    chunk_size: int = 256,
    concurrency: int = 4,
    part_size: int = 10_000,
    restart: bool = False,
    progress: Callable[[int], None] | None = None,
    checkpoint: Checkpoint | None = None,
) -> Summary:
    """Embed every input of ``source`` into ``target``, continuing an unfinished run."""
    checkpoint = checkpoint or open_checkpoint(
        source, target, embedder.identity, text_field=text_field, id_field=id_field,
        part_size=part_size, restart=restart)
    start = checkpoint.done
    started, inputs, tokens = time.monotonic(), 0, 0
    records = read_records(source, text_field, id_field, start)
    try:
        for chunk, (rows, used) in _embedded(_chunks(records, chunk_size), embedder,
                                             concurrency, source):
            checkpoint.write([r for r, _ in chunk], rows, chunk[-1][1])
            inputs, tokens = inputs + len(chunk), tokens + used
            if progress:
                progress(len(chunk))
    except BaseException:
        checkpoint.abort()
        raise
    total = checkpoint.finish()
    if total != start.records + inputs:
        raise BulkError(f"wrote {total} rows for {start.records + inputs} inputs")
    return Summary(inputs, tokens, time.monotonic() - started, start.records)


def _embedded(chunks: Iterator[Chunk], embedder: Embedder, concurrency: int, source: Path
              ) -> Iterator[tuple[Chunk, Any]]:
    """Each chunk with its (rows, tokens), in order; at most ``concurrency`` in flight."""
    pending: deque[tuple[Chunk, Future]] = deque()
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="embed") as pool:
        try:
            for chunk in chunks:
                pending.append((chunk, pool.submit(embedder, [r.text for r, _ in chunk])))
                if len(pending) >= concurrency:
                    chunk, future = pending.popleft()
                    yield chunk, _result(chunk, future, source)
            while pending:
                chunk, future = pending.popleft()
                yield chunk, _result(chunk, future, source)
        finally:
            for _, future in pending:
                future.cancel()  # a failed chunk stops the job without waiting for the rest


def _result(chunk: Chunk, future: Future, source: Path) -> Any:
    try:
        return future.result()
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
