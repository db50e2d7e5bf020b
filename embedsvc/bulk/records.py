"""The inputs of a bulk job, streamed, each with the position just after it.

Kinds, by suffix: text (one input per line; the id is the line number), JSONL (``.jsonl``,
``.ndjson``; the text in ``text_field``, the id in ``id_field`` or the line number), Parquet
(``.parquet``) and Arrow IPC (``.arrow``, ``.feather``), read a record batch at a time; their
id is the ``id_field`` column or the row number (from 1). Blank lines are skipped; an empty
text in a JSONL row or a table is an error that names the row.

Images (``read_images``): a folder's image files (``image_files``: by suffix, sorted, its
subfolders too; the id is the path relative to the folder), or a JSONL, Parquet or Arrow
column of image paths (``--image-field``), read as a text column is; each record's text is
then the path of its image file, which the embedder reads.

A ``Position`` is where to start again: the inputs before it, and for line files the line
number and byte offset, so that a resumed job seeks instead of rereading.

Memory follows the chunk size, not the longest row: an input longer than ``max_chars``
(MAX_INPUT_CHARS, which the engine refuses anyway) is refused before it is held whole. A
line is read at most ``_line_limit`` bytes at a time (a UTF-8 character is at most 4 bytes;
a JSONL row holds its text in JSON's longest escapes and up to 1 MiB of other fields); a
table is decoded a few rows at a time (``_BATCH_BYTES``, measured on each row group's first
rows, since a dictionary-encoded page of 2 KB can hold 2 MB cells) and a cell longer than
the limit is refused before it becomes a Python string.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import IO, Any

import orjson

from ..rules import too_long
from ..settings import Settings
from .errors import BulkError, UsageError

TEXT, JSONL, PARQUET, ARROW = "text", "jsonl", "parquet", "arrow"
_KINDS = {".jsonl": JSONL, ".ndjson": JSONL, ".parquet": PARQUET, ".arrow": ARROW,
          ".feather": ARROW}
TABLES = {PARQUET, ARROW}
_BATCH_ROWS = 1024  # rows decoded at once from a table, at most...
_BATCH_BYTES = 64 << 20  # ...and about this much of them
_PROBE_ROWS = 8  # a row group's first rows, decoded to measure its rows
DEFAULT_ID_FIELD = "id"
DEFAULT_MAX_CHARS = Settings.max_input_chars
_UTF8_BYTES = 4  # the most bytes a character takes in UTF-8...
_JSON_BYTES = 12  # ...and in JSON (an astral character as two \uXXXX escapes)
_JSONL_OTHER_BYTES = 1 << 20  # what a JSONL row may hold beside its text
_COUNT_BLOCK = 1 << 20
TEXT_FLAG, IMAGE_FLAG = "--text-field", "--image-field"  # the flag that names the field read
_FIELD_NOUN = {TEXT_FLAG: "text", IMAGE_FLAG: "image path"}
# The suffixes of image/decode.py's formats (PNG, JPEG, WebP, GIF, BMP): a folder's images.
IMAGE_SUFFIXES = (".bmp", ".gif", ".jpeg", ".jpg", ".png", ".webp")


@dataclass(frozen=True)
class Record:
    id: Any
    text: str  # the input; in an image job, the path of its image file


@dataclass(frozen=True)
class Position:
    records: int = 0  # inputs before this point
    line: int = 0  # lines before it (line files)
    offset: int = 0  # bytes before it (line files)


Opener = Callable[[], IO[bytes]]  # opens the file: how a Ray task reads from any filesystem


def input_kind(path: PurePath) -> str:
    return _KINDS.get(path.suffix.lower(), TEXT)


def read_records(path: PurePath, text_field: str = "text", id_field: str | None = None,
                 start: Position = Position(), opener: Opener | None = None,
                 max_chars: int = DEFAULT_MAX_CHARS, flag: str = TEXT_FLAG
                 ) -> Iterator[tuple[Record, Position]]:
    """The inputs of ``path`` from ``start`` on, in order, each with the position after it.

    ``id_field=None`` means ``"id"`` where the row has one, else the line or row number.
    ``opener`` opens the file where it is not a local path (Parquet and line files). An input
    certainly longer than ``max_chars`` characters is a ``BulkError`` before it is held.
    ``flag``: the option that names ``text_field``, as messages say.
    """
    kind = input_kind(path)
    opener = opener or (lambda: open(path, "rb"))  # noqa: SIM115 - the caller closes it
    if kind in TABLES:
        return _table_records(path, kind, text_field, id_field, start, opener, max_chars, flag)
    return _line_records(path, kind == JSONL, text_field, id_field, start, opener, max_chars,
                         flag)


def read_images(source: Path, image_field: str | None, id_field: str | None = None,
                start: Position = Position(), max_chars: int = DEFAULT_MAX_CHARS
                ) -> Iterator[tuple[Record, Position]]:
    """An image job's inputs from ``start`` on, each record's text the path of its image
    file: ``source``'s image files where it is a folder (``image_files``; the id is the path
    relative to it), else the ``image_field`` of the JSONL, Parquet or Arrow file
    ``source``, a relative path taken from that file's folder (an empty one stays empty:
    the embedder refuses it, naming the record)."""
    if image_field is None:
        names = image_files(source)
        for row, name in enumerate(names[start.records:], start.records + 1):
            yield Record(name, str(source / name)), Position(row)
        return
    base = source.parent
    for record, position in read_records(source, image_field, id_field, start,
                                         max_chars=max_chars, flag=IMAGE_FLAG):
        yield Record(record.id, str(base / record.text) if record.text else ""), position


def image_files(folder: Path) -> list[str]:
    """The image files in ``folder`` and its subfolders, as POSIX paths relative to it,
    sorted: the names ending in one of ``IMAGE_SUFFIXES`` (in any case). A name that starts
    with "." is skipped, file or folder (hidden; macOS's "._" files beside copied images hold
    metadata, not images), and a symbolic link to a folder is not followed."""
    found: list[str] = []

    def refuse(exc: OSError) -> None:
        raise UsageError(f"cannot list the folder {exc.filename!r} ({exc.strerror}): the job "
                         "would miss its images")

    for root, folders, files in os.walk(folder, onerror=refuse):
        folders[:] = [f for f in folders if not f.startswith(".")]
        where = Path(root).relative_to(folder)
        found.extend((where / f).as_posix() for f in files
                     if not f.startswith(".") and Path(f).suffix.lower() in IMAGE_SUFFIXES)
    return sorted(found)


def count_images(source: Path) -> int:
    """How many inputs an image job over ``source`` (a folder, or a table) holds."""
    return len(image_files(source)) if source.is_dir() else count_records(source)


def _line_records(path: PurePath, jsonl: bool, text_field: str, id_field: str | None,
                  start: Position, opener: Opener, max_chars: int, flag: str
                  ) -> Iterator[tuple[Record, Position]]:
    records, line, offset = start.records, start.line, start.offset
    limit = _line_limit(jsonl, max_chars)
    with opener() as f:
        if offset:
            f.seek(offset)
        while raw := f.readline(limit + 1):  # a line and its end, or a line too long
            line, offset = line + 1, offset + len(raw)
            if len(raw) > limit and not raw.endswith(b"\n"):
                raise _line_too_long(path, line, jsonl, limit, max_chars)
            if not raw.strip():
                continue
            records += 1
            yield _parse_line(path, line, raw, jsonl, text_field, id_field, flag), Position(
                records, line, offset)


def _line_limit(jsonl: bool, max_chars: int) -> int:
    """The most bytes of a line that can hold an input of ``max_chars`` characters."""
    return _JSON_BYTES * max_chars + _JSONL_OTHER_BYTES if jsonl else _UTF8_BYTES * max_chars


def _line_too_long(path: PurePath, line: int, jsonl: bool, limit: int, max_chars: int
                   ) -> BulkError:
    if not jsonl:
        return BulkError(f"{path}: record {line}: the input {too_long(0, None, max_chars).detail}")
    return BulkError(f"{path}:{line}: the row is longer than {limit} bytes, more than its text "
                     f"(at most MAX_INPUT_CHARS, {max_chars} characters) and 1 MiB of other "
                     "fields need: leave out the fields the job does not read (for example "
                     "with jq -c '{id, text}')")


def _parse_line(path: PurePath, line: int, raw: bytes, jsonl: bool, text_field: str,
                id_field: str | None, flag: str = TEXT_FLAG) -> Record:
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
                        f"name the {_FIELD_NOUN[flag]} field with {flag}") from None
    if not isinstance(text, str):  # an empty one is the engine's to refuse, as over HTTP
        raise BulkError(f"{path}:{line}: {text_field!r} must be a string")
    if id_field is not None and id_field not in row:  # named: never the line number instead
        raise BulkError(f"{path}:{line}: no {id_field!r} field, which --id-field names (without "
                        "it, the id is the 'id' field where there is one, else the line number)")
    key = id_field or DEFAULT_ID_FIELD
    record_id = row.get(key, line)
    if isinstance(record_id, float):  # orjson reads integers beyond 64 bits as floats
        record_id = json.loads(raw).get(key)
    return Record(record_id, text)


def _table_records(path: PurePath, kind: str, text_field: str, id_field: str | None,
                   start: Position, opener: Opener, max_chars: int, flag: str
                   ) -> Iterator[tuple[Record, Position]]:
    id_column = table_id_column(path, text_field, id_field, opener, flag)
    row = start.records
    columns = [text_field, *filter(None, [id_column])]
    for first, batch in _batches(path, kind, columns, row, opener):
        _refuse_long_cells(path, batch.column(text_field), first, text_field, max_chars)
        try:
            texts = batch.column(text_field).to_pylist()
        except UnicodeDecodeError:  # a string column whose bytes another writer did not check
            raise BulkError(f"{path}: a row of {text_field!r} from row {first + 1} on, in a "
                            f"batch of {batch.num_rows}, is not UTF-8 text") from None
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
        batches = (b for g in groups for b in _row_group_batches(source, g, columns))
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
        for start in range(0, batch.num_rows, _BATCH_ROWS):
            if before + start + _BATCH_ROWS > skip:
                yield before + start, batch.slice(start, _BATCH_ROWS).select(columns)
        before += batch.num_rows


def _row_group_batches(source: Any, group: int, columns: list[str]) -> Iterator[Any]:
    """Row group ``group`` a few rows at a time: its first ``_PROBE_ROWS`` tell how large
    its rows are decoded, and the rest come in batches of about ``_BATCH_BYTES``."""
    probe = next(source.iter_batches(_PROBE_ROWS, row_groups=[group], columns=columns), None)
    if probe is None:
        return
    yield probe
    if probe.num_rows < _PROBE_ROWS:
        return
    per_row = max(1, _decoded_bytes(probe) // probe.num_rows)
    size = max(1, min(_BATCH_ROWS, _BATCH_BYTES // per_row))
    done = probe.num_rows  # decoded again below, then dropped
    for batch in source.iter_batches(size, row_groups=[group], columns=columns):
        if done < batch.num_rows:
            yield batch.slice(done)
        done = max(0, done - batch.num_rows)


def _decoded_bytes(batch: Any) -> int:
    """The bytes of ``batch`` with its dictionary columns decoded, as the rows are read."""
    import pyarrow as pa

    return sum(c.cast(c.type.value_type).nbytes if pa.types.is_dictionary(c.type) else c.nbytes
               for c in batch.columns)


def _refuse_long_cells(path: PurePath, column: Any, first: int, text_field: str,
                       max_chars: int) -> None:
    """A ``BulkError`` for the first cell whose bytes cannot be ``max_chars`` characters or
    fewer, before the column becomes Python strings."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = column.type
    if pa.types.is_dictionary(kind):
        lengths = pc.take(pc.binary_length(column.dictionary), column.indices)
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        lengths = pc.binary_length(column)
    else:
        return  # not text: the row's own check names it
    too_many = pc.greater(lengths, _UTF8_BYTES * max_chars)
    if pc.any(too_many).as_py():
        row = first + pc.index(too_many, True).as_py() + 1
        raise BulkError(f"{path}: row {row}: {text_field!r} "
                        f"{too_long(0, None, max_chars).detail}")


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


