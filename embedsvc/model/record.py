"""The export record: what serving a model without PyTorch needs, and the evidence.

A record is a directory in the graph cache, ``<model>-<fingerprint>.lean/``, that export.py
writes (with PyTorch) and lean.py reads (without it):

- ``model.onnx``: the model's whole pipeline (transformer, pooling, Dense layers; a
  cross-encoder's logits; SPLADE's MLM head and pooling) as one graph, computing in float32;
  its large weights stored as float16 and cast to float32 as the session loads, where that
  still reproduces the probe (``weights`` says which; export.py's ``half_weights``);
- ``tokenizer.json``: the fast tokenizer exactly as the encoder uses it (no padding, no
  truncation; ``token_window`` cuts);
- ``probe.npz``: probe inputs' PyTorch outputs, which the graph must reproduce on every start;
- ``record.json``: the pipeline's description, the tokenizer's settings (pad id, template,
  token types, truncation), the model's description (``ModelInfo``), the probe inputs, the
  KIND setting it was made for, and the size and SHA-256 of every other file; its own
  fields' SHA-256 last (``digest``), so that an edited record is rebuilt, not served as
  edited. Written last: a record without it is unfinished.

A model the graph cannot express gets a record that says so (``lean: false`` and the
reason), so that later starts know without PyTorch to take the PyTorch path, and say why.

The fingerprint names the model's files (path, size, modification time) and the KIND
setting: a model changed on disk gets a new record. It is read without hashing the weights,
which would cost a start a tenth of a second per 100 MB. Where the model's files are not on
this machine (a record made elsewhere with ``embedsvc export`` and copied here, the install
without PyTorch, which has no bundled weights), the record is found by the model's name and
the KIND setting instead (``find_exported``), and its own evidence is all that is checked.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 3  # bump whenever what a record holds, or means, changes
RECORD = "record.json"
GRAPH = "model.onnx"
TOKENIZER = "tokenizer.json"
PROBE = "probe.npz"
VISION = "vision.onnx"  # an image-text model's vision tower (its text tower is GRAPH)
PREPROCESSOR = "preprocessor_config.json"  # its image preprocessing, as the model ships it
INT8 = "int8"  # the int8 record's directory, inside the float32 record's
# ONNX Runtime against PyTorch, both float32: the largest difference on the probe, relative
# to the largest output; and the smallest cosine of any output row.
TOLERANCE = 1e-3
PARITY = 0.9999
_DIGEST_BLOCK = 4 << 20  # bytes read and hashed at a time


class RecordError(ValueError):
    """A record that must not be served: unfinished, tampered with, or not this model's."""


@dataclass(frozen=True)
class NotLean:
    """A record saying that this model cannot be served without PyTorch, and why."""

    reason: str


def model_source(setting: str) -> Path | None:
    """The directory holding the model of MODEL ``setting``, found without downloading:
    the bundled model, a local directory, or a hub id's snapshot in the hub cache."""
    from .encoder import bundled, bundled_model_path
    from .hub import local_path

    if bundled(setting):
        try:
            return Path(bundled_model_path())
        except RuntimeError:  # without the torch extra: its record is found by name
            return None
    if os.path.isdir(setting):
        return Path(setting)
    return local_path(setting)


