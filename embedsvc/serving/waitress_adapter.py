"""Everything embedsvc takes from waitress beyond its documented options, in one place.

waitress bounds a connection only by inactivity (``channel_timeout``): a client that sends one
header byte a minute is never idle and keeps its connection for ever. This module adds, for
servers embedsvc owns (``embedsvc serve`` and its probe port):

- a deadline for the request head, from accept (or from the first byte of a later request on
  a kept-alive connection), as nginx's ``client_header_timeout`` and Go's
  ``ReadHeaderTimeout``; past it the connection is closed without an answer;
- a deadline for the body, from the end of the head; past it the client gets a 408;
- a deadline for each answer's progress: a connection whose client takes none of its answer
  for ``send_timeout_s`` is reset and its buffers (temporary files included) freed, as
  nginx's ``send_timeout``; waitress's own idle timeout cannot do it, since it only marks the
  connection for closing in a write that never comes while the client's window is shut;
- a half-closed client (``shutdown(SHUT_WR)`` after its request) is treated as departed, as
  nginx does: inputs of its not yet computed are dropped (``client_disconnected`` turns
  true), and whatever answer the request produced (200, or 499 when it was dropped) is still
  written before the connection closes, so the access log never records an answer that was
  not written to the socket;
- the JSON error shape for the answers waitress writes itself (400, 408, 413, 431, 501, 500);
- a chunked body refused (413) as soon as a chunk's size line takes it past the limit, where
  waitress waited for that chunk's bytes;
- descriptors bounded: the loop polls (``select()`` fails on a descriptor above 1023, and
  the process with it); a connection holds at most ``DESCRIPTORS_PER_CONNECTION`` (its
  socket, two bodies and two answers in temporary files), so ``max_connections`` of them fit
  under the open-files limit (serving/process.py ``ensure_open_files``); a connection past
  the bound gets a JSON 503 and is closed at once;
- what the graceful drain needs: connections closing after their answer, and which requests
  are in progress.

It reaches into waitress's ``HTTPChannel``, ``ErrorTask``, ``TcpWSGIServer.maintenance`` and
``handle_accept``, the request parser's body buffer, its chunked receiver's remainder and the
server's socket map, so waitress
is bounded below 3.1 in pyproject.toml and ``check_internals()`` (run when a server is built,
and by the test suite) names anything that moved.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from waitress.adjustments import Adjustments
from waitress.buffers import OverflowableBuffer
from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser, ParsingError
from waitress.receiver import ChunkedReceiver
from waitress.server import TcpWSGIServer
from waitress.task import ErrorTask, ThreadedTaskDispatcher, WSGITask
from waitress.utilities import (
    BadRequest,
    Error,
    RequestEntityTooLarge,
    RequestHeaderFieldsTooLarge,
    build_http_date,
)
from waitress.wasyncore import close_all, dispatcher

from . import drain, http_errors
from .internals import missing_internals

log = logging.getLogger(__name__)

# Errors accept() returns for one queued connection, not for the listener: a client that
# reset while queued, and (Linux, accept(2)) the network errors pending on the new socket,
# which are to be treated as EAGAIN. The next connection may be fine.
_PENDING_ERRORS = frozenset(getattr(errno, name) for name in (
    "ECONNABORTED", "EPROTO", "ENETDOWN", "ENOPROTOOPT", "EHOSTDOWN", "ENONET", "EHOSTUNREACH",
    "EOPNOTSUPP", "ENETUNREACH") if hasattr(errno, name))

SUPPORTED = ((3, 0), (3, 1))  # waitress versions from, and below; as in pyproject.toml
# name -> attributes this module reads or overrides; check_internals() verifies each
INTERNALS: dict[Any, tuple[str, ...]] = {
    HTTPChannel: ("handle_read", "received", "service", "readable", "writable", "handle_write",
                  "check_client_disconnected", "handle_close", "error_task_class", "task_class",
                  "total_outbufs_len", "will_close", "close_when_flushed", "request",
                  "last_activity", "_flush_some", "write_soon",
                  "_flush_outbufs_below_high_watermark", "parser_class", "send_continue"),
    HTTPRequestParser: ("headers_finished", "completed", "error", "received", "body_rcv",
                        "parse_header", "chunked", "expect_continue", "body_bytes_received"),
    OverflowableBuffer: ("overflowed",),
    ChunkedReceiver: ("chunk_remainder", "__len__"),
    ErrorTask: ("execute", "set_close_on_finish", "write", "status"),
    WSGITask: ("write", "build_response_header", "wrote_header", "complete", "content_length",
               "content_bytes_written", "has_body", "chunked_response", "set_close_on_finish",
               "close_on_finish", "start_time", "status"),
    TcpWSGIServer: ("maintenance", "channel_class", "add_task", "pull_trigger", "accepting",
                    "handle_accept", "readable", "set_socket_options", "fix_addr"),
    ThreadedTaskDispatcher: ("active_count", "shutdown"),
    Error: ("code", "reason"),
}
# set in __init__, so checked on a live server (server_internals_missing)
SERVER_INSTANCE = ("_map", "active_channels", "task_dispatcher", "trigger", "effective_port")
# What a connection may hold in memory before the rest goes to a temporary file: of a body
# (waitress's default), and of its answers. A read (RECV_BYTES) is smaller than a body's
# share, so a read spills at most one body to a file.
BODY_IN_MEMORY = 512 * 1024
ANSWER_IN_MEMORY = 1 << 20
RECV_BYTES = 64 * 1024
# A connection's descriptors: its socket; the body being served and the next one read ahead
# (Channel.readable stops reading at two in files); the answer leaving and the next one
# (Channel.service parks a request while more than ANSWER_IN_MEMORY of answers wait, so at
# most one of them is in a file when the next answer is written).
BODY_FILES = 2
DESCRIPTORS_PER_CONNECTION = 1 + BODY_FILES + 2
_PAUSE_ACCEPTING_S = 1.0  # out of descriptors anyway (the app opened files): retry after
# The largest body written in one send with its head (Task.write): a copy of at most this
_HEAD_WITH_BODY = 256 * 1024
# Header names as waitress spells them in an answer ("content-type" -> "Content-Type"), kept
# for the names seen (the app's own few), up to this many
_SPELLED_MOST = 256
_spelled: dict[str, str] = {}
_date: tuple[int, str] = (0, "")  # the Date header's value, for the second it was built in


def check_internals() -> list[str]:
    """What this module needs from waitress and did not find; empty when all is there."""
    missing = missing_internals("waitress", SUPPORTED, INTERNALS)
    instances = {"ThreadedTaskDispatcher()": (ThreadedTaskDispatcher(), ("queue",)),
                 "Error()": (Error("x"), ("body",))}
    for label, (obj, names) in instances.items():
        missing += [f"{label}.{n}" for n in names if not hasattr(obj, n)]
    return missing


@dataclass(frozen=True)
class Bounds:
    """The connection bounds of one server; see the settings of the same names."""

    header_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float
    max_connections: int
    max_body_bytes: int
    send_timeout_s: float = 60.0


class RequestTimeout(Error):
    code = 408
    reason = "Request Timeout"


def error_body(err: Error, max_body_bytes: int, path: str | None = None) -> bytes:
    """The JSON error for an answer waitress writes itself, on ``path`` when it was read."""
    error = http_errors.server_error(err.code, err.reason, err.body, max_body_bytes=max_body_bytes)
    return http_errors.error_json(error, path)


class JsonErrorTask(ErrorTask):
    """waitress's error answer, in the JSON error shape; without its body for a HEAD request."""

    def execute(self) -> None:
        err = self.request.error
        # a head that failed has no path, or waitress's stand-in "GET /" (one too large): the
        # request's first bytes say them
        method, path = getattr(self.request, "command", None), getattr(self.request, "path", None)
        requests = self.channel.requests
        if method is None and path is None and requests and requests[0] is not self.request:
            # waitress's 500 for an app that raised is built on a parser of its own; the
            # request it answers is still the channel's first: its method and its route's
            # error shape
            method = getattr(requests[0], "command", None)
            path = getattr(requests[0], "path", None)
        if path is None or isinstance(err, RequestHeaderFieldsTooLarge):
            method, path = http_errors.request_line(getattr(self.request, "start", b"")) or (
                method, path)
        body = error_body(err, self.channel.server.bounds.max_body_bytes, path)
        self.status = f"{err.code} {err.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        if method != "HEAD":
            self.write(body)
        self.channel.server.on_error(self.request, err.code)


