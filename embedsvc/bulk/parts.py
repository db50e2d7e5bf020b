"""Output in pieces: each part is written to a temporary name, then renamed into place whole,
so a part that exists is complete; ``assemble`` joins the parts into the final file.

Formats, by the output's suffix: ``.npy`` (float32 rows in input order; a part holds raw
little-endian float32 rows), JSONL (``{"id", "embedding"}`` per line; a sparse model's rows,
lists of ``{"index", "value"}``, as ``{"id", "sparse"}``) and Parquet (an ``id`` column and an
``embedding`` column of ``fixed_size_list<float32>``). Quantized rows (``--output-dtype``) keep
their integer type: int8 or uint8 in the ``.npy`` file, its parts and the Parquet column.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson

from .errors import BulkError
from .records import Record

NPY, JSONL, PARQUET = ".npy", ".jsonl", ".parquet"
OUTPUTS = {".npy": NPY, ".jsonl": JSONL, ".ndjson": JSONL, ".parquet": PARQUET}
PART_SUFFIX = {NPY: ".f32", JSONL: ".jsonl", PARQUET: ".parquet"}


def output_kind(path: Path) -> str | None:
    return OUTPUTS.get(path.suffix.lower())


def vectors_table(ids: Sequence[Any], rows: np.ndarray, id_type: Any = None) -> Any:
    """An Arrow table of ``id`` (of ``id_type``, else typed by the values) and ``embedding``
    (fixed_size_list of the rows' type)."""
    import pyarrow as pa

    rows = np.ascontiguousarray(rows, dtype=row_type(rows))
    values = pa.array(rows.ravel(), pa.from_numpy_dtype(rows.dtype))
    if isinstance(ids, pa.Array | pa.ChunkedArray):
        id_column = ids
    elif id_type is not None:
        id_column = pa.array(list(ids), id_type)  # the values came from a column of that type
    else:
        id_column = _id_array(list(ids))
    embedding = pa.FixedSizeListArray.from_arrays(values, rows.shape[1])
    return pa.table({"id": id_column, "embedding": embedding})


def _id_array(ids: list[Any]) -> Any:
    import pyarrow as pa

    try:
        return pa.array(ids)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        raise BulkError("the ids mix types, which one Parquet column cannot hold: choose an id "
                        "field of one type with --id-field, or write JSONL") from None
    except OverflowError:  # past int64: uint64 still holds up to 2**64 - 1
        try:
            return pa.array(ids, pa.uint64())
        except (OverflowError, pa.ArrowInvalid, pa.ArrowTypeError):
            raise BulkError("an id is an integer beyond 64 bits, which a Parquet integer "
                            "column cannot hold: write JSONL, which keeps such ids exact, or "
                            "quote the ids as strings in the input") from None


def _jsonl_line(record_id: Any, key: str, value: Any, option: int = 0) -> bytes:
    try:
        return orjson.dumps({"id": record_id, key: value}, option=option) + b"\n"
    except TypeError:  # orjson refuses integers beyond 64 bits; the standard library does not
        return b'{"id":%s,"%s":%s}\n' % (_id_json(record_id), key.encode(),
                                          orjson.dumps(value, option=option))


def _id_json(record_id: Any) -> bytes:
    """An id orjson cannot write, as JSON: a decimal (a warehouse's export) as the exact
    number it is; one JSON has no form for (bytes, a duration) is refused in one line."""
    if isinstance(record_id, Decimal) and record_id.is_finite():
        return str(record_id).encode()
    try:
        return json.dumps(record_id).encode()
    except (TypeError, ValueError):
        raise BulkError(f"the id {record_id!r} ({type(record_id).__name__}) has no JSON form: "
                        "write .parquet, or name an --id-field of text or integers") from None


class PartWriter:
    """One part, streamed to ``<path>.tmp`` and renamed to ``path`` by ``commit``."""

    def __init__(self, path: Path, kind: str, id_type: Any = None) -> None:
        self.path, self.kind, self.rows, self.id_type = path, kind, 0, id_type
        self._tmp = path.with_name(path.name + ".tmp")
        self._parquet: Any = None  # a ParquetWriter on the temporary file, from the first rows
        self._file: IO[bytes] | None = None
        if kind != PARQUET:
            self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed in commit/abort

    def write(self, records: list[Record], rows: Any) -> None:
        """Dense rows (an array), or sparse ones (each a list of ``{"index", "value"}``)."""
        if not isinstance(rows, np.ndarray):
            self._write_sparse(records, rows)
        elif self._file is None:
            self._write_parquet(vectors_table([r.id for r in records], rows, self.id_type))
        elif self.kind == NPY:
            self._file.write(np.ascontiguousarray(rows, dtype=row_type(rows)).tobytes())
        elif self.kind == JSONL:
            for record, row in zip(records, rows, strict=True):
                self._file.write(_jsonl_line(record.id, "embedding", row,
                                             orjson.OPT_SERIALIZE_NUMPY))
        self.rows += len(records)

    def _write_sparse(self, records: list[Record], rows: list[Any]) -> None:
        if self.kind != JSONL or self._file is None:
            raise BulkError("sparse vectors are written as JSONL only: use an output ending "
                            "in .jsonl")
        for record, row in zip(records, rows, strict=True):
            self._file.write(_jsonl_line(record.id, "sparse", row))
        self.rows += len(records)

    def _write_parquet(self, table: Any) -> None:
        import pyarrow.parquet as pq

        if self._parquet is None:
            self._parquet = pq.ParquetWriter(self._tmp, table.schema)
        elif table.schema != self._parquet.schema:
            table = cast_like(table, self._parquet.schema)
        self._parquet.write_table(table)

    def commit(self) -> None:
        """Flush to disk and rename into place: from here on the part is never rewritten."""
        self._close()
        fd = os.open(self._tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # a part that exists must survive a power loss too, not only a kill
        finally:
            os.close(fd)
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._close()
        self._tmp.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._parquet is not None:
            self._parquet.close()
        if self._file is not None:
            self._file.close()


def row_type(rows: np.ndarray) -> str:
    """What a part holds: little-endian float32, or the rows' own one-byte integer codes."""
    return rows.dtype.str if rows.dtype in (np.int8, np.uint8) else "<f4"


def assemble(kind: str, parts: list[Path], out: Path, dimension: int,
             dtype: str = "<f4", id_type: Any = None) -> int:
    """Join ``parts`` in order into ``out`` (a file aside the output, which the caller renames
    into place); the row count. ``dtype`` is what the parts hold (``row_type``); ``id_type``
    the input's id type, which a Parquet output's ids take (else the first part's)."""
    if kind == NPY:
        return _assemble_npy(parts, out, dimension, dtype)
    if kind == JSONL:
        return _assemble_jsonl(parts, out)
    return _assemble_parquet(parts, out, dimension, dtype, id_type)


def _assemble_npy(parts: list[Path], tmp: Path, dimension: int, dtype: str) -> int:
    row_bytes = np.dtype(dtype).itemsize * dimension
    rows = sum(p.stat().st_size // row_bytes for p in parts)
    with open(tmp, "wb") as out:
        header = {"descr": dtype, "fortran_order": False, "shape": (rows, dimension)}
        np.lib.format.write_array_header_1_0(out, header)
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    return rows


def _assemble_jsonl(parts: list[Path], tmp: Path) -> int:
    rows = 0
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                for line in f:
                    out.write(line)
                    rows += 1
    return rows


def _assemble_parquet(parts: list[Path], tmp: Path, dimension: int, dtype: str,
                      id_type: Any = None) -> int:
    import pyarrow.parquet as pq

    if not parts:  # an input without rows still gives a file with the columns
        pq.write_table(vectors_table([], np.zeros((0, dimension), dtype), id_type), tmp)
        return 0
    rows, writer = 0, None
    try:
        for part in parts:
            table = pq.read_table(part)  # one part at a time: at most --part-size rows
            if writer is None:  # parts written before the ids took the input's type: cast
                schema = table.schema
                if id_type is not None:
                    schema = schema.set(schema.get_field_index("id"),
                                        schema.field("id").with_type(id_type))
                writer = pq.ParquetWriter(tmp, schema)
            writer.write_table(cast_like(table, writer.schema))
            rows += table.num_rows
    finally:
        if writer is not None:
            writer.close()
    return rows


def cast_like(table: Any, schema: Any) -> Any:
    """``table`` in ``schema`` (ids of one type along the file), or a ``BulkError``."""
    import pyarrow as pa

    if table.schema == schema:
        return table
    try:
        return table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        raise BulkError(f"the ids change type along the input ({schema.field('id').type} "
                        f"first, then {table.schema.field('id').type}): choose an id field of "
                        "one type with --id-field, or write JSONL") from None
