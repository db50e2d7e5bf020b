"""A dataset on any filesystem pyarrow reads: its files, and a Ray task that reads them.

A source is a file, a directory (all its Parquet or JSONL files, recursively) or a glob, as a
local path or a URI (``s3://``, ``gs://``, ``hdfs://``...). Files are read by the same reader
as in-process jobs, so ids, skipped blank lines and error messages are the same.
"""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from .errors import UsageError
from .records import JSONL, PARQUET, id_type, input_kind, read_records

_GLOB = set("*?[")


@dataclass(frozen=True)
class Dataset:
    filesystem: Any  # pyarrow.fs.FileSystem
    kind: str  # PARQUET or JSONL
    files: list[Any]  # pyarrow.fs.FileInfo, sorted by path


def resolve(uri: str) -> tuple[Any, str]:
    """The filesystem of a local path or URI, and the path on it (no trailing slash)."""
    from pyarrow import fs

    if "://" in uri:
        filesystem, path = fs.FileSystem.from_uri(uri)
        return filesystem, path.rstrip("/") or path
    return fs.LocalFileSystem(), os.path.abspath(uri)


def list_dataset(source: str) -> Dataset:
    """The Parquet or JSONL files of ``source`` (a file, a directory or a glob)."""
    from pyarrow import fs

    filesystem, path = resolve(source)
    if _GLOB & set(path):
        base = path[: min(path.index(c) for c in _GLOB if c in path)].rsplit("/", 1)[0]
        infos = filesystem.get_file_info(fs.FileSelector(base, recursive=True))
        # as a shell glob: a wildcard matches within one directory level, never across "/"
        infos = [i for i in infos if PurePosixPath(i.path).match(path)]
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
               rows: int, max_chars: int) -> Iterator[Any]:
    """A Ray task: the files named in ``batch`` as tables of ``path``, ``id``, ``text``.

    The same reader as in-process, so ids, skipped blank lines and errors are the same.
    """
    import pyarrow as pa

    for path in (str(p) for p in batch["path"]):
        def opener(path: str = path) -> Any:
            native = filesystem.open_input_file(path)  # Parquet reads it as it is
            return native if input_kind_of(path) == PARQUET else io.BufferedReader(
                _Stream(native), 1 << 20)

        records = read_records(PurePosixPath(path), text_field, id_field, opener=opener,
                               max_chars=max_chars)
        typed = id_type(PurePosixPath(path), text_field, id_field, opener)  # as without Ray
        while chunk := [record for record, _ in itertools.islice(records, rows)]:
            ids = pa.array([r.id for r in chunk], typed)
            yield pa.table({"path": pa.array([path] * len(chunk), pa.string()), "id": ids,
                            "text": pa.array([r.text for r in chunk], pa.string())})
