"""One error hierarchy, written in the error shape of the API family a route belongs to:
OpenAI's ``{"error": {message, type, param, code}}`` (every family but Ollama's), or Ollama's
``{"error": "message"}``, which its clients read.

>>> err = InvalidRequest("'input' must not be empty", param="input", code="empty_input")
>>> err.status, err.body()["error"]["type"]
(400, 'invalid_request_error')
>>> err.body(OLLAMA)
{'error': "'input' must not be empty"}
"""

from __future__ import annotations

import math
from typing import Any, Literal

ErrorShape = Literal["openai", "ollama"]
OPENAI: ErrorShape = "openai"
OLLAMA: ErrorShape = "ollama"


class ApiError(Exception):
    """An error a client sees; subclasses fix the HTTP status and the error type."""

    status = 500
    type = "server_error"
    reason = "error"  # the label counted in embedsvc_rejections_total

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self, shape: ErrorShape = OPENAI) -> dict[str, Any]:
        """The JSON body of this error in ``shape``."""
        if shape == OLLAMA:
            return {"error": self.message}
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(ApiError):
    status = 400
    type = "invalid_request_error"
    reason = "invalid"


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"
    reason = "unauthorized"


class NotFound(InvalidRequest):
    status = 404


class MethodNotAllowed(InvalidRequest):
    status = 405


class PayloadTooLarge(InvalidRequest):
    status = 413
    reason = "too_large"


class Overloaded(ApiError):
    status = 429
    type = "rate_limit_error"
    reason = "overloaded"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, code="overloaded", headers={"Retry-After": str(retry_after_s)})


class QuotaExceeded(Overloaded):
    """429: a tenant over its quota. ``empty_s``: how long its quota stays spent whatever it
    sends (a rate: requests a second, tokens a minute), so that an HTTP process in front of
    the engine process refuses its next requests before tokenizing them; 0 where the
    refusal depends on the request and on answers (inputs in flight)."""

    def __init__(self, message: str, *, wait_s: float, spent: bool) -> None:
        super().__init__(message, retry_after_s=max(1, math.ceil(wait_s)))
        self.code = "quota_exceeded"
        self.empty_s = wait_s if spent else 0.0


class ClientDisconnected(ApiError):
    """The client went away while its inputs were queued; nobody reads this answer."""

    status = 499  # the status nginx logs for a client that closed the connection
    type = "client_closed_request"
    reason = "disconnected"


class BatchFailed(ApiError):
    status = 500
    type = "server_error"
    reason = "batch_failed"


class Unavailable(ApiError):
    status = 503
    type = "service_unavailable"
    reason = "unavailable"


class EngineGone(Unavailable):
    """503: the engine process this front sent a request to is gone (or not reachable);
    a new one is starting, so a retry in a moment is served."""


class DeadlineExceeded(ApiError):
    status = 504
    type = "timeout"
    reason = "timeout"


def body_too_large(limit: int, size: int | None = None) -> PayloadTooLarge:
    """The 413 of a body over MAX_BODY_BYTES, whoever finds it: the HTTP server or the app."""
    has = "is larger than" if size is None else f"has {size} bytes, more than"
    return PayloadTooLarge(f"the body {has} MAX_BODY_BYTES ({limit}); split the request",
                           code="body_too_large")


def shutting_down(message: str = "the server is shutting down; retry on another replica"
                  ) -> Unavailable:
    """The 503 of work refused because the server drains: it says when to come back, from
    whichever part refused it (the HTTP server, a front, admission, the batcher): an engine
    process also drains alone while its fronts serve on and a new one starts."""
    return Unavailable(message, code="draining", headers={"Retry-After": "1"})


def internal_error() -> ApiError:
    """The error for a bug: it says nothing about the internals; the log has the traceback."""
    return ApiError("internal server error; the server log has the details", code="internal_error")


class DeviceOutOfMemory(RuntimeError):
    """The device ran out of memory for this batch; a smaller batch may fit."""