class Task(WSGITask):
    """waitress's WSGI task, whose answer's head leaves with its body. waitress writes the
    head alone, then the body, and each write is sent at once from the request's thread: two
    sends an answer, two packets and two wake-ups of its client. On loopback each send also
    runs the receiving side's TCP work, charged to the sender, and gives up the interpreter
    lock, which the thread then waits to take back. A body of Content-Length bytes, up to
    ``_HEAD_WITH_BODY`` of them, now goes with its head in one write (one send); any other
    (chunked, longer than it says, a HEAD's, very large) as waitress writes it."""

    wrote_header: bool  # waitress's own attributes
    chunked_response: bool
    response_headers: list[tuple[str, str]]

    def write(self, data: bytes) -> None:
        if self.wrote_header or not data or not self.complete or len(data) > _HEAD_WITH_BODY:
            super().write(data)
            return
        head = self.build_response_header()  # which may choose chunked, or no body at all
        self.wrote_header = True
        length = self.content_length
        if not self.has_body or self.chunked_response or length is None \
                or len(data) > length - self.content_bytes_written:
            self.channel.write_soon(head)
            super().write(data)  # the head written: the body alone, waitress's way
            return
        self.content_bytes_written += len(data)
        self.channel.write_soon(head + data)

    def build_response_header(self) -> bytes:
        # waitress's own (3.0.x: the same headers, order and connection handling), with each
        # header name's spelling and the Date value kept instead of built for every answer
        version = self.version
        connection = self.request.headers.get("CONNECTION", "").lower()
        response_headers = []
        content_length_header = date_header = server_header = None
        for name, value in self.response_headers:
            spelled = _spelled.get(name)
            if spelled is None:
                spelled = "-".join([x.capitalize() for x in name.split("-")])
                if len(_spelled) < _SPELLED_MOST:
                    _spelled[name] = spelled
            if spelled == "Content-Length":
                if not self.has_body:
                    continue
                content_length_header = value
            elif spelled == "Date":
                date_header = value
            elif spelled == "Server":
                server_header = value
            response_headers.append((spelled, value))
        self.response_headers = response_headers
        if content_length_header is None and self.content_length is not None \
                and self.has_body:
            content_length_header = str(self.content_length)
            response_headers.append(("Content-Length", content_length_header))
        if version == "1.0":
            if connection == "keep-alive":
                if not content_length_header:
                    self.set_close_on_finish()
                else:
                    response_headers.append(("Connection", "Keep-Alive"))
            else:
                self.set_close_on_finish()
        elif version == "1.1":
            if connection == "close":
                self.set_close_on_finish()
            if not content_length_header:
                if self.has_body:
                    response_headers.append(("Transfer-Encoding", "chunked"))
                    self.chunked_response = True
                if not self.close_on_finish:
                    self.set_close_on_finish()
        else:
            raise AssertionError("neither HTTP/1.0 or HTTP/1.1")
        ident = self.channel.server.adj.ident
        if not server_header:
            if ident:
                response_headers.append(("Server", ident))
        else:
            response_headers.append(("Via", ident or "waitress"))
        if not date_header:
            response_headers.append(("Date", _http_date(self.start_time)))
        lines = [f"HTTP/{version} {self.status}"]
        lines.extend([f"{name}: {value}" for name, value in sorted(response_headers, key=_name)])
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _name(header: tuple[str, str]) -> str:
    return header[0]


