"""Where a bulk job stands: committed parts beside the output, and a manifest that lists them.

For ``--output vectors.npy`` the parts live in ``vectors.npy.parts/`` until the last one is
written, then they are joined into ``vectors.npy`` and the directory is removed. The manifest
(``manifest.json``, replaced whole through a temporary file and ``os.replace``) records the
job's identity, the input range each part covers, the rows' width and type (float32, or
int8/uint8 codes) and the position to continue from. A part that the manifest does not list
(a kill between its rename and the manifest's) is written again under the same name.

The identity is what the output depends on: the input file (its absolute path, size,
modification time in ns and a SHA-256 of its first 64 KiB: cheap on a file of any size, and
any write to the file changes its size or mtime; a folder of images: its image files' names,
sizes and mtimes), the output format, the fields read, and
the model (name, device, dtype and kind) or the server's URL and kind, and the output dtype
of a quantized job (``--output-dtype``; a float job's identity names none). Chunk size,
concurrency, part size and part seconds change only how the work is cut, so they may change
between runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from .errors import BulkError, JobChanged
from .parts import JSONL, PART_SUFFIX, PartWriter, assemble, row_type
from .records import Position, Record, image_files

MANIFEST = "manifest.json"
_VERSION = 1
_HEAD_BYTES = 64 * 1024
# A run's first part is committed after this long at most, and each later one after as long
# as the run had taken when it opened (up to part_seconds): whenever a run is killed, its
# committed parts hold at least half of what it computed, and a long run still commits a
# part per part_seconds, not a file per second.
FIRST_PART_S = 2.0


def parts_dir(target: Path) -> Path:
    return target.with_name(target.name + ".parts")


def fingerprint(path: Path) -> dict[str, Any]:
    """Size, mtime and a hash of the head: what tells a changed input from the same one (a
    folder of images: its image files, each one's name, size and mtime, hashed)."""
    if path.is_dir():
        return _folder_fingerprint(path)
    stat = path.stat()
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(_HEAD_BYTES)).hexdigest()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "head_sha256": head}


def _folder_fingerprint(folder: Path) -> dict[str, Any]:
    names = image_files(folder)
    listing = hashlib.sha256()
    for name in names:
        try:
            stat = (folder / name).stat()
            size, mtime = stat.st_size, stat.st_mtime_ns
        except OSError:  # a link to nothing: the job names it when it comes to it
            size = mtime = -1
        listing.update(os.fsencode(f"{name}\0{size}\0{mtime}\n"))
    return {"images": len(names), "listing_sha256": listing.hexdigest()}


