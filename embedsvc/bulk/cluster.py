"""Ray Data: the same engine as a pool of actors over a Parquet or JSONL dataset.

``embed_dataset`` (and ``embedsvc embed INPUT -o DIR --ray [ADDRESS]``) lists the dataset's
files (a file, a directory or a glob, on any filesystem pyarrow reads), reads those without
a finished shard with Ray Data, embeds them with ``map_batches`` on an actor pool (one
``LocalEmbedder`` per actor: one per GPU, or ``actor_cpus`` CPUs each) and writes one
Parquet shard per input file (``part-00000.parquet``, in the sorted order of the files;
columns ``id`` and ``embedding``). Each shard is written aside and moved into place, then
listed in ``DIR/manifest.json``: a rerun skips the files whose shard is listed, and refuses
a dataset, model or option that changed since (``--restart`` starts over).

Ray keeps the rows in order (``preserve_order``), so the driver sees each file's rows
together and in order; it writes the shards as they arrive, and its memory holds a batch.
"""

from __future__ import annotations

import fnmatch
import io
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import orjson

from ..settings import Settings
from .checkpoint import MANIFEST, check_same_job
from .errors import BulkError, UsageError
from .job import Summary
from .records import JSONL, PARQUET, input_kind, read_records, table_id_column

_GLOB = set("*?[")
_VERSION = 1
_READ_CPUS = 0.25


@dataclass(frozen=True)
class Dataset:
    filesystem: Any  # pyarrow.fs.FileSystem
    kind: str  # PARQUET or JSONL
    files: list[Any]  # pyarrow.fs.FileInfo, sorted by path


def _resolve(uri: str) -> tuple[Any, str]:
    from pyarrow import fs

    if "://" in uri:
        return fs.FileSystem.from_uri(uri)
    return fs.LocalFileSystem(), os.path.abspath(uri)


def list_dataset(source: str) -> Dataset:
    """The Parquet or JSONL files of ``source`` (a file, a directory or a glob)."""
    from pyarrow import fs

    filesystem, path = _resolve(source)
    if _GLOB & set(path):
        base = path[: min(path.index(c) for c in _GLOB if c in path)].rsplit("/", 1)[0]
        infos = filesystem.get_file_info(fs.FileSelector(base, recursive=True))
        infos = [i for i in infos if fnmatch.fnmatch(i.path, path)]
    else:
        info = filesystem.get_file_info(path)
        if info.type == fs.FileType.NotFound:
            raise UsageError(f"input {source!r} not found")
        infos = [info] if info.type == fs.FileType.File else filesystem.get_file_info(
            fs.FileSelector(path, recursive=True))
    files = sorted((i for i in infos if i.type == fs.FileType.File
                    and input_kind_of(i.path) in (PARQUET, JSONL)), key=lambda i: i.path)
    kinds = {input_kind_of(i.path) for i in files}
    if not files:
        raise UsageError(f"no .parquet, .jsonl or .ndjson files in {source!r}")
    if len(kinds) > 1:
        raise UsageError(f"{source!r} mixes Parquet and JSONL files: embed each kind apart")
    return Dataset(filesystem, kinds.pop(), files)


def input_kind_of(path: str) -> str:
    return input_kind(PurePosixPath(path))


class ShardDirectory:
    """The output directory: its shards and the manifest that lists them."""

    def __init__(self, target: str, identity: dict[str, Any], restart: bool) -> None:
        self.filesystem, self.root = _resolve(target)
        self.filesystem.create_dir(self.root, recursive=True)
        manifest = self._read(f"{self.root}/{MANIFEST}")
        if manifest and restart:
            manifest = None
        if manifest and manifest["shards"]:
            check_same_job(self.root, manifest["job"], identity)
        self.manifest = manifest or {"version": _VERSION, "job": identity, "shards": {}}
        self._write_manifest()

    def _read(self, path: str) -> dict[str, Any] | None:
        from pyarrow import fs

        if self.filesystem.get_file_info(path).type != fs.FileType.File:
            return None
        with self.filesystem.open_input_stream(path) as f:
            return orjson.loads(f.read())

    def _write_manifest(self) -> None:
        path = f"{self.root}/{MANIFEST}"
        with self.filesystem.open_output_stream(path + ".tmp") as f:
            f.write(orjson.dumps(self.manifest, option=orjson.OPT_INDENT_2))
        self.filesystem.move(path + ".tmp", path)  # a rename on local disks: never half-written

    def done(self, path: str) -> bool:
        return path in self.manifest["shards"]

    def open_shard(self, index: int, schema: Any) -> Any:
        import pyarrow.parquet as pq

        name = f"part-{index:05d}.parquet"
        writer = pq.ParquetWriter(f"{self.root}/{name}.tmp", schema, filesystem=self.filesystem)
        writer.shard_name = name
        return writer

    def commit(self, source_path: str, writer: Any, rows: int) -> None:
        writer.close()
        name = writer.shard_name
        self.filesystem.move(f"{self.root}/{name}.tmp", f"{self.root}/{name}")
        self.manifest["shards"][source_path] = {"file": name, "rows": rows}
        self._write_manifest()


    def commit_empty(self, source_path: str) -> None:
        self.manifest["shards"][source_path] = {"file": None, "rows": 0}
        self._write_manifest()