def _http_date(when: float) -> str:
    """waitress's ``build_http_date(when)``, built once a second."""
    global _date
    second = int(when)
    kept = _date
    if kept[0] != second:
        kept = _date = (second, build_http_date(second))
    return kept[1]


# The bytes a chunked body still sends after a chunk's data, at the least: that chunk's CRLF,
# then the last chunk ("0" CRLF) and the CRLF that ends the trailer
_CHUNKS_END = 2 + 3 + 2


class Parser(HTTPRequestParser):
    """waitress's request parser, refusing a head with both Content-Length and a chunked
    Transfer-Encoding (400), as gunicorn does: waitress reads the chunks and takes what
    follows them for the next request, which a proxy that goes by the length sent as this
    request's body (request smuggling; RFC 9112, 6.1). A chunk whose size line alone takes
    the body past ``max_request_body_size`` is a 413 as soon as that line is read: waitress
    counts a chunk's bytes as they come, so a size line past the limit followed by nothing
    waited for the body's deadline and got 408."""

    completed: bool  # waitress's own attributes
    body_bytes_received: int
    start = b""  # this request's first bytes, up to its request line's end (its error's)

    def parse_header(self, header_plus: bytes) -> None:
        super().parse_header(header_plus)
        if self.chunked and "CONTENT_LENGTH" in self.headers:
            raise ParsingError("Content-Length and Transfer-Encoding: chunked together; "
                               "send one of them")

    def received(self, data: bytes) -> int:
        if len(self.start) < http_errors.HEAD_KEPT:  # waitress hands a parser its request's
            self.start = http_errors.kept_head(self.start, data)  # bytes from the first on
        consumed = super().received(data)
        chunks = self.body_rcv
        if self.chunked and not self.completed and isinstance(chunks, ChunkedReceiver):
            most = self.adj.max_request_body_size
            # waitress refuses once the bytes read reach ``most``: in a chunk's data, its rest,
            # its CRLF and the last chunk's five bytes are still to come
            rest = chunks.chunk_remainder
            if rest and self.body_bytes_received + rest + _CHUNKS_END >= most:
                self.error = RequestEntityTooLarge(f"exceeds max_body of {most}")
                self.completed = True
        return int(consumed)


