"""What turns a chunk of texts into vectors: the engine in this process, or a running server.

Each embedder also names what its vectors depend on (``identity``), so that a resumed job
never mixes the vectors of two models.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Protocol

import numpy as np

from ..errors import ApiError
from ..rules import InputRefused
from ..service import Service
from ..settings import Settings
from .errors import BulkError

_BULK_DEADLINE_S = 24 * 3600.0  # chunks in flight are bounded, so no deadline is needed
_RETRIES = 8


class Embedder(Protocol):
    identity: dict[str, Any]

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """Vectors (normalised, float32) and the tokens computed."""


def local_identity(settings: Settings) -> dict[str, Any]:
    """What the in-process vectors depend on, known before the model loads."""
    return {"model": settings.model or "bundled", "device": settings.device,
            "dtype": settings.dtype}


class LocalEmbedder:
    """The same engine as ``embedsvc serve``, in this process (loads the model)."""

    def __init__(self, settings: Settings) -> None:
        self.identity = local_identity(settings)
        self.service = Service(settings)
        try:
            self.service.start(background=False)
        except RuntimeError as exc:  # the service's message already says what failed
            raise BulkError(str(exc)) from None
        self.engine = self.service.ready()
        kind = self.engine.info.kind
        if kind != "embedding":
            self.close()
            raise BulkError(
                f"MODEL is a {kind} model: embedsvc embed writes embeddings; reranking and "
                "classification are request/response jobs (serve the model and POST /rerank "
                "or /predict)" if kind != "sparse" else
                "MODEL is a sparse model: embedsvc embed writes dense vectors only; serve it "
                "and POST /embed_sparse")

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, int]:
        try:
            out = self.engine.embed(texts, deadline=time.monotonic() + _BULK_DEADLINE_S)
        except InputRefused:
            raise  # the job names the file and record it came from
        except ApiError as exc:
            raise BulkError(exc.message) from None
        return out.vectors, out.tokens

    def close(self) -> None:
        self.service.drain(timeout=5)


class RemoteEmbedder:
    """A running embedsvc (or any OpenAI-compatible server), over HTTP."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 300) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.identity = {"url": self.url}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, int]:
        body = {"input": texts, "encoding_format": "base64"}
        resp = self._post(body)
        if resp.status_code != 200:
            raise BulkError(f"{self.url} answered {resp.status_code} to a chunk of {len(texts)} "
                            f"inputs: {_error_message(resp)}")
        data = resp.json()
        rows = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data["data"]]
        return np.stack(rows), int(data["usage"]["prompt_tokens"])

    def _post(self, body: dict[str, Any]) -> Any:
        import httpx

        for attempt in range(_RETRIES):
            try:
                resp = self._client.post("/v1/embeddings", json=body)
            except httpx.TransportError as exc:
                raise BulkError(f"cannot reach {self.url} ({exc or type(exc).__name__}): "
                                "start the server (embedsvc serve) or fix --url") from None
            if resp.status_code not in (429, 503):
                return resp
            time.sleep(float(resp.headers.get("retry-after", 1)) * (1 + attempt / 2))
        return resp

    def close(self) -> None:
        self._client.close()


def _error_message(resp: Any) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return " ".join(resp.text.split())[:300]