class _Stream(io.RawIOBase):
    """A pyarrow input file as a Python binary file, so that lines can be iterated."""

    def __init__(self, native: Any) -> None:
        self._native = native

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._native.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._native.close()
        super().close()


def read_files(batch: dict[str, Any], filesystem: Any, text_field: str, id_field: str | None,
               rows: int) -> Iterator[Any]:
    """A Ray task: the files named in ``batch`` as tables of ``path``, ``id``, ``text``.

    The same reader as in-process, so ids, skipped blank lines and errors are the same.
    """
    import pyarrow as pa

    for path in (str(p) for p in batch["path"]):
        def opener(path: str = path) -> Any:
            native = filesystem.open_input_file(path)  # Parquet reads it as it is
            return native if input_kind_of(path) == PARQUET else io.BufferedReader(
                _Stream(native), 1 << 20)

        records = read_records(PurePosixPath(path), text_field, id_field, opener=opener)
        while chunk := [record for record, _ in itertools.islice(records, rows)]:
            ids = pa.array([r.id for r in chunk])
            yield pa.table({"path": pa.array([path] * len(chunk), pa.string()), "id": ids,
                            "text": pa.array([r.text for r in chunk], pa.string())})


class EmbedActor:
    """One model replica: a table of ``path``, ``id``, ``text`` in; ``id``, ``embedding``,
    ``path`` out."""

    def __init__(self, settings: Settings) -> None:
        from .embedders import LocalEmbedder

        self.embedder = LocalEmbedder(settings)

    def __call__(self, batch: Any) -> Any:
        from .parts import vectors_table

        rows, _ = self.embedder(batch.column("text").to_pylist())
        table = vectors_table(batch.column("id"), rows)
        return table.append_column("path", batch.column("path"))


def embed_dataset(
    source: str,
    target: str,
    settings: Settings | None = None,
    *,
    address: str | None = None,
    actors: int | None = None,
    actor_cpus: float | None = None,
    text_field: str = "text",
    id_field: str | None = None,
    chunk_size: int = 256,
    restart: bool = False,
) -> Summary:
    """Embed a dataset into a directory of Parquet shards on Ray; continue an unfinished run.

    Connects to ``address`` (or ``RAY_ADDRESS``, or starts a local Ray) unless this process
    is already connected.

    Example::

        embed_dataset("s3://bucket/docs/*.parquet", "s3://bucket/vectors", actors=4)
    """
    from .embedders import local_identity

    settings = settings or Settings()
    dataset = list_dataset(source)
    identity = {
        "inputs": {i.path: f"{i.size} bytes, mtime_ns {i.mtime_ns}" for i in dataset.files},
        "model": local_identity(settings),
        "fields": {"text": text_field, "id": id_field},
    }
    if dataset.kind == PARQUET:  # the columns named exist, checked before Ray starts
        first = dataset.files[0].path
        table_id_column(PurePosixPath(first), text_field, id_field,
                        lambda: dataset.filesystem.open_input_file(first))
    shards = ShardDirectory(target, identity, restart)
    resumed = sum(s["rows"] for s in shards.manifest["shards"].values())
    pending = [(n, i) for n, i in enumerate(dataset.files) if not shards.done(i.path)]
    started, rows = time.monotonic(), 0
    if pending:
        import ray

        owned = not ray.is_initialized()
        if owned:
            local = not (address or os.environ.get("RAY_ADDRESS"))
            ray.init(address=address or None, logging_level="warning",
                     **({"include_dashboard": False} if local else {}))
        try:
            rows = _embed_files(dataset, pending, shards, settings, actors, actor_cpus,
                                text_field, id_field, chunk_size)
        finally:
            if owned:
                ray.shutdown()
    return Summary(rows, None, time.monotonic() - started, resumed)