class Channel(HTTPChannel):
    """One client connection, with head and body deadlines and half-close handling."""

    error_task_class = JsonErrorTask
    task_class = Task
    parser_class = Parser
    request: HTTPRequestParser | None  # the request being read (waitress's own attribute)

    def __init__(self, server: Any, sock: Any, addr: Any, adj: Any, map: Any = None) -> None:
        self.head_since: float | None = time.monotonic()  # the first request's clock: accept
        self.body_since: float | None = None
        self.peer_closed = False
        self.output_since: float | None = None  # output waiting since (seen by the sweep)
        self.sent_at = 0.0  # when bytes last left for the client
        self.aborting = False
        self.parked = False  # a request waits for the answers before it to leave
        self.refused = False  # answered 400 at once: what else the client sends is dropped
        self.writing = False  # a request thread is in write_soon
        super().__init__(server, sock, addr, adj, map=map)

    def _flush_some(self, do_close: bool = True) -> bool:
        sent = super()._flush_some(do_close=do_close)
        if sent:
            self.sent_at = time.monotonic()
        return sent

    def stalled(self, now: float, bounds: Bounds) -> bool:
        """Output has waited, and none of it left, for longer than ``send_timeout_s``."""
        if not self.total_outbufs_len or self.aborting:
            self.output_since = None
            return False
        if self.output_since is None:
            self.output_since = now
        return now - max(self.output_since, self.sent_at) > bounds.send_timeout_s

    def abort(self) -> bool:
        """Reset the connection and free its buffers (in the loop thread, outside the sweep);
        a request thread still writing to it stops with ClientDisconnected. False when it
        was closed meanwhile (by its client)."""
        if self.socket is None or not self.connected:
            return False
        with contextlib.suppress(OSError):  # RST: the kernel drops its send buffer too
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.handle_close()
        return True

    def received(self, data: bytes) -> bool:
        now = time.monotonic()
        before = self.request
        if self.refused:
            return False
        if before is None and self.head_since is None:
            self.head_since = now  # a later request: its clock starts with its first byte
        if before is None and (hint := http_errors.not_http(data)):
            self._refuse(BadRequest(hint))
            return False
        result = super().received(data)
        after = self.request
        if after is None:
            self.head_since = self.body_since = None
        else:
            if before is not None and after is not before:
                self.head_since, self.body_since = now, None
            if after.headers_finished and self.body_since is None:
                self.body_since = now
        return result

    def send_continue(self) -> None:
        # waitress marks the request not completed as it sends 100 Continue, even one it
        # refused at its head (413 past MAX_BODY_BYTES): that one would wait for the body it
        # refused, then answer 408 at the body's deadline. It is answered now, without 100.
        request = self.request
        if request is not None and request.error is not None:
            request.expect_continue = False
            return
        super().send_continue()

    def handle_read(self) -> None:
        # waitress closes the whole connection when a read returns nothing, so a client that
        # half-closed after its request never got its answer; here the answer still goes out.
        try:
            data = self.socket.recv(self.adj.recv_bytes)
        except OSError:
            self.handle_close()
            return
        if data:
            self.last_activity = time.time()
            self.received(data)
        else:
            self._peer_finished()

    def _peer_finished(self) -> None:
        self.peer_closed = True
        with self.requests_lock:
            if not self.requests:  # nothing being answered: close once written out
                if self.total_outbufs_len:
                    self.close_when_flushed = True
                else:
                    self.will_close = True

    # readable() and writable() are asked of every connection at every turn of the loop, one
    # turn per answer written: with 64 connections, a few calls more in each were more CPU
    # per request than the whole request path. So they read attributes only, waitress's own
    # conditions inlined (its HTTPChannel's, checked by internals.py), and count the bodies in
    # files only where a request is there to hold one.
    def readable(self) -> bool:
        if (self.peer_closed or self.will_close or self.close_when_flushed
                or self.total_outbufs_len
                or len(self.requests) > self.adj.channel_request_lookahead):
            return False
        # a connection can hold no more bodies in files than requests: most hold one or none
        held = len(self.requests) + (self.request is not None)
        return held < BODY_FILES or self.body_files() < BODY_FILES

    def body_files(self) -> int:
        """Bodies of this connection's requests held in temporary files."""
        held = [*self.requests, self.request]
        return sum(1 for request in held if request is not None
                   and request.body_rcv is not None and request.body_rcv.getbuf().overflowed)

    # While a request thread is in write_soon, it holds the output lock and flushes its own
    # answer (its send releases the GIL): the connection is not writable for the loop then,
    # which would find the lock taken and poll again at once, a spin of about ten turns an
    # answer that took the GIL from the writing thread each time. Only a thread waiting for
    # the loop to take its output below the high-water mark needs the loop meanwhile: it
    # waits while the output is above the mark and is woken once it is below, so the loop
    # sends at the mark itself too (else output left exactly at the mark waits for the send
    # timeout).
    def writable(self) -> bool:
        return bool(self.parked or self.will_close or self.close_when_flushed
                    or (self.total_outbufs_len
                        and (not self.writing
                             or self.total_outbufs_len >= self.adj.outbuf_high_watermark)))

    def handle_write(self) -> None:
        super().handle_write()
        if self.parked and self.connected and not self._answers_waiting():
            self.parked = False
            self.server.add_task(self)

    def _answers_waiting(self) -> bool:
        return self.total_outbufs_len > self.adj.outbuf_high_watermark

    def write_soon(self, data: bytes) -> int:
        self.writing = True
        try:
            return int(super().write_soon(data))
        finally:
            self.writing = False
            if self.total_outbufs_len:  # what the client did not take yet: the loop sends it
                self.server.pull_trigger()

    def _flush_outbufs_below_high_watermark(self) -> None:
        # An answer written in parts waits here for its client, as in waitress. waitress also
        # waits here between pipelined requests, holding the thread while the client reads
        # nothing; there service() parks the next request instead.
        if self.writing:
            super()._flush_outbufs_below_high_watermark()

    def check_client_disconnected(self) -> bool:
        return self.peer_closed or not self.connected

    def service(self) -> None:
        # A pipelined request waits, holding no thread, while the answers before it still
        # fill more than a buffer: then at most one of them is in a temporary file when its
        # own answer is written. handle_write runs it once they have left.
        with self.outbuf_lock:
            self.parked = self.connected and self._answers_waiting()
        if self.parked:
            self.server.pull_trigger()
            return
        if self.server.draining and self.requests:
            # answer with "Connection: close", so the client sends its next request elsewhere
            # instead of onto a connection that is about to close
            self.requests[0].headers["CONNECTION"] = "close"
        super().service()
        if self.peer_closed:
            with self.requests_lock:
                if not self.requests:
                    self.close_when_flushed = True
            self.server.pull_trigger()

    def expired(self, now: float, bounds: Bounds) -> str | None:
        """``header_timeout`` or ``body_timeout`` when a deadline has passed, else None."""
        if self.requests or self.will_close or self.close_when_flushed:
            return None
        request = self.request
        if request is not None and request.headers_finished:
            since, limit, reason = self.body_since, bounds.body_timeout_s, "body_timeout"
        else:
            since, limit, reason = self.head_since, bounds.header_timeout_s, "header_timeout"
        return reason if since is not None and now - since > limit else None

    def time_out_body(self) -> None:
        """Answer the request whose body is late with 408 and close (in the loop thread)."""
        if self.request is not None:  # else answered meanwhile
            self._answer_error(self.request, RequestTimeout(http_errors.BODY_LATE))

    def _refuse(self, error: Error) -> None:
        """Answer ``error`` to bytes that begin no request, and read no more (loop thread)."""
        self.refused = True
        self._answer_error(self.parser_class(self.adj), error)

    def _answer_error(self, request: HTTPRequestParser, error: Error) -> None:
        """Queue ``request`` to be answered ``error`` (JsonErrorTask), the connection closing."""
        with self.requests_lock:
            # A request thread may have just answered an error and marked the connection
            # closing, after the loop found it readable: what this read brought (the rest of
            # a refused body) is dropped, as waitress's own received() drops it, not answered
            # a second time on the same connection.
            if self.will_close or self.close_when_flushed:
                return
            request.error = error
            request.completed = True
            self.request = None
            self.requests.append(request)
            if len(self.requests) == 1:
                self.server.add_task(self)

    def busy(self) -> bool:
        """A request is arriving, waiting, being served or being written out."""
        return bool(self.requests or self.request is not None or self.total_outbufs_len)


