"""What turns a chunk of texts into vectors: the engine in this process, or a running server.

Each embedder also names what its vectors depend on (``identity``, the model's kind
included), so that a resumed job never mixes the vectors of two models, nor dense rows with
sparse ones. An embedding model gives dense rows (an array); a sparse model (SPLADE) gives
each input's non-zero entries in TEI's shape, ``[{"index": i, "value": v}, ...]``.
Rerankers and classifiers are refused: they answer requests, they do not fill files.

An image job's inputs are paths of image files: ``LocalEmbedder(settings, images=True)``
reads each (a regular file of at most MAX_IMAGE_BYTES) and hands it to the engine as a data
URI in ``Work`` of the kind ``IMAGE``, so that image/decode.py checks it as it checks a
request's images (the formats, MAX_IMAGE_PIXELS before decoding, no truncated image).
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
import time
from typing import Any, Protocol

import numpy as np

from ..errors import ApiError
from ..rules import InputRefused
from ..service import Service
from ..settings import Settings
from ..work import IMAGE, ImageRef, Work, elements
from .errors import BulkError, UsageError
from .kinds import (
    dtype_problem,
    expected_kind,
    image_problem,
    kind_problem,
    served_kind,
    told_dimension,
)
from .records import DEFAULT_MAX_CHARS

Rows = np.ndarray | list[list[dict[str, Any]]]  # dense rows, or each input's sparse elements

_BULK_DEADLINE_S = 24 * 3600.0  # chunks in flight are bounded, so no deadline is needed
_RETRIES = 8


class Embedder(Protocol):
    """What a job embeds with. It may also say ``dimension`` (its rows' width, where it is
    told: an input with no rows still gets an output of that width) and ``row_type``
    (``parts.row_type``: float32 unless said); an embedder without them still runs."""

    identity: dict[str, Any]
    max_chars: int  # the longest input it takes (MAX_INPUT_CHARS): the reader refuses more

    def __call__(self, texts: list[str]) -> tuple[Rows, int]:
        """Rows (dense: normalised float32; sparse: elements) and the tokens computed."""


def local_identity(settings: Settings, kind: str | None = None) -> dict[str, Any]:
    """What the in-process vectors depend on, known before the model loads. The graph too,
    where it is not the default's (a job begun in float and resumed with QUANTIZE=int8 mixed
    two graphs' vectors in one file); a default one adds nothing, so that a job begun
    before this was recorded resumes."""
    identity = {"model": settings.model or "bundled", "device": settings.device,
                "dtype": settings.dtype, "kind": kind or expected_kind(settings)}
    if settings.quantize != "none":
        identity["quantize"] = settings.quantize
    if settings.backend != "auto":
        identity["backend"] = settings.backend
    return identity


class LocalEmbedder:
    """The same engine as ``embedsvc serve``, in this process (loads the model). With
    ``images``, the inputs are paths of image files (an image-text model's image job)."""

    def __init__(self, settings: Settings, images: bool = False) -> None:
        self.settings, self.images = settings, images
        self.service = Service(settings)
        try:
            self.service.start(background=False)
        except RuntimeError as exc:  # the service's message already says what failed
            raise BulkError(str(exc)) from None
        self.client = self.service.ready()
        self.kind = self.client.info.kind
        self.max_chars = settings.max_input_chars
        problem = kind_problem(self.kind, None)
        if problem:
            self.close()
            raise BulkError(problem)
        if images and "image" not in self.client.info.modalities:
            self.close()
            raise UsageError(image_problem(self.kind) or "MODEL embeds no images")
        self.identity = local_identity(settings, self.kind)
        self.dimension = self.client.info.dimension if self.kind != "sparse" else None
        self.row_type = "<f4"

    def __call__(self, texts: list[str], dtype: str = "float") -> tuple[Rows, int]:
        """The rows of ``texts`` (as ``dtype`` codes, the server's own: ``Work.codes``) and
        the tokens computed."""
        deadline = time.monotonic() + _BULK_DEADLINE_S
        codes = () if dtype == "float" else (dtype,)
        try:
            if self.images:  # floats only (Quantized refuses codes of images)
                return self._images(texts, deadline)
            if self.kind == "sparse":
                out, pairs = self.client.embed_sparse(texts, deadline=deadline)
                return [elements(i, v) for i, v in pairs], out.tokens
            out = self.client.embed(texts, deadline=deadline, codes=codes)
        except InputRefused:
            raise  # the job names the file and record it came from
        except ApiError as exc:
            raise BulkError(exc.message) from None
        return (out.codes[dtype] if codes else out.vectors), out.tokens

    def _images(self, paths: list[str], deadline: float) -> tuple[Rows, int]:
        """The rows of the image files at ``paths``, in calls of at most
        MAX_IMAGES_PER_REQUEST images; a file the engine refuses is an ``InputRefused`` by
        its index, which the job tells with its record."""
        from ..image.decode import InvalidImage

        most, rows, tokens = self.settings.max_images_per_request, [], 0
        for first in range(0, len(paths), most):
            part = {f"images[{i}]": i for i in range(first, min(first + most, len(paths)))}
            refs = [ImageRef(image_uri(paths[i], i, self.settings.max_image_bytes), param)
                    for param, i in part.items()]
            try:
                out = self.client.run(Work(IMAGE, refs, deadline=deadline))
            except InvalidImage as exc:
                if exc.param not in part:
                    raise
                i = part[exc.param]
                hint = _IMAGE_HINTS.get(exc.code or "", "")
                raise InputRefused(i, f"is image file {paths[i]!r}, which does not decode: "
                                   f"{exc.message}{hint}", exc.code or "invalid_image") from None
            rows.append(out.vectors)
            tokens += out.tokens
        return np.concatenate(rows), tokens

    def close(self) -> None:
        self.service.drain(timeout=5)


_IMAGE_HINTS = {"image_too_many_pixels": " (raise --max-image-pixels to take it)",
                "image_too_large": " (raise --max-image-bytes to take it)"}


def image_uri(path: str, index: int, max_bytes: int) -> str:
    """The image file at ``path`` as a data URI, read here (a regular file of at most
    ``max_bytes``, MAX_IMAGE_BYTES) so that the engine checks its bytes as it checks a
    request's image; a file that cannot be is an ``InputRefused`` of input ``index``."""
    def refused(why: str, code: str = "image_file") -> InputRefused:
        return InputRefused(index, f"is image file {path!r}, which {why}", code)

    if not path:
        raise InputRefused(index, "names no image file (its path is empty)", "image_file")
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block the job, a device not end
            raise refused("is a folder" if stat.S_ISDIR(info.st_mode) else
                          "is not a regular file")
        if info.st_size > max_bytes:
            raise refused(f"has {info.st_size} bytes, more than MAX_IMAGE_BYTES ({max_bytes}) "
                          "(raise --max-image-bytes to take it)", "image_too_large")
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise refused("does not exist") from None
    except OSError as exc:
        raise refused(f"cannot be read ({exc.strerror})") from None
    if len(data) > max_bytes:  # it grew since
        raise refused(f"has more than MAX_IMAGE_BYTES ({max_bytes}) bytes", "image_too_large")
    return "data:application/octet-stream;base64," + base64.b64encode(data).decode("ascii")


class Quantized:
    """A ``LocalEmbedder`` whose dense rows come out as ``dtype`` codes (model/quantize.py):
    int8/uint8 from the model's calibration, the server's own for the same model and cache."""

    def __init__(self, embedder: Embedder, dtype: str) -> None:
        if not isinstance(embedder, LocalEmbedder):
            raise UsageError(f"--output-dtype {dtype} quantizes with the model in this "
                             "process: embed with a LocalEmbedder, or drop --output-dtype")
        problem = dtype_problem(embedder.kind, dtype, embedder.images)
        if problem:
            raise UsageError(problem)
        self.embedder, self.dtype, self.identity = embedder, dtype, embedder.identity
        self.max_chars = embedder.max_chars
        packed = dtype in ("binary", "ubinary")  # eight components a byte
        width = getattr(embedder, "dimension", None)
        self.dimension = None if width is None else -(-width // 8) if packed else width
        self.row_type = "|u1" if dtype in ("uint8", "ubinary") else "|i1"
        if dtype in ("int8", "uint8"):  # calibrated now: a failure stops the job at once
            try:
                embedder.client.calibration()
            except ApiError as exc:
                raise BulkError(f"calibrating the int8 scale failed: {exc.message}") from None

    def __call__(self, texts: list[str]) -> tuple[Rows, int]:
        return self.embedder(texts, self.dtype)


class RemoteEmbedder:
    """A running embedsvc (or TEI, or any OpenAI-compatible server), over HTTP.

    Asks GET /info which kind the server serves (a server without it: embeddings); a sparse
    model's chunks go to /embed_sparse, others to /v1/embeddings.
    """

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 300,
                 max_chars: int = DEFAULT_MAX_CHARS) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.max_chars = max_chars  # the server's own is not told; the setting's, as here
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)
        info = self._loaded_info(timeout_s)
        self.kind = served_kind(info)
        self.dimension, self.row_type = told_dimension(info), "<f4"
        self.identity = {"url": self.url, "kind": self.kind}
        problem = kind_problem(self.kind, None, serving=f"{self.url} serves")
        if problem:
            self.close()
            raise UsageError(problem)

    def _loaded_info(self, timeout_s: float) -> Any:
        """GET /info once the server's model is loaded: an embedsvc still loading names no
        kind yet (``kind: null``, ``state: loading``), which read as a dense model's (a sparse
        server then got /v1/embeddings, and the job failed)."""
        until = time.monotonic() + timeout_s
        while True:
            resp = self._send("GET", "/info")
            if not _loading(resp) or time.monotonic() >= until:
                return resp
            time.sleep(1.0)

    def __call__(self, texts: list[str], first: int = 0) -> tuple[Rows, int]:
        """A chunk whose body the server refuses as too large (413) is sent in halves; an
        input alone over the limit is refused by its index in the chunk (``first`` on)."""
        try:
            return self._send_chunk(texts)
        except _TooLarge as exc:
            if len(texts) == 1:
                raise InputRefused(first, self._too_large(exc.size), "body_too_large") from None
        half = len(texts) // 2
        (a, tokens_a), (b, tokens_b) = self(texts[:half], first), self(texts[half:], first + half)
        rows = np.concatenate([a, b]) if isinstance(a, np.ndarray) else [*a, *b]
        return rows, tokens_a + tokens_b

    def _too_large(self, size: int) -> str:
        return (f"is {size} bytes as a request body, more than {self.url} accepts (it answered "
                "413): raise the server's body limit (embedsvc serve: MAX_BODY_BYTES) above "
                "that, or shorten the input")

    def _send_chunk(self, texts: list[str]) -> tuple[Rows, int]:
        if self.kind == "sparse":
            resp = self._check(self._post("/embed_sparse", {"inputs": texts}), texts)
            rows = resp.json()
            if not isinstance(rows, list) or len(rows) != len(texts):
                raise BulkError(f"{self.url}/embed_sparse answered something other than one "
                                f"vector for each of {len(texts)} inputs")
            return rows, int(resp.headers.get("x-compute-tokens", 0))
        body = {"input": texts, "encoding_format": "base64"}
        resp = self._check(self._post("/v1/embeddings", body), texts)
        try:  # OpenAI's shape, each row at its index (a server may list them in any order)
            data = resp.json()
            listed = sorted(data["data"], key=lambda d: int(d["index"]))
            if [int(d["index"]) for d in listed] != list(range(len(texts))):
                raise ValueError("not one row for each input")
            rows = np.stack([_row(d["embedding"]) for d in listed])
            return rows, int(data["usage"]["prompt_tokens"])
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise BulkError(f"{self.url}/v1/embeddings answered something other than one vector "
                            f"for each of {len(texts)} inputs (is it an embedding server?)"
                            ) from None

    def _check(self, resp: Any, texts: list[str]) -> Any:
        if resp.status_code == 413:
            raise _TooLarge(len(resp.request.content))
        if resp.status_code != 200:
            raise BulkError(f"{self.url} answered {resp.status_code} to a chunk of {len(texts)} "
                            f"inputs: {_error_message(resp)}")
        return resp

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        for attempt in range(_RETRIES):
            resp = self._send("POST", path, json=body)
            if resp.status_code not in (429, 503):
                return resp
            time.sleep(_retry_after(resp.headers.get("retry-after")) * (1 + attempt / 2))
        return resp

    def _send(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            return self._client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise BulkError(f"cannot reach {self.url} ({exc or type(exc).__name__}): "
                            "start the server (embedsvc serve) or fix --url") from None

    def close(self) -> None:
        self._client.close()


def _loading(resp: Any) -> bool:
    """Whether a GET /info answer is an embedsvc's whose model is still loading."""
    try:
        info = resp.json() if resp.status_code == 200 else None
    except ValueError:
        return False
    return isinstance(info, dict) and info.get("state") == "loading" and info.get("kind") is None


def _row(embedding: Any) -> np.ndarray:
    """One row as the server sent it: base64 of little-endian float32, as asked, or the
    floats of a server that ignored the ask."""
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding, validate=True), "<f4")
    return np.asarray(embedding, np.float32)


def _retry_after(value: str | None) -> float:
    """Seconds of a Retry-After in seconds; 1 for none, or for the HTTP-date form."""
    try:
        return max(0.0, float(value)) if value else 1.0
    except ValueError:
        return 1.0


class _TooLarge(Exception):
    def __init__(self, size: int) -> None:
        self.size = size


def _error_message(resp: Any) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return " ".join(resp.text.split())[:300]