def check_table(path: PurePath, text_field: str, id_field: str | None,
                flag: str = TEXT_FLAG) -> None:
    """The columns named exist and, in Parquet, every page of them decodes: damage is found
    before any work starts, for the cost of one read (little next to embedding it)."""
    id_column = table_id_column(path, text_field, id_field, flag=flag)
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


def id_type(path: PurePath, text_field: str, id_field: str | None,
            opener: Opener | None = None) -> Any:
    """The Arrow type of a table input's id column, which its ids keep in a Parquet output
    (else each chunk's ids were typed by their values: a nullable column whose first rows
    were null, or unsigned ids large only later, changed type along the output); None where
    the ids are line or row numbers, or JSONL's values."""
    if input_kind(path) not in TABLES:
        return None
    column = table_id_column(path, text_field, id_field, opener)
    return table_schema(path, opener).field(column).type if column else None


def table_id_column(path: PurePath, text_field: str, id_field: str | None,
                    opener: Opener | None = None, flag: str = TEXT_FLAG) -> str | None:
    """The id column to read, after checking that the columns named exist."""
    names = table_schema(path, opener).names
    if text_field not in names:
        raise UsageError(f"{path} has no column {text_field!r} (it has {', '.join(names)}): "
                         f"name the {_FIELD_NOUN[flag]} column with {flag}")
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
    return _count_lines(path)


def _count_lines(path: PurePath) -> int:
    """The lines of ``path`` that are not blank, read a block at a time (a line can be
    longer than memory)."""
    count, content = 0, False  # content: the line read so far has a non-blank byte
    with open(path, "rb") as f:
        while block := f.read(_COUNT_BLOCK):
            *ended, rest = block.split(b"\n")
            for part in ended:
                count += content or _filled(part)
                content = False
            content = content or _filled(rest)
    return count + content


def _filled(part: bytes) -> bool:
    """``part`` holds more than whitespace (as ``part.strip()`` would, without a copy)."""
    return bool(part) and not part.isspace()
