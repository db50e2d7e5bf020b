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
together and in order; it writes the shards as they arrive (shards.py), and its memory holds
a batch. Listing and reading the files: dataset.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import PurePosixPath
from typing import Any

from ..settings import Settings
from .dataset import Dataset, list_dataset, read_files
from .errors import BulkError, UsageError
from .interrupt import Interrupted, StopSignals
from .job import Summary
from .kinds import SPARSE_ON_RAY
from .options import BulkOptions
from .records import PARQUET, table_id_column
from .shards import ShardDirectory, ShardStream

_READ_CPUS = 0.25  # reading is light next to the model; see _embed_files


class EmbedActor:
    """One model replica: a table of ``path``, ``id``, ``text`` in; ``id``, ``embedding``,
    ``path`` out."""

    def __init__(self, settings: Settings) -> None:
        from .embedders import LocalEmbedder

        self.embedder = LocalEmbedder(_own_share(settings))
        if self.embedder.kind != "embedding":  # the driver refuses it first where it can tell
            raise BulkError(SPARSE_ON_RAY)

    def __call__(self, batch: Any) -> Any:
        from .parts import vectors_table

        rows, _ = self.embedder(batch.column("text").to_pylist())
        assert not isinstance(rows, list), "sparse rows: the driver refuses a sparse model"
        table = vectors_table(batch.column("id"), rows)
        return table.append_column("path", batch.column("path"))


def _own_share(settings: Settings) -> Settings:
    """``settings`` with ONNX Runtime's threads set to this actor's CPUs (unless
    ONNX_THREADS is set): an actor sees every core of its node, and actors that each took
    them all would share the cores several times over."""
    import ray

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
    if settings.onnx_threads or not cpus:
        return settings
    return replace(settings, onnx_threads=max(1, int(cpus)))


def embed_dataset(options: BulkOptions, settings: Settings | None = None,
                  stop: StopSignals | None = None) -> Summary:
    """Embed the dataset ``options.input`` into a directory of Parquet shards on Ray
    (``options.output``); continue an unfinished run.

    Connects to ``options.ray`` (or ``RAY_ADDRESS``, or starts a local Ray) unless this
    process is already connected. Interrupted (by a signal that ``stop`` caught), it keeps
    the shards finished (the file being written is redone by the next run) and says so in
    ``Interrupted.saved``; a signal once every shard is in only sets ``stop.signum``.

    Example::

        embed_dataset(BulkOptions("s3://bucket/docs/*.parquet", "s3://bucket/vectors",
                                  ray="", actors=4))
    """
    settings, stop = settings or Settings(), stop or StopSignals()
    with stop.interruptible():  # nothing is computed before the work starts on Ray
        dataset, shards = _open(options, settings)
    resumed = sum(s["rows"] for s in shards.manifest["shards"].values())
    pending = [(n, i) for n, i in enumerate(dataset.files) if not shards.done(i.path)]
    started, rows = time.monotonic(), 0
    try:
        with stop.interruptible():
            if pending:
                rows = _on_ray(options, lambda: _embed_files(dataset, pending, shards,
                                                             settings, options))
    except Interrupted as exc:
        done = shards.manifest["shards"]
        exc.saved = (f"{len(done)} of {len(dataset.files)} files ("
                     f"{sum(s['rows'] for s in done.values())} inputs) saved in "
                     f"{options.output}; a file's shard is kept once all its rows are in")
        raise
    return Summary(rows, None, time.monotonic() - started, resumed)


def _open(options: BulkOptions, settings: Settings) -> tuple[Dataset, ShardDirectory]:
    """The dataset's files, and its shard directory (checked against the job's identity)."""
    from .embedders import local_identity

    dataset = list_dataset(options.input)
    identity = {
        "inputs": {i.path: f"{i.size} bytes, mtime_ns {i.mtime_ns}" for i in dataset.files},
        "model": local_identity(settings),
        "fields": {"text": options.text_field, "id": options.id_field},
    }
    if dataset.kind == PARQUET:  # the columns named exist, checked before Ray starts
        first = dataset.files[0].path
        table_id_column(PurePosixPath(first), options.text_field, options.id_field,
                        lambda: dataset.filesystem.open_input_file(first))
    return dataset, ShardDirectory(options.output, identity, options.restart)


def _on_ray(options: BulkOptions, work: Callable[[], int]) -> int:
    """``work()`` on the Ray this process is connected to, or on one it connects to (or
    starts) for the job and shuts down after."""
    import ray

    if ray.is_initialized():
        return work()
    address = options.ray or None
    local = not (address or os.environ.get("RAY_ADDRESS"))
    # A local Ray listens on loopback only, as embedsvc serve does by default.
    ray.init(address=address, logging_level="warning",
             **({"include_dashboard": False, "_node_ip_address": "127.0.0.1"} if local else {}))
    try:
        return work()
    finally:
        ray.shutdown()


def _embed_files(dataset: Dataset, pending: list[tuple[int, Any]], shards: ShardDirectory,
                 settings: Settings, options: BulkOptions) -> int:
    import ray
    import ray.data

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    resources, actors = _actor_resources(settings, options.actors, options.actor_cpus)
    text_field, id_field, chunk_size = options.text_field, options.id_field, options.chunk_size
    # One block per file, read by a light task (a fraction of a CPU: actors holding every CPU
    # must not starve the reads that feed them); the pool spreads the files over its actors.
    files = ray.data.from_items([{"path": i.path} for _, i in pending],
                                override_num_blocks=len(pending))
    ds = files.map_batches(
        read_files, batch_size=1, num_cpus=_READ_CPUS,
        fn_kwargs={"filesystem": dataset.filesystem, "text_field": text_field,
                   "id_field": id_field, "rows": chunk_size,
                   "max_chars": settings.max_input_chars})
    ds = ds.map_batches(EmbedActor, fn_constructor_kwargs={"settings": settings},
                        batch_size=chunk_size, batch_format="pyarrow",
                        compute=ray.data.ActorPoolStrategy(size=actors), **resources)
    stream = ShardStream(shards, {info.path: n for n, info in pending})
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
    seen: BaseException | None = exc
    while seen is not None:
        seen = getattr(seen, "cause", None) or seen.__cause__
        if isinstance(seen, BulkError):
            return str(seen)
    return str(exc).strip().splitlines()[-1]


def run_on_ray(options: BulkOptions, settings: Settings, stop: StopSignals) -> Summary:
    """``embedsvc embed ... --ray [ADDRESS]``."""
    try:
        import ray.data  # noqa: F401 - only to say how to install it
    except ImportError:
        raise UsageError("--ray needs Ray: pip install 'embedsvc[ray]'") from None
    return embed_dataset(options, settings, stop)
