"""The output of a Ray job: a directory of Parquet shards, one per input file, and the
manifest that lists the finished ones.

Each shard is written aside (``part-00000.parquet.tmp``) and moved into place once its file's
last row is in, then listed in ``manifest.json`` (itself written aside and moved): a rerun
skips the files listed and rewrites any other shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from .checkpoint import MANIFEST, check_same_job
from .dataset import resolve
from .errors import BulkError
from .parts import cast_like

_VERSION = 1


class ShardDirectory:
    """The output directory: its shards and the manifest that lists them."""

    def __init__(self, target: str, identity: dict[str, Any], restart: bool) -> None:
        self.filesystem, self.root = resolve(target)
        self.filesystem.create_dir(self.root, recursive=True)
        manifest = self._read(f"{self.root}/{MANIFEST}")
        if manifest and restart:
            manifest = None
        if manifest and manifest["shards"]:
            check_same_job(Path(self.root), manifest["job"], identity)
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

    def open_shard(self, name: str, schema: Any) -> Any:
        """A Parquet writer on ``name`` written aside; ``commit`` moves it into place."""
        import pyarrow.parquet as pq

        return pq.ParquetWriter(f"{self.root}/{name}.tmp", schema, filesystem=self.filesystem)

    def commit(self, source_path: str, name: str, writer: Any, rows: int) -> None:
        writer.close()
        self.filesystem.move(f"{self.root}/{name}.tmp", f"{self.root}/{name}")
        self.manifest["shards"][source_path] = {"file": name, "rows": rows}
        self._write_manifest()

    def commit_empty(self, source_path: str) -> None:
        self.manifest["shards"][source_path] = {"file": None, "rows": 0}
        self._write_manifest()


class ShardStream:
    """Rows arriving in order, file after file, written to one shard per input file."""

    def __init__(self, shards: ShardDirectory, index_of: dict[str, int]) -> None:
        self.shards, self.index_of = shards, index_of
        self.current: str | None = None
        self.writer: Any = None
        self.name = ""
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
            self.name = f"part-{self.index_of[path]:05d}.parquet"
            self.writer = self.shards.open_shard(self.name, table.schema)
        elif table.schema != self.writer.schema:
            table = cast_like(table, self.writer.schema)
        self.writer.write_table(table)
        self.rows += part.num_rows

    @staticmethod
    def _with_ids(part: Any) -> Any:
        import pyarrow as pa

        return pa.table({"id": part.column("id"), "embedding": part.column("embedding")})

    def _finish_current(self) -> None:
        if self.current is not None:
            self.shards.commit(self.current, self.name, self.writer, self.rows)
            self.finished.add(self.current)
            self.total += self.rows
            self.current, self.writer = None, None

    def close(self) -> int:
        """Finish the last shard; files that gave no rows are done too, with no shard."""
        self._finish_current()
        for path in self.index_of.keys() - self.finished:
            self.shards.commit_empty(path)
        return self.total