def _embed_files(dataset: Dataset, pending: list[tuple[int, Any]], shards: ShardDirectory,
                 settings: Settings, actors: int | None, actor_cpus: float | None,
                 text_field: str, id_field: str | None, chunk_size: int) -> int:
    import ray
    import ray.data

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    resources, actors = _actor_resources(settings, actors, actor_cpus)
    # One block per file, read by a light task (a fraction of a CPU: actors holding every CPU
    # must not starve the reads that feed them); the pool spreads the files over its actors.
    files = ray.data.from_items([{"path": i.path} for _, i in pending],
                                override_num_blocks=len(pending))
    ds = files.map_batches(
        read_files, batch_size=1, num_cpus=_READ_CPUS,
        fn_kwargs={"filesystem": dataset.filesystem, "text_field": text_field,
                   "id_field": id_field, "rows": chunk_size})
    ds = ds.map_batches(EmbedActor, fn_constructor_kwargs={"settings": settings},
                        batch_size=chunk_size, batch_format="pyarrow",
                        compute=ray.data.ActorPoolStrategy(size=actors), **resources)
    stream = _ShardStream(shards, {info.path: n for n, info in pending})
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            stream.write(batch)
    except ray.exceptions.RayError as exc:
        raise BulkError(_cause(exc)) from None
    return stream.close()


def _actor_resources(settings: Settings, actors: int | None, actor_cpus: float | None
                     ) -> tuple[dict[str, float], int]:
    """One actor per GPU, or ``actors`` of ``actor_cpus`` CPUs, leaving a CPU for reading."""
    import ray

    cluster = ray.cluster_resources()
    gpus = int(cluster.get("GPU", 0)) if settings.device != "cpu" else 0
    if gpus:
        return {"num_gpus": 1, "num_cpus": actor_cpus or 1.0}, actors or gpus
    actors, cpus = actors or 1, actor_cpus or 1.0
    total = cluster.get("CPU", 0)
    if actors * cpus > total - _READ_CPUS:  # else the reads that feed them never start
        raise UsageError(f"{actors} actors of {cpus:g} CPUs leave no CPU for reading on a "
                         f"cluster of {total:g} CPUs: lower --actors or --actor-cpus")
    return {"num_cpus": cpus}, actors


def _cause(exc: BaseException) -> str:
    """The message of the error an actor raised, without Ray's wrapping."""
    seen = exc
    while getattr(seen, "cause", None) is not None or seen.__cause__ is not None:
        seen = getattr(seen, "cause", None) or seen.__cause__
        if isinstance(seen, BulkError):
            return str(seen)
    return str(exc).strip().splitlines()[-1]


class _ShardStream:
    """Rows arriving in order, file after file, written to one shard per input file."""

    def __init__(self, shards: ShardDirectory, index_of: dict[str, int]) -> None:
        self.shards, self.index_of = shards, index_of
        self.current: str | None = None
        self.writer: Any = None
        self.rows = self.total = 0
        self.finished: set[str] = set()

    def write(self, batch: Any) -> None:
        paths = batch.column("path").to_pylist()
        start = 0
        for end in range(1, len(paths) + 1):
            if end == len(paths) or paths[end] != paths[start]:
                self._write_run(paths[start], batch.slice(start, end - start))
                start = end

    def _write_run(self, path: str, part: Any) -> None:
        if path != self.current:
            self._finish_current()
            if path in self.finished or path not in self.index_of:
                raise BulkError(f"rows of {path} arrived out of order; rerun to continue")
            self.current, self.rows = path, 0
        table = self._with_ids(part)
        if self.writer is None:
            self.writer = self.shards.open_shard(self.index_of[path], table.schema)
        elif table.schema != self.writer.schema:
            from .parts import cast_like

            table = cast_like(table, self.writer.schema)
        self.writer.write_table(table)
        self.rows += part.num_rows

    @staticmethod
    def _with_ids(part: Any) -> Any:
        import pyarrow as pa

        return pa.table({"id": part.column("id"), "embedding": part.column("embedding")})

    def _finish_current(self) -> None:
        if self.current is not None:
            self.shards.commit(self.current, self.writer, self.rows)
            self.finished.add(self.current)
            self.total += self.rows
            self.current, self.writer = None, None

    def close(self) -> int:
        """Finish the last shard; files that gave no rows are done too, with no shard."""
        self._finish_current()
        for path in self.index_of.keys() - self.finished:
            self.shards.commit_empty(path)
        return self.total


def run_on_ray(args: Any, settings: Settings) -> Summary:
    """``embedsvc embed ... --ray [ADDRESS]`` with parsed arguments."""
    try:
        import ray.data  # noqa: F401 - only to say how to install it
    except ImportError:
        raise UsageError("--ray needs Ray: pip install 'embedsvc[ray]'") from None
    return embed_dataset(args.input, args.output, settings, address=args.ray or None,
                         actors=args.actors, actor_cpus=args.actor_cpus,
                         text_field=args.text_field, id_field=args.id_field,
                         chunk_size=args.chunk_size, restart=args.restart)