class Server(TcpWSGIServer):
    """A waitress TCP server whose maintenance sweep enforces ``Bounds``, and whose accept
    turns away the connections past ``max_connections``."""

    channel_class = Channel
    draining = False
    full = False  # connections past the bound are being turned away
    paused_until = 0.0  # out of descriptors: no accept before this (monotonic)

    def __init__(self, app: Any, adj: Adjustments, bounds: Bounds,
                 on_close: Callable[[str], None], on_error: Callable[[Any, int], None],
                 sock: socket.socket | None = None) -> None:
        self.bounds = bounds
        self.on_close = on_close
        self.on_error = on_error
        # ``sock``: a listening socket bound elsewhere (the supervisor's, shared by fronts)
        super().__init__(app, adj=adj, _sock=sock, bind_socket=sock is None)

    def maintenance(self, now: float) -> None:
        # Idle kept-alive connections close after channel_timeout (IDLE_TIMEOUT_S), as in
        # waitress, but not one whose answer is still leaving: waitress counts only its own
        # sends as activity, and a client reading a large answer slowly leaves the kernel's
        # send buffer full for longer than that (no send is possible meanwhile), so waitress
        # closed it mid-answer. Output waiting is bounded by SEND_TIMEOUT_S below instead.
        # Nor one with a request arriving: its head and body have their own deadlines
        # (``expired``), which answer 408; the idle close came first and answered nothing.
        cutoff = now - self.adj.channel_timeout
        for channel in self.active_channels.values():
            if not channel.requests and not channel.total_outbufs_len \
                    and channel.request is None and channel.last_activity < cutoff:
                channel.will_close = True
        mono = time.monotonic()
        for channel in list(self.active_channels.values()):
            if channel.stalled(mono, self.bounds):
                # The sweep runs while the loop builds its poll set: closing a socket now
                # would hand poll a dead descriptor, so the close runs after this round.
                channel.aborting = True
                log.info("%s: the client read nothing of its answer for %.0fs "
                         "(SEND_TIMEOUT_S); closing", channel.addr, self.bounds.send_timeout_s)
                self.trigger.pull_trigger(functools.partial(self._abort, channel))
                continue
            reason = channel.expired(mono, self.bounds)
            if reason == "body_timeout":
                channel.time_out_body()
            elif reason:
                channel.will_close = True
            if reason:
                self.on_close(reason)

    def _abort(self, channel: Channel) -> None:
        """Reset a stalled connection, then count it: the count means its buffers are gone."""
        if channel.abort():
            self.on_close("send_timeout")

    def readable(self) -> bool:
        ready = super().readable()  # runs the maintenance sweep
        return ready and time.monotonic() >= self.paused_until

    def handle_accept(self) -> bool:
        """Take one connection the kernel has queued; whether there was one (a client
        that left while queued counts: others may wait behind it)."""
        try:
            sock, addr = self.socket.accept()
        except OSError as exc:
            if exc.errno in _PENDING_ERRORS:  # that connection failed: the next may be fine
                return True
            if isinstance(exc, (BlockingIOError, InterruptedError)):
                return False
            self._pause_accepting(exc)  # out of descriptors all the same
            return False
        if len(self.active_channels) >= self.bounds.max_connections:
            self._turn_away(sock)
            return True
        self.full = False
        try:
            self.set_socket_options(sock)
        except OSError:  # the client left before its socket was set up
            sock.close()
            return True
        self.channel_class(self, sock, self.fix_addr(addr), self.adj, map=self._map)
        return True

    def _turn_away(self, sock: socket.socket) -> None:
        if not self.full:
            log.warning("%d connections open, the bound (MAX_CONNECTIONS and the open-files "
                        "limit): new connections get 503 until some close",
                        self.bounds.max_connections)
            self.full = True
        http_errors.turn_away(sock, http_errors.too_many_connections(
            self.bounds.max_connections))
        self.on_close("too_many_connections")

    def _pause_accepting(self, exc: OSError) -> None:
        if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            log.warning("accept() failed: %s", exc)
            return
        log.warning("out of descriptors (%s) with %d connections open: not accepting for "
                    "%.0fs; lower MAX_CONNECTIONS or raise the open-files limit",
                    exc, len(self.active_channels), _PAUSE_ACCEPTING_S)
        self.paused_until = time.monotonic() + _PAUSE_ACCEPTING_S

    def channels(self) -> list[Channel]:
        return [ch for ch in list(self._map.values()) if isinstance(ch, Channel)]


