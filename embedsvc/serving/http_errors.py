"""The answers the HTTP server writes itself, in the JSON error shape: one mapping for the
waitress adapter and the gunicorn worker, so both say the same thing for the same fault.

A malformed request line or header, a head or body too large, a body that came too late or a
request that arrives while the server shuts down never reach the app's pipeline; the server
library answers them. Each library names the fault with an HTTP status, a reason phrase and
a detail of its own; ``server_error`` turns those into the error a client of the app would get,
in the error shape of the path's API family when the request line was read (``error_json``).

>>> server_error(413, "Request Entity Too Large", "exceeds 101", max_body_bytes=100).code
'body_too_large'
>>> http_response(server_error(408, "Request Timeout", "", max_body_bytes=100)).split(b"\\r\\n")[0]
b'HTTP/1.1 408 Request Timeout'
"""

from __future__ import annotations

import contextlib
import socket
from http import HTTPStatus

import orjson

from ..api.wsgi import ERROR_SHAPES
from ..errors import (
    ApiError,
    InvalidRequest,
    Unavailable,
    body_too_large,
    internal_error,
    shutting_down,
)

BODY_LATE = ("the body did not arrive within BODY_TIMEOUT_S; send it at once, or raise "
             "EMBEDSVC_BODY_TIMEOUT_S for slow clients")


def server_error(status: int, reason: str, detail: str, *, max_body_bytes: int) -> ApiError:
    """The client's error for an answer the HTTP server writes itself."""
    if status == 413:
        return body_too_large(max_body_bytes)
    if status == 503:
        return shutting_down()
    if status >= 500 and status != 501:  # the library's own fault: no internals leak out
        return internal_error()
    if status == 408:
        error = InvalidRequest(BODY_LATE, code="request_timeout")
    else:
        code = reason.lower().replace(" ", "_")
        error = InvalidRequest(f"{reason}: {detail}" if detail else reason, code=code)
    error.status = status  # a client error of the library's own status (408, 414, 431, 501...)
    return error


def status_line(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Error"


def error_json(exc: ApiError, path: str | None) -> bytes:
    """The body of ``exc`` in the error shape of ``path`` (None: no request line was read)."""
    return orjson.dumps(exc.body(ERROR_SHAPES(path)))


def http_response(exc: ApiError, *, head: bool = False, path: str | None = None) -> bytes:
    """A complete HTTP/1.1 response for ``exc`` on ``path`` that closes the connection; a HEAD
    request's carries the Content-Length of the body without the body (RFC 9110, 9.3.2)."""
    body = error_json(exc, path)
    lines = [f"HTTP/1.1 {status_line(exc.status)}", "Connection: close",
             "Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in exc.headers.items()]
    head_bytes = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head_bytes if head else head_bytes + body


# What may begin a request: a method is a token (RFC 9110, 5.6.2); empty lines before it are
# allowed (RFC 9112, 2.2)
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_TLS_RECORD = 0x16


HEAD_KEPT = 1024  # of a request's first bytes: enough for its request line


def kept_head(head: bytes, data: bytes) -> bytes:
    """``head``, a request's first bytes kept so far, with ``data`` read after them: until its
    request line is whole (a line end), or ``HEAD_KEPT`` bytes."""
    if len(head) >= HEAD_KEPT or b"\n" in head:
        return head
    return head + data[:HEAD_KEPT - len(head)]


def request_line(start: bytes) -> tuple[str, str] | None:
    """The method and path of the request line ``start`` begins with (``POST /api/embed?x
    HTTP/1.1``; a target in absolute form gives its path), or None: the shape of the error
    for a request whose head did not parse.

    >>> request_line(b"POST /api/embed?x=1 HTTP/1.1\\r\\nNoColon\\r\\n")
    ('POST', '/api/embed')
    >>> request_line(b"HEAD http://host:8080/api/tags HTTP/1.1\\r\\n")
    ('HEAD', '/api/tags')
    """
    line = start[:HEAD_KEPT].lstrip(b"\r\n").split(b"\n", 1)[0]
    parts = line.split(b" ", 2)
    if len(parts) < 2:
        return None
    target = parts[1]
    if not target.startswith(b"/") and b"://" in target:  # absolute form: scheme://authority/
        target = b"/" + target.split(b"://", 1)[1].partition(b"/")[2]
    if not target.startswith(b"/"):
        return None
    return parts[0].decode("latin-1"), target.split(b"?", 1)[0].decode("latin-1")


def not_http(start: bytes) -> str | None:
    """Why a connection whose first bytes are ``start`` carries no HTTP request, or None.

    Said at once, where the server would otherwise wait for a line end until the head's
    deadline: a TLS client on the plain port sends none.
    """
    first = start.lstrip(b"\r\n")[:1]
    if not first or first[0] in _TOKEN:
        return None
    if first[0] == _TLS_RECORD:
        return ("this port speaks plain HTTP, not TLS: use http://, or put a proxy that "
                "terminates TLS in front")
    return "a request must begin with its method, such as GET or POST"


def too_many_connections(limit: int) -> Unavailable:
    """The 503 of a connection past the server's bound."""
    return Unavailable(f"the server holds as many connections as it serves at once ({limit}); "
                       "retry shortly, or raise MAX_CONNECTIONS and the open-files limit",
                       code="too_many_connections", headers={"Retry-After": "1"})


def turn_away(sock: socket.socket, error: ApiError) -> None:
    """Answer ``error`` on a connection just accepted and close it, never waiting on it."""
    with contextlib.suppress(OSError):  # the client may be gone, or its window shut
        sock.setblocking(False)
        sock.send(http_response(error))
    sock.close()