def fingerprint(source: Path, kind: str) -> str:
    """What the record of the model in ``source`` served as KIND ``kind`` is named by."""
    h = hashlib.sha256(json.dumps([FORMAT, kind]).encode())
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if any(part.startswith(".") for part in relative.parts) or not path.is_file():
            continue
        st = path.stat()
        h.update(f"{relative}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def file_digest(path: Path) -> str:
    # Read in large blocks, not mapped: a file cut short while it was mapped killed the
    # process (SIGBUS) at the first page past its new end; read, it ends early and its digest
    # differs. Each block's read and hash release the GIL, and the blocks are few (a start
    # digests the record in a thread of its own while its loading thread builds the session
    # and its main thread imports the web stack: ``Digests``).
    digest = hashlib.sha256()
    # an anonymous mapping, unmapped on return: a freed 4 MiB buffer stayed in the heap
    with open(path, "rb", buffering=0) as f, mmap.mmap(-1, _DIGEST_BLOCK) as block, \
            memoryview(block) as view:
        while count := f.readinto(block):
            digest.update(view[:count])
    return digest.hexdigest()


def describe_file(path: Path) -> dict[str, Any]:
    """A file's size and SHA-256 as ``record.json`` keeps them, to find a changed file (the
    graph's digest costs a start about 0.07 CPU-seconds per 90 MB: a weight that the probe
    inputs do not reach would otherwise go unchecked)."""
    return {"bytes": path.stat().st_size, "sha256": file_digest(path)}


def read_record(path: Path) -> dict[str, Any]:
    """``record.json`` of the record at ``path``, with every file it lists checked;
    RecordError if anything is missing, truncated or changed."""
    record = read_sized(path)
    for name, entry in record.get("files", {}).items():
        _check_digest(path / name, entry)
    return record


class Digests:
    """The SHA-256 of each file of the record ``read_sized`` read at ``path``, checked in a
    thread of its own while the caller goes on: a start builds the graph's session meanwhile
    (both without the GIL), and the digest of the bundled model's graph, about 50 ms, was on
    the loading thread's path before the session. ``check()`` waits for them: RecordError
    for a file that differs. The caller checks before the graph runs (the probe): a file that
    differs is parsed by ONNX Runtime at most, never run, nor served."""

    def __init__(self, path: Path, record: dict[str, Any]) -> None:
        files = record.get("files", {})
        # refused until the thread has seen every digest match: whatever stops it first
        self._error: RecordError | None = RecordError("its files' digests did not finish")
        self._thread = threading.Thread(target=self._run, args=(path, files),
                                        name="embedsvc-digests", daemon=True)
        self._thread.start()

    def _run(self, path: Path, files: dict[str, Any]) -> None:
        try:
            for name, entry in files.items():
                _check_digest(path / name, entry)
        except RecordError as exc:
            self._error = exc
        except Exception as exc:  # noqa: BLE001 - removed, unreadable, cut short: not served
            self._error = RecordError(f"a file of the record does not read ({exc})")
        else:
            self._error = None

    def check(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def read_sized(path: Path) -> dict[str, Any]:
    """``record.json`` of the record at ``path``, its own digest and its files' sizes
    checked, not yet their digests (``read_record`` checks those too; ``Digests`` beside
    other work)."""
    try:
        record = json.loads((path / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RecordError(f"{RECORD} does not read ({exc})") from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise RecordError(f"{RECORD} is not a format-{FORMAT} record")
    if record.get("digest") != _digest(record):
        raise RecordError(f"{RECORD} was changed after it was written (its fields do not "
                          "match their digest)")
    for name, entry in record.get("files", {}).items():
        _check_size(path / name, entry)
    return record


def _check_size(path: Path, entry: dict[str, Any]) -> None:
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise RecordError(f"{path.name} is missing ({exc.strerror})") from exc
    if size != entry.get("bytes"):
        raise RecordError(f"{path.name} has {size} bytes, not the {entry.get('bytes')} recorded")


def _check_digest(path: Path, entry: dict[str, Any]) -> None:
    if "sha256" in entry and file_digest(path) != entry["sha256"]:
        raise RecordError(f"{path.name} is not the file that was recorded (SHA-256 differs)")


def write_record(path: Path, record: dict[str, Any]) -> None:
    fields = {"format": FORMAT, **record}
    (path / RECORD).write_text(json.dumps({**fields, "digest": _digest(fields)}, indent=1),
                               encoding="utf-8")


def _digest(record: dict[str, Any]) -> str:
    """SHA-256 of a record's fields other than ``digest``, as JSON with sorted keys."""
    fields = {k: v for k, v in record.items() if k != "digest"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def find_exported(candidates: Sequence[Path], kind_setting: str) -> tuple[Path, str] | None:
    """The newest of ``candidates`` (record directories of one model's name) made for the
    KIND setting ``kind_setting``, and its fingerprint; None when none reads as such."""
    found = []
    for path in candidates:
        try:
            record = json.loads((path / RECORD).read_text(encoding="utf-8"))
            written = (path / RECORD).stat().st_mtime_ns
        except (OSError, ValueError):
            continue  # unfinished or unreadable: not a candidate
        if isinstance(record, dict) and record.get("kind_setting") == kind_setting:
            found.append((written, path, str(record.get("fingerprint"))))
    if not found:
        return None
    _, path, key = max(found)
    return path, key


def compare(got: np.ndarray, want: np.ndarray, what: str, lengths: Sequence[int] | None = None
            ) -> None:
    """RecordError unless ``got`` reproduces ``want`` (rows; token rows only up to each
    input's length when ``lengths`` is given)."""
    if got.shape != want.shape:
        raise RecordError(f"{what}: shape {got.shape}, not the {want.shape} recorded")
    if lengths is not None:
        keep = np.arange(want.shape[1])[None, :] < np.asarray(lengths)[:, None]
        got, want = got[keep], want[keep]
    got, want = got.reshape(len(got), -1), want.reshape(len(want), -1)
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    error = float(np.abs(got - want).max(initial=0.0)) / scale
    if not error <= TOLERANCE:  # also refuses NaN
        raise RecordError(f"{what} differs from the recorded output by {error:.2e} (relative; "
                          f"at most {TOLERANCE})")
    if want.shape[1] > 1:
        norms = np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
        live = norms > 0
        cos = (got * want).sum(1)[live] / norms[live]
        if cos.size and not cos.min() >= PARITY:
            raise RecordError(f"{what}: cosine {cos.min():.6f} to the recorded output (at "
                              f"least {PARITY})")