def create(app: Any, *, host: str, port: int, threads: int, bounds: Bounds, ident: str,
           on_close: Callable[[str], None] = lambda reason: None,
           on_error: Callable[[Any, int], None] = lambda request, status: None,
           sock: socket.socket | None = None) -> Server:
    """A waitress server for ``app`` on ``host:port`` (or on ``sock``, a listening socket
    already bound) that enforces ``bounds``."""
    missing = check_internals()
    if missing:
        raise RuntimeError("this waitress lacks what embedsvc's adapter uses: "
                           + ", ".join(missing) + "; install waitress>=3.0,<3.1")
    adj = Adjustments(
        host=host, port=port, threads=threads, ident=ident,
        clear_untrusted_proxy_headers=True,
        # read ahead on each connection, so that a client that hangs up is noticed
        # (waitress.client_disconnected) and its queued inputs are dropped
        channel_request_lookahead=4,
        channel_timeout=max(1, round(bounds.idle_timeout_s)),
        # poll(), not select(): select() raises on a descriptor above 1023
        asyncore_use_poll=True,
        # Server.handle_accept turns away the connections past the bound; waitress's own
        # limit would leave them waiting in the listen backlog instead
        connection_limit=sys.maxsize,
        # waitress refuses a body of exactly its limit; MAX_BODY_BYTES itself is allowed
        max_request_body_size=bounds.max_body_bytes + 1,
        cleanup_interval=1,  # how often the sweep runs (seconds; waitress takes an int)
        recv_bytes=RECV_BYTES,
        inbuf_overflow=BODY_IN_MEMORY,
        outbuf_overflow=ANSWER_IN_MEMORY,
        outbuf_high_watermark=ANSWER_IN_MEMORY,
    )
    return Server(app, adj, bounds, on_close, on_error, sock)


