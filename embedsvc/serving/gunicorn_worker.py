"""The gunicorn worker of deploy/gunicorn.conf.py: gthread with deadlines and a real drain.

gunicorn's gthread worker gives a connection a thread as soon as its first byte arrives and
then reads the request head with no deadline, so as many clients trickling header bytes as
there are threads stop the worker; new connections wait up to 5 s on a thread for their
first byte. This worker, selected with ``worker_class`` (gunicorn's extension point for
workers), changes these things and reads its bounds from the EMBEDSVC_* settings:

- a new connection waits for its first byte in the worker's poller, holding no thread, and
  is closed if its head is not complete HEADER_TIMEOUT_S after accept (from the first byte
  of a later request on a kept-alive connection);
- the body is read in full by the worker before the app runs, within BODY_TIMEOUT_S (else a
  408) and up to MAX_BODY_BYTES (else a 413, at once when Content-Length says so);
- an answer the client takes none of for SEND_TIMEOUT_S is abandoned and the connection
  reset (gthread would block a thread on it for ever);
- gunicorn's own error answers (400, 414, 431, 501...) are written in the JSON error shape
  (serving/http_errors.py), without a body for a HEAD request;
- connections are bounded by what the open-files limit holds (``worker_connections`` at
  most); a connection past the bound gets a JSON 503 and is closed at once, where gthread
  would leave it in the listen backlog;
- on SIGTERM the listener closes at once, so new connections are refused instead of queued
  and reset at the exit, and the service drains as under `embedsvc serve` (serving/drain.py);
  the probe listener stops with the worker.

A trickling head still holds a thread until its deadline: with more slow clients than
threads, others wait up to HEADER_TIMEOUT_S. A buffering proxy in front (nginx) removes that.

It also closes connections without gunicorn's 2 s linger on the main loop. It subclasses
gunicorn internals (``ThreadWorker.accept``, ``handle``, ``handle_request``,
``finish_request``, ``handle_exit``, ``TConn``, ``util.write_error``...), so gunicorn is
bounded below 28 in pyproject.toml and ``check_internals()`` (run at worker start and by the
tests) names anything that moved.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import selectors
import socket
import struct
import threading
import time
from functools import partial
from typing import Any

from gunicorn import util
from gunicorn.http.errors import NoMoreData
from gunicorn.workers import gthread

from ..errors import ApiError, body_too_large
from ..settings import Settings
from . import drain, http_errors
from .internals import missing_internals
from .probe import ProbeListener
from .process import ensure_open_files
from .shared_engine import flush_logs

log = logging.getLogger(__name__)

SUPPORTED = ((27, 0), (28, 0))  # gunicorn versions from, and below; as in pyproject.toml
INTERNALS: dict[Any, tuple[str, ...]] = {
    gthread.ThreadWorker: ("accept", "handle", "handle_request", "on_pending_socket_readable",
                           "enqueue_req", "finish_request", "murder_pending", "run",
                           "handle_error", "handle_exit", "set_accept_enabled"),
    gthread.TConn: ("init", "close"),
    util: ("write_error", "write_nonblock"),
}
_CHUNK = 64 * 1024
_PAUSE_ACCEPTING_S = 1.0  # out of descriptors anyway (the app opened files): retry after


def check_internals() -> list[str]:
    """What this module needs from gunicorn and did not find; empty when all is there."""
    return missing_internals("gunicorn", SUPPORTED, INTERNALS)


class DeadlinePassed(NoMoreData):
    """The head or body did not arrive in time; gunicorn closes quietly, as on a hang-up."""


class DeadlineSocket:
    """A client socket whose reads fail once ``deadline`` (monotonic seconds) has passed."""

    def __init__(self, sock: Any, send_timeout: float | None = None) -> None:
        self._sock = sock
        self.deadline: float | None = None
        self.expired = False
        self.send_timeout = send_timeout
        self.head = b""  # this request's first bytes, to its request line's end (its error's)

    def sendall(self, data: bytes) -> None:
        """Send ``data``; a wait in which the client takes none of it longer than
        ``send_timeout`` raises TimeoutError (nginx's send_timeout: each wait is bounded,
        not the whole answer)."""
        if self.send_timeout is None:
            self._sock.sendall(data)
            return
        view = memoryview(data)
        self._sock.settimeout(self.send_timeout)
        try:
            while view:
                view = view[self._sock.send(view):]
        finally:
            self._sock.settimeout(None)

    def recv(self, size: int) -> bytes:
        deadline = self.deadline
        if deadline is None:
            return self._kept(self._sock.recv(size))
        # past the deadline, bytes already here are still taken: a client whose complete
        # head waited for a free thread is not the slow one
        remaining = max(0.0, deadline - time.monotonic())
        self._sock.settimeout(remaining)
        try:
            return self._kept(self._sock.recv(size))
        except (TimeoutError, BlockingIOError):
            self.expired = True
            raise DeadlinePassed() from None
        finally:
            self._sock.settimeout(None)

    def _kept(self, data: bytes) -> bytes:
        """``data``, read: the request's first bytes are kept, to its request line's end."""
        if len(self.head) < http_errors.HEAD_KEPT:
            self.head = http_errors.kept_head(self.head, data)
        return data

    def peek(self, size: int) -> bytes:
        """Up to ``size`` of the bytes that arrived, left for the parser (empty past the
        deadline)."""
        remaining = 0.0 if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        self._sock.settimeout(remaining)
        try:
            return bytes(self._sock.recv(size, socket.MSG_PEEK))
        except OSError:
            return b""
        finally:
            self._sock.settimeout(None)

    def fileno(self) -> int:
        return self._sock.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def json_error(status: int, reason: str, message: str, *, max_body_bytes: int,
               head: bool = False, path: str | None = None) -> bytes:
    """A complete HTTP response in the error shape of ``path``'s API family, closing the
    connection."""
    error = http_errors.server_error(status, reason, message, max_body_bytes=max_body_bytes)
    return http_errors.http_response(error, head=head, path=path)


_answering = threading.local()  # of the request gunicorn answers an error to: head, path


def write_json_error(max_body_bytes: int, sock: Any, status_int: int, reason: str,
                     mesg: str) -> None:
    """Replaces ``gunicorn.util.write_error`` (bound to the limit: then the same signature)."""
    head = getattr(_answering, "head", False)
    util.write_nonblock(sock, json_error(status_int, reason, mesg, max_body_bytes=max_body_bytes,
                                         head=head, path=getattr(_answering, "path", None)))


def abort(sock: Any) -> None:
    """Make the coming close reset the connection, dropping what waits in the send buffer
    (a client that reads nothing would otherwise hold it until the kernel gives up)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def close_without_lingering(sock: Any) -> None:
    """Send FIN, drop what the client already sent (so close sends no RST), close."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.setblocking(False)
        for _ in range(16):
            if not sock.recv(_CHUNK):
                break
    except OSError:  # nothing more to read now, or the client is gone
        pass
    finally:
        sock.close()


class _Refused(Exception):
    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class ThreadWorker(gthread.ThreadWorker):
    """gunicorn's gthread worker with head and body deadlines; see the module docstring."""

    def init_process(self) -> None:
        missing = check_internals()
        if missing:
            raise RuntimeError("this gunicorn lacks what embedsvc's worker uses: "
                               + ", ".join(missing) + "; install gunicorn>=27,<28")
        self.settings = Settings.from_env(os.environ)
        # a connection holds its socket only: bodies are read into memory, answers written
        open_files = ensure_open_files(self.cfg.worker_connections)
        self.worker_connections = open_files.connections
        self._paused_until = 0.0
        self._full = False
        self.log.info("worker %d: %s", os.getpid(), open_files)
        util.write_error = partial(write_json_error, self.settings.max_body_bytes)
        super().init_process()

    def run(self) -> None:
        self._probes = self._start_probes()
        self._handling: set[object] = set()  # a token per connection a thread is serving
        self._handling_lock = threading.Lock()
        self._drainer: threading.Thread | None = None
        service = self._service()
        if service is not None:
            service.metrics.open_connections.set_function(lambda: self.nr_conns)
        try:
            super().run()  # returns once every connection is closed, or at graceful_timeout
        finally:
            if self._drainer is not None:
                self._drainer.join(self.settings.drain_timeout_s)
            if self._probes is not None:
                self._probes.stop()

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.booted:
            self._stop_before_boot()
        if self.alive:  # the first SIGTERM: the main loop closes the listener next
            self.method_queue.defer(self._stop_listening)
        super().handle_exit(sig, frame)

    def _stop_before_boot(self) -> None:
        """Told to stop while still warming in post_worker_init: nothing accepted, nothing to
        drain, so exit now. Warming on would start an engine process for a master that is
        stopping; and when the master halts on another worker's failed boot, that engine
        fails the same way, and the second failed boot makes the halting master raise (a
        traceback, exit 1 instead of 3)."""
        log.info("worker %d stops before it served: its master is stopping", os.getpid())
        flush_logs()
        os._exit(0)

    def _stop_listening(self) -> None:
        """Take the connections the kernel has queued, close the listeners, then drain.

        gthread keeps its listener open until the worker exits, so the kernel goes on queueing
        new connections nobody accepts and resets them all at the exit: a POST cut that way
        cannot be retried safely. Closed at once (the master closed its copy before it
        signalled), new connections are refused, and a client or balancer tries elsewhere.
        """
        self.set_accept_enabled(False)
        for listener in self.sockets:
            # the filter is on the kernel's socket: only once the master has closed its copy
            # (it stops, where a reload or fewer workers keep it) is no other worker to serve it
            alone = not drain.held_by(os.getppid(), listener)
            with drain.queue_shut(listener) if alone else contextlib.nullcontext():
                while self._accept_one(listener):
                    pass
            listener.close()
        self.sockets: list[Any] = []
        if self._service() is not None:
            self._drainer = threading.Thread(target=self._drain, name="embedsvc-drain",
                                             daemon=True)
            self._drainer.start()

    def _drain(self) -> None:
        """As `embedsvc serve` drains: the requests arriving now are let in, then the service
        drains (/health says draining, new work gets 503, admitted work finishes)."""
        service = self._service()
        started = time.monotonic()
        computed_before = drain.inputs_computed(service)
        with self._handling_lock:
            arriving = set(self._handling)

        def still_arriving() -> bool:
            with self._handling_lock:
                return not arriving.isdisjoint(self._handling)

        report = drain.drain_service(service, still_arriving,
                                     started + self.settings.drain_timeout_s)
        log.info("%s", drain.summary(time.monotonic() - started,
                                     drain.inputs_computed(service) - computed_before, report))

    def set_accept_enabled(self, enabled: bool) -> None:
        # Past worker_connections the listener stays on, for accept to turn connections away
        # at once; it is off while the worker stops, and for a moment out of descriptors.
        if self.alive:
            enabled = time.monotonic() >= self._paused_until
        super().set_accept_enabled(enabled)

    def accept(self, listener: Any) -> None:
        # The poller may report a listener readable in the same round in which the deferred
        # _stop_listening closed it; accepting on it then would kill the worker mid-drain.
        if listener in self.sockets:
            self._accept_one(listener)

    def _accept_one(self, listener: Any) -> bool:
        """Accept one connection if one is waiting; whether one was."""
        try:
            client, addr = listener.accept()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                self._pause_accepting(e)
                return False
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return e.errno == errno.ECONNABORTED  # that one is gone; more may wait
        if self.nr_conns >= self.worker_connections:
            self._turn_away(client)
            return True
        self._full = False
        self.nr_conns += 1
        sock = DeadlineSocket(client, send_timeout=self.settings.send_timeout_s)
        conn = gthread.TConn(self.cfg, sock, addr, listener.getsockname())
        sock.deadline = conn.timeout = time.monotonic() + self.settings.header_timeout_s
        # no thread until the first byte; murder_pending closes it at its head deadline
        self.pending_conns.append(conn)
        self.poller.register(sock, selectors.EVENT_READ,
                             partial(self.on_pending_socket_readable, conn))
        return True

    def _turn_away(self, client: socket.socket) -> None:
        if not self._full:
            log.warning("%d connections open, the bound (MAX_CONNECTIONS and the open-files "
                        "limit): new connections get 503 until some close", self.nr_conns)
            self._full = True
        http_errors.turn_away(client, http_errors.too_many_connections(self.worker_connections))
        self._count_closed("too_many_connections")

    def _pause_accepting(self, exc: OSError) -> None:
        log.warning("out of descriptors (%s) with %d connections open: not accepting for "
                    "%.0fs; lower MAX_CONNECTIONS or raise the open-files limit",
                    exc, self.nr_conns, _PAUSE_ACCEPTING_S)
        self._paused_until = time.monotonic() + _PAUSE_ACCEPTING_S
        self.set_accept_enabled(False)

    def murder_pending(self) -> None:
        waiting = len(self.pending_conns)
        super().murder_pending()
        for _ in range(waiting - len(self.pending_conns)):
            self._count_closed("header_timeout")  # no first byte by the head's deadline

    def finish_request(self, conn: Any, fs: Any) -> None:
        # gunicorn closes with util.close_graceful, which lingers up to 2 s reading from the
        # client, on the main loop: a client that keeps trickling stalls every connection.
        if not fs.cancelled() and fs.exception() is None and fs.result() is False:
            self.nr_conns -= 1
            close_without_lingering(conn.sock)
            return
        super().finish_request(conn, fs)

    def handle(self, conn: Any) -> Any:
        sock = conn.sock
        if getattr(conn, "served", False):  # kept alive: the head's clock starts now
            sock.deadline = time.monotonic() + self.settings.header_timeout_s
        elif hint := http_errors.not_http(sock.peek(64)):  # else gunicorn waits for a line end
            self._answer(sock, http_errors.server_error(
                400, "Bad Request", hint, max_body_bytes=self.settings.max_body_bytes), "-", "-")
            return False
        conn.served = True
        # this request's first bytes: those gunicorn's parser read ahead with the last
        # request, then the rest as they are read
        parser = getattr(conn, "parser", None)
        ahead = parser.unreader.buf.getvalue() if parser is not None else b""
        sock.head = ahead[:http_errors.HEAD_KEPT]
        token = object()
        with self._handling_lock:
            self._handling.add(token)
        try:
            return super().handle(conn)
        finally:
            with self._handling_lock:
                self._handling.discard(token)
            if sock.expired:
                sock.expired = False
                self._count_closed("header_timeout")
            sock.deadline = None

    def handle_error(self, req: Any, client: Any, addr: Any, exc: Exception) -> None:
        # gunicorn writes its error answer without the method; a HEAD's carries no body
        # gunicorn's parser fails without the request it had read the line of: the path comes
        # from the request's first bytes
        read = req or getattr(exc, "req", None)
        method, path = getattr(read, "method", None), getattr(read, "path", None)
        if path is None:
            method, path = http_errors.request_line(getattr(client, "head", b"")) or (
                method, None)
        _answering.head, _answering.path = method == "HEAD", path
        try:
            super().handle_error(req, client, addr, exc)
        finally:
            _answering.head, _answering.path = False, None

    def handle_request(self, req: Any, conn: Any) -> bool:
        try:
            req.body = io.BytesIO(self._read_body(req, conn.sock))
        except _Refused as refused:
            self._answer(conn.sock, refused.error, req.method, req.path)
            return False
        try:
            return super().handle_request(req, conn)
        except TimeoutError:  # DeadlineSocket.sendall: the client took nothing for a while
            log.info("%s %s: the client read nothing of its answer for %.0fs "
                     "(SEND_TIMEOUT_S); closing", req.method, req.path,
                     self.settings.send_timeout_s)
            self._count_closed("send_timeout")
            abort(conn.sock)
            return False

    def _answer(self, sock: Any, error: ApiError, method: str, path: str) -> None:
        """Write the HTTP server's own answer ``error`` (the connection then closes)."""
        util.write(sock, http_errors.http_response(error, path=path, head=method == "HEAD"))
        self.log.info("%s %s %d (answered by the HTTP server)", method, path, error.status)
        service = self._service()
        if service is not None:
            service.metrics.count_request("unmatched", error.status, 0.0)

    def _read_body(self, req: Any, sock: DeadlineSocket) -> bytes:
        """The whole body, within BODY_TIMEOUT_S and MAX_BODY_BYTES, before the app runs."""
        limit = self.settings.max_body_bytes
        headers = dict(req.headers)
        length = headers.get("CONTENT-LENGTH")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _Refused(body_too_large(limit, int(length)))
        if headers.get("EXPECT", "").lower() == "100-continue":
            util.write(sock, b"HTTP/1.1 100 Continue\r\n\r\n")
            req.headers = [(k, v) for k, v in req.headers if k != "EXPECT"]
        sock.deadline = time.monotonic() + self.settings.body_timeout_s
        parts, total = [], 0
        try:
            while data := req.body.read(min(_CHUNK, limit + 1 - total)):
                parts.append(data)
                total += len(data)
                if total > limit:
                    raise _Refused(body_too_large(limit))
        except DeadlinePassed:
            sock.expired = False
            self._count_closed("body_timeout")
            raise _Refused(http_errors.server_error(408, "Request Timeout", "",
                                                    max_body_bytes=limit)) from None
        finally:
            sock.deadline = None
        return b"".join(parts)

    def _service(self) -> Any:
        try:
            return self.wsgi.service
        except Exception:  # noqa: BLE001 - not embedsvc's app, or it failed to build
            return None

    def _count_closed(self, reason: str) -> None:
        service = self._service()
        if service is not None:
            service.metrics.connections_closed.labels(reason=reason).inc()

    def _start_probes(self) -> ProbeListener | None:
        if self.settings.health_port is None:
            return None
        try:
            probes = ProbeListener(self.wsgi, self.settings)
        except OSError as exc:  # another worker of this master holds the port
            self.log.warning("probe port %s not served by worker %d: %s",
                             self.settings.health_port, os.getpid(), exc)
            return None
        probes.start()
        return probes
