"""``embedsvc embed``: embed a whole file, in this process or through a running server.

Input: a text file (one input per line) or JSONL (``.jsonl``/``.ndjson``, the text in
``--text-field``, an optional ``--id-field``); blank lines are skipped. Output: ``.npy``
(float32, one row per input in order) or JSONL (``{"id", "embedding"}`` per line; the id is
the line number of a text file). Both are written as chunks finish, with a bounded number of
chunks in flight, so memory stays flat however large the file.

Example (loads the model)::

    embed_file(Path("corpus.txt"), Path("vectors.npy"), LocalEmbedder(Settings()))
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import orjson

from .service import Service
from .settings import Settings

log = logging.getLogger(__name__)

_JSONL = {".jsonl", ".ndjson"}
_BULK_DEADLINE_S = 24 * 3600.0  # chunks in flight are bounded, so no deadline is needed
_RETRIES = 8


class BulkError(RuntimeError):
    """A problem with the input or output file; the message names the line."""


@dataclass(frozen=True)
class Record:
    id: Any
    text: str


class Embedder(Protocol):
    def __call__(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """Vectors (normalised, float32) and the tokens computed."""


def read_records(path: Path, text_field: str = "text", id_field: str | None = "id"
                 ) -> Iterator[Record]:
    """The file's inputs in order, streamed."""
    jsonl = path.suffix in _JSONL
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if not jsonl:
                yield Record(number, line.rstrip("\r\n"))
                continue
            try:
                row = orjson.loads(line)
                text = row[text_field]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                raise BulkError(f"{path}:{number}: not a JSON object with a string "
                                f"{text_field!r} field") from None
            if not isinstance(text, str) or not text:
                raise BulkError(f"{path}:{number}: {text_field!r} must be a non-empty string")
            yield Record(row.get(id_field, number) if id_field else number, text)


def count_records(path: Path) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


class LocalEmbedder:
    """The same engine as ``embedsvc serve``, in this process."""

    def __init__(self, settings: Settings) -> None:
        self.service = Service(settings)
        self.service.start(background=False)
        self.engine = self.service.ready()

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, int]:
        out = self.engine.embed(texts, deadline=time.monotonic() + _BULK_DEADLINE_S)
        return out.vectors, out.tokens

    def close(self) -> None:
        self.service.drain(timeout=5)


class RemoteEmbedder:
    """A running embedsvc (or any OpenAI-compatible server), over HTTP."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 300) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, int]:
        import base64

        body = {"input": texts, "encoding_format": "base64"}
        for attempt in range(_RETRIES):
            resp = self._client.post("/v1/embeddings", json=body)
            if resp.status_code not in (429, 503):
                break
            time.sleep(float(resp.headers.get("retry-after", 1)) * (1 + attempt / 2))
        if resp.status_code != 200:
            raise BulkError(f"the server answered {resp.status_code}: {resp.text[:500]}")
        data = resp.json()
        rows = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data["data"]]
        return np.stack(rows), int(data["usage"]["prompt_tokens"])

    def close(self) -> None:
        self._client.close()


class NpyWriter:
    """Rows appended to a .npy file whose shape is written first (the count is known)."""

    def __init__(self, path: Path, count: int) -> None:
        self._path, self._count, self._file = path, count, None  # type: ignore[var-annotated]

    def write(self, records: list[Record], rows: np.ndarray) -> None:
        if self._file is None:
            self._file = open(self._path, "wb")  # noqa: SIM115 - closed in close()
            header = {"descr": "<f4", "fortran_order": False, "shape": (self._count, rows.shape[1])}
            np.lib.format.write_array_header_1_0(self._file, header)
        self._file.write(np.ascontiguousarray(rows, dtype="<f4").tobytes())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class JsonlWriter:
    def __init__(self, path: Path) -> None:
        self._file: IO[bytes] = open(path, "wb")  # noqa: SIM115 - closed in close()

    def write(self, records: list[Record], rows: np.ndarray) -> None:
        for record, row in zip(records, rows, strict=True):
            line = {"id": record.id, "embedding": row}
            self._file.write(orjson.dumps(line, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class Summary:
    inputs: int
    tokens: int
    seconds: float

    def __str__(self) -> str:
        rate = self.inputs / self.seconds if self.seconds else 0.0
        return (f"{self.inputs} inputs, {self.tokens} tokens in {self.seconds:.1f}s "
                f"({rate:.1f} inputs/s)")


def _chunks(records: Iterator[Record], size: int) -> Iterator[list[Record]]:
    chunk: list[Record] = []
    for record in records:
        chunk.append(record)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def embed_file(
    source: Path,
    target: Path,
    embedder: Embedder,
    *,
    text_field: str = "text",
    id_field: str | None = "id",
    chunk_size: int = 256,
    concurrency: int = 4,
    progress: Callable[[int], None] | None = None,
    count: int | None = None,
) -> Summary:
    """Embed every input of ``source`` into ``target``; at most ``concurrency`` chunks at once."""
    count = count_records(source) if count is None else count
    writer = NpyWriter(target, count) if target.suffix == ".npy" else JsonlWriter(target)
    started, inputs, tokens = time.monotonic(), 0, 0
    pending: deque[tuple[list[Record], Future]] = deque()

    def finish_oldest() -> None:
        nonlocal inputs, tokens
        records, future = pending.popleft()
        rows, used = future.result()
        writer.write(records, rows)
        inputs, tokens = inputs + len(records), tokens + used
        if progress:
            progress(len(records))

    try:
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="embed") as pool:
            for chunk in _chunks(read_records(source, text_field, id_field), chunk_size):
                pending.append((chunk, pool.submit(embedder, [r.text for r in chunk])))
                if len(pending) >= concurrency:
                    finish_oldest()
            while pending:
                finish_oldest()
    finally:
        writer.close()
    if inputs != count:
        raise BulkError(f"wrote {inputs} rows for {count} inputs")
    return Summary(inputs, tokens, time.monotonic() - started)


def run(args: Any, settings: Settings) -> int:
    """``embedsvc embed`` with parsed arguments; the exit code."""
    from tqdm import tqdm

    source, target = Path(args.input), Path(args.output)
    if target.suffix not in {".npy", *_JSONL}:
        print(f"embedsvc: --output must end in .npy or .jsonl, not {target.name!r}",
              file=sys.stderr)
        return 2
    embedder: Any = (RemoteEmbedder(args.url, settings.api_key) if args.url
                     else LocalEmbedder(settings))
    try:
        count = count_records(source)
        with tqdm(total=count, unit="input", file=sys.stderr) as bar:
            summary = embed_file(source, target, embedder, text_field=args.text_field,
                                 id_field=args.id_field, chunk_size=args.chunk_size,
                                 concurrency=args.concurrency, progress=bar.update, count=count)
    except (BulkError, OSError) as exc:
        print(f"embedsvc: {exc}", file=sys.stderr)
        return 1
    finally:
        embedder.close()
    print(f"embedsvc: {summary} -> {target}", file=sys.stderr)
    return 0