def in_loop(server: Server, thunk: Callable[[], object]) -> None:
    """Run ``thunk`` in the server's event loop thread, soon; safe from any thread."""
    server.trigger.pull_trigger(thunk)


def stop_threads(server: Server, timeout: float) -> None:
    """Stop the request threads, waiting up to ``timeout`` for running requests."""
    server.task_dispatcher.shutdown(timeout=timeout)


def start_draining(server: Server, shut_queue: bool = True) -> None:
    """Take the connections the kernel has queued, then close the listening socket; open
    connections stay, each closing after its next answer (call in the loop thread).
    Closed with connections still queued, the listener reset them all: a request cut that
    way cannot be retried safely. gunicorn's worker takes them the same way. New connections
    are kept out of the queue meanwhile (``drain.queue_shut``), where ``shut_queue`` says
    that no other process serves the listener (`embedsvc serve --workers N` closed its copies
    of the fronts' listeners before it told them to drain, but keeps the one probe socket
    they share until the last has stopped)."""
    server.draining = True
    listener = server.socket if shut_queue else None
    with drain.queue_shut(listener) if listener is not None else contextlib.nullcontext():
        # at most a backlog's worth: the loop's other connections wait meanwhile, and a
        # storm of new ones would otherwise keep it here past the drain's deadline
        for _ in range(server.adj.backlog):
            if server.socket is None or not server.handle_accept():  # nonblocking
                break
    server.accepting = False
    dispatcher.close(server)


