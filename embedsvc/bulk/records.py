"""The inputs of a bulk job, streamed, each with the position just after it.

Kinds, by suffix: text (one input per line; the id is the line number), JSONL (``.jsonl``,
``.ndjson``; the text in ``text_field``, the id in ``id_field`` or the line number), Parquet
(``.parquet``) and Arrow IPC (``.arrow``, ``.feather``), read a record batch at a time; their
id is the ``id_field`` column or the row number (from 1). Blank lines are skipped; an empty
text in a JSONL row or a table is an error that names the row.

A ``Position`` is where to start again: the inputs before it, and for line files the line
number and byte offset, so that a resumed job seeks instead of rereading.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import PurePath
from typing import IO, Any

import orjson

from .errors import BulkError, UsageError

TEXT, JSONL, PARQUET, ARROW = "text", "jsonl", "parquet", "arrow"
_KINDS = {".jsonl": JSONL, ".ndjson": JSONL, ".parquet": PARQUET, ".arrow": ARROW,
          ".feather": ARROW}
TABLES = {PARQUET, ARROW}
_BATCH_ROWS = 1024  # rows decoded at once from a table: memory stays flat
DEFAULT_ID_FIELD = "id"


@dataclass(frozen=True)
class Record:
    id: Any
    text: str


@dataclass(frozen=True)
class Position:
    records: int = 0  # inputs before this point
    line: int = 0  # lines before it (line files)
    offset: int = 0  # bytes before it (line files)


Opener = Callable[[], IO[bytes]]  # opens the file: how a Ray task reads from any filesystem


def input_kind(path: PurePath) -> str:
    return _KINDS.get(path.suffix.lower(), TEXT)


def read_records(path: PurePath, text_field: str = "text", id_field: str | None = None,
                 start: Position = Position(), opener: Opener | None = None
                 ) -> Iterator[tuple[Record, Position]]:
    """The inputs of ``path`` from ``start`` on, in order, each with the position after it.

    ``id_field=None`` means ``"id"`` where the row has one, else the line or row number.
    ``opener`` opens the file where it is not a local path (Parquet and line files).
    """
    kind = input_kind(path)
    opener = opener or (lambda: open(path, "rb"))  # noqa: SIM115 - the caller closes it
    if kind in TABLES:
        return _table_records(path, kind, text_field, id_field, start, opener)
    return _line_records(path, kind == JSONL, text_field, id_field, start, opener)


def _line_records(path: PurePath, jsonl: bool, text_field: str, id_field: str | None,
                  start: Position, opener: Opener) -> Iterator[tuple[Record, Position]]:
    records, line, offset = start.records, start.line, start.offset
    with opener() as f:
        if offset:
            f.seek(offset)
        for raw in f:
            line, offset = line + 1, offset + len(raw)
            if not raw.strip():
                continue
            records += 1
            yield _parse_line(path, line, raw, jsonl, text_field, id_field), Position(
                records, line, offset)


def _parse_line(path: PurePath, line: int, raw: bytes, jsonl: bool, text_field: str,
                id_field: str | None) -> Record:
    if not jsonl:
        try:
            return Record(line, raw.decode("utf-8").rstrip("\r\n"))
        except UnicodeDecodeError:
            raise BulkError(f"{path}:{line}: not UTF-8 text") from None
    try:
        row = orjson.loads(raw)
        text = row[text_field]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise BulkError(f"{path}:{line}: not a JSON object with a string {text_field!r} field; "
                        "name the text field with --text-field") from None
    if not isinstance(text, str):  # an empty one is the engine's to refuse, as over HTTP
        raise BulkError(f"{path}:{line}: {text_field!r} must be a string")
    key = id_field or DEFAULT_ID_FIELD
    record_id = row.get(key, line)
    if isinstance(record_id, float):  # orjson reads integers beyond 64 bits as floats
        record_id = json.loads(raw).get(key)
    return Record(record_id, text)


def _table_records(path: PurePath, kind: str, text_field: str, id_field: str | None,
                   start: Position, opener: Opener) -> Iterator[tuple[Record, Position]]:
    id_column = table_id_column(path, text_field, id_field, opener)
    row = start.records
    columns = [text_field, *filter(None, [id_column])]
    for first, batch in _batches(path, kind, columns, row, opener):
        texts = batch.column(text_field).to_pylist()
        ids = batch.column(id_column).to_pylist() if id_column else None
        for i in range(row - first, len(texts)):
            row += 1
            text = texts[i]
            if not isinstance(text, str):
                raise BulkError(f"{path}: row {row}: {text_field!r} must be a string")
            yield Record(ids[i] if ids else row, text), Position(row)


def _batches(path: PurePath, kind: str, columns: list[str], skip: int, opener: Opener
             ) -> Iterator[tuple[int, Any]]:
    """Record batches holding rows ``skip`` on, each with the number of rows before it."""
    if kind == PARQUET:
        import pyarrow as pa

        source = _parquet_file(path, opener())
        groups: list[int] = []
        before = 0
        for g in range(source.num_row_groups):
            rows = source.metadata.row_group(g).num_rows
            if before + rows <= skip and not groups:
                before += rows  # whole row groups already done are never decoded
                continue
            groups.append(g)
        batches = source.iter_batches(_BATCH_ROWS, row_groups=groups, columns=columns)
        while True:
            try:
                batch = next(batches, None)
            except (OSError, pa.ArrowException) as exc:  # a page that does not decode
                raise BulkError(f"{path}: damaged Parquet data, which does not decode past "
                                f"its first {before} rows ({exc}): write the file again"
                                ) from None
            if batch is None:
                return
            yield before, batch
            before += batch.num_rows
    reader = _open_arrow(path)
    before = 0
    for b in range(reader.num_record_batches):
        batch = reader.get_batch(b)  # memory-mapped: skipping a batch costs nothing
        if before + batch.num_rows > skip:
            yield before, batch.select(columns)
        before += batch.num_rows


def _open_arrow(path: PurePath) -> Any:
    import pyarrow as pa

    try:
        return pa.ipc.open_file(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        raise UsageError(f"{path}: not an Arrow IPC file (the random-access format that "
                         "pyarrow.ipc.new_file or feather.write_feather writes)") from None


def _parquet_file(path: PurePath, source: Any) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(source)
    except pa.ArrowInvalid as exc:  # no footer: cut short, or not Parquet at all
        raise UsageError(f"{path}: not a whole Parquet file ({exc}): it may be truncated; "
                         "write it again, or name the right file") from None


def table_schema(path: PurePath, opener: Opener | None = None) -> Any:
    """The schema of a Parquet or Arrow file, read without its rows."""
    if input_kind(path) == PARQUET:
        return _parquet_file(path, opener() if opener else path).schema_arrow
    return _open_arrow(path).schema


def check_table(path: PurePath, text_field: str, id_field: str | None) -> None:
    """The columns named exist and, in Parquet, every page of them decodes: damage is found
    before any work starts, for the cost of one read (little next to embedding it)."""
    id_column = table_id_column(path, text_field, id_field)
    if input_kind(path) != PARQUET:
        return  # Arrow IPC: memory-mapped, its buffers are checked as they are read
    columns = [text_field, *filter(None, [id_column])]
    try:
        with open(path, "rb") as f:
            for _ in _batches(path, PARQUET, columns, 0, lambda: f):
                pass
    except UsageError:
        raise
    except BulkError as exc:
        raise UsageError(str(exc)) from None


def table_id_column(path: PurePath, text_field: str, id_field: str | None,
                    opener: Opener | None = None) -> str | None:
    """The id column to read, after checking that the columns named exist."""
    names = table_schema(path, opener).names
    if text_field not in names:
        raise UsageError(f"{path} has no column {text_field!r} (it has {', '.join(names)}): "
                         "name the text column with --text-field")
    if id_field and id_field not in names:
        raise UsageError(f"{path} has no column {id_field!r} (it has {', '.join(names)}): "
                         "name the id column with --id-field, or leave it out to use row numbers")
    if id_field is None and DEFAULT_ID_FIELD in names:
        return DEFAULT_ID_FIELD
    return id_field


def count_records(path: PurePath) -> int:
    """How many inputs ``path`` holds (for the progress bar); cheap for tables."""
    kind = input_kind(path)
    if kind == PARQUET:
        return _parquet_file(path, path).metadata.num_rows
    if kind == ARROW:
        reader = _open_arrow(path)
        return sum(reader.get_batch(b).num_rows for b in range(reader.num_record_batches))
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())