def write_json_atomic(path: Path, value: Any) -> None:
    """Replace ``path`` whole: a reader sees the old content or the new, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(orjson.dumps(value, option=orjson.OPT_INDENT_2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_same_job(where: Path, before: dict[str, Any], now: dict[str, Any]) -> None:
    """Raise ``JobChanged`` naming the first difference, and how to go on."""
    for key in sorted(set(before) | set(now)):
        old, new = before.get(key), now.get(key)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            what = "; ".join(f"{k} {old.get(k)!r} then, {new.get(k)!r} now" for k in changed)
        else:
            what = f"{old!r} then, {new!r} now"
        raise JobChanged(f"{where} holds an unfinished job with a different {key} ({what}): "
                         "rerun with --restart to start over, or as before to continue")


class Checkpoint:
    """The parts directory of one output; ``open`` it, ``write`` rows, ``finish`` at the end::

        checkpoint = Checkpoint.open(target, ".npy", identity, part_size=10_000,
                                     part_seconds=30)
        checkpoint.write(records, rows, end=position)  # parts of 10,000 rows or 30 s at most
        checkpoint.finish()  # joins the parts into target
    """

    def __init__(self, target: Path, kind: str, identity: dict[str, Any],
                 manifest: dict[str, Any], part_size: int, part_seconds: float) -> None:
        self.target, self.kind = target, kind
        self.part_size, self.part_seconds = part_size, part_seconds
        self.dir = parts_dir(target)
        self.identity = identity
        self._manifest = manifest
        self._part: PartWriter | None = None
        self._end = self.done
        self._began: float | None = None  # when this run wrote its first rows (monotonic)
        self._opened = 0.0  # when the open part got its first rows
        self._part_limit = FIRST_PART_S  # how long the open part may stay open
        self.id_type: Any = None  # a Parquet output's id type, where the input has one

    @classmethod
    def open(cls, target: Path, kind: str, identity: dict[str, Any], *, part_size: int,
             part_seconds: float = 30.0, restart: bool = False) -> Checkpoint:
        """Continue the job in ``target``'s parts directory, or start one; refuse another job."""
        directory = parts_dir(target)
        manifest_path = directory / MANIFEST
        if restart and directory.exists():
            shutil.rmtree(directory)
        manifest = orjson.loads(manifest_path.read_bytes()) if manifest_path.exists() else None
        if manifest and manifest["parts"]:
            check_same_job(directory, manifest["job"], identity)
        else:  # nothing committed yet, so nothing to mix up: start (again) as this run says
            directory.mkdir(parents=True, exist_ok=True)
            manifest = {"version": _VERSION, "job": identity, "done": asdict(Position()),
                        "dimension": None, "parts": []}
            write_json_atomic(manifest_path, manifest)
        for stray in directory.glob("*.tmp"):
            stray.unlink()  # a part or manifest cut short by a kill
        return cls(target, kind, identity, manifest, part_size, part_seconds)

    @property
    def done(self) -> Position:
        return Position(**self._manifest["done"])

    @property
    def saved(self) -> int:
        """Rows committed, by this run and earlier ones."""
        return self.done.records

    def write(self, records: list[Record], rows: Any, end: Position) -> None:
        """Add rows (dense or sparse: see parts.py) in input order; commit a part once it
        holds ``part_size`` rows or has been open ``part_seconds`` (a run's first parts
        sooner: ``FIRST_PART_S``), whichever comes first."""
        if self._part is None:
            name = f"part-{len(self._manifest['parts']):06d}{PART_SUFFIX[self.kind]}"
            self._part = PartWriter(self.dir / name, self.kind, self.id_type)
            self._opened = time.monotonic()
            if self._began is None:
                self._began = self._opened
            self._part_limit = min(self.part_seconds,
                                   max(FIRST_PART_S, self._opened - self._began))
        self._part.write(records, rows)
        self._end = end
        if isinstance(rows, np.ndarray):  # sparse rows have no width; JSONL needs none
            self._manifest["dimension"] = int(rows.shape[1])
            self._manifest["row_type"] = row_type(rows)  # int8 codes with --output-dtype
        if (self._part.rows >= self.part_size
                or time.monotonic() - self._opened >= self._part_limit):
            self.commit()

    def commit(self) -> None:
        """Make the open part final, then record it (and where to continue) in the manifest."""
        part, self._part = self._part, None
        if part is None:
            return
        part.commit()
        start = self._manifest["done"]["records"]
        self._manifest["parts"].append(
            {"file": part.path.name, "start": start, "end": self._end.records})
        self._manifest["done"] = asdict(self._end)
        write_json_atomic(self.dir / MANIFEST, self._manifest)

    def abort(self) -> None:
        """Drop the open part (rows after the last commit); the committed ones stay."""
        if self._part is not None:
            self._part.abort()
            self._part = None

    def finish(self, joining: Callable[[], AbstractContextManager[object]] = nullcontext,
               dimension: int | None = None, dtype: str = "<f4") -> int:
        """Commit the last part and join all parts aside the output (within ``joining``,
        where a signal may cut the work short: the parts stay), then rename the output into
        place and remove the directory: from the rename on, the job is done. Parts that do
        not hold the rows the manifest counts are never put in place (``BulkError``; the
        parts stay, to be looked at); a join that does not end leaves no half file aside.
        ``dimension`` and ``dtype`` (``row_type``) are the rows' where no row was written (an
        input without records: an empty file of that width); without a dimension, such an
        input is a ``BulkError``."""
        aside = self.target.with_name(self.target.name + ".tmp")
        try:
            with joining():
                self.commit()
                parts = [self.dir / p["file"] for p in self._manifest["parts"]]
                width = self._manifest["dimension"] or dimension
                if width is None and self.kind != JSONL:
                    raise BulkError(f"the input has no records, and the embedder does not say "
                                    "how wide its vectors are (a server: no 'dimension' in "
                                    f"its /info): {self.target} was not written")
                rows = assemble(self.kind, parts, aside, width or 0,
                                self._manifest.get("row_type", dtype), self.id_type)
            if rows != self.done.records:
                raise BulkError(f"the parts in {self.dir} hold {rows} rows where "
                                f"{self.done.records} inputs were done; {self.target} was not "
                                "written (run again with --restart)")
        except BaseException:
            aside.unlink(missing_ok=True)
            raise
        os.replace(aside, self.target)
        shutil.rmtree(self.dir)
        return rows