def close(server: Server) -> None:
    """Close every connection, which makes ``server.run()`` return (call in the loop thread)."""
    close_all(server._map)


def close_soon(server: Server) -> None:
    """``close`` in the loop thread, from any thread. When the loop can no longer be woken
    (its wake-up pipe is closed: the loop closes it on a read error), the connections left
    are closed from this thread instead, and the loop ends once its map is empty."""
    try:
        in_loop(server, lambda: close(server))
    except OSError as exc:
        log.warning("the server's wake-up pipe is closed (%s); closing its %d connections "
                    "from this thread", exc, open_connections(server))
        close(server)


def requests_in_progress(server: Server) -> list[tuple[Channel, Any]]:
    """Each request arriving, queued or being served now, with its connection."""
    found = []
    for ch in server.channels():
        with ch.requests_lock:
            if ch.request is not None:
                found.append((ch, ch.request))
            found += [(ch, request) for request in ch.requests]
    return found


def still_in_progress(requests: Iterable[tuple[Channel, Any]]) -> bool:
    """Whether any of ``requests`` is still arriving, queued or being served."""
    return any(ch.connected and (request is ch.request or any(r is request for r in ch.requests))
               for ch, request in requests)


def any_busy(server: Server) -> bool:
    """Whether a request is queued or running, or any connection has one or output left."""
    tasks = server.task_dispatcher
    if tasks.queue or tasks.active_count > 0:
        return True
    return any(ch.busy() for ch in server.channels())


def open_connections(server: Server) -> int:
    return len(server.active_channels)
