"""The waitress adapter: the internals it relies on are where it expects them."""

import contextlib
import dataclasses
import errno
import json
import re
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from waitress.utilities import BadRequest, Error, RequestEntityTooLarge

from embedsvc.serving import internals, waitress_adapter
from embedsvc.serving.waitress_adapter import Bounds, RequestTimeout, error_body

BOUNDS = Bounds(header_timeout_s=1, body_timeout_s=1, idle_timeout_s=1, max_connections=4,
                max_body_bytes=100)


def test_every_waitress_internal_the_adapter_uses_is_there():
    assert waitress_adapter.check_internals() == []


def test_a_built_server_has_the_instance_state_the_drain_reads():
    server = waitress_adapter.create(lambda e, s: [], host="127.0.0.1", port=0, threads=1,
                                     bounds=BOUNDS, ident="test")
    try:
        missing = [n for n in waitress_adapter.SERVER_INSTANCE if not hasattr(server, n)]
        assert missing == []
        assert server.adj.asyncore_use_poll  # select() fails on a descriptor above 1023
        assert server.adj.outbuf_high_watermark == waitress_adapter.ANSWER_IN_MEMORY
        assert server.adj.recv_bytes < server.adj.inbuf_overflow  # a read spills one body
        assert server.adj.max_request_body_size == BOUNDS.max_body_bytes + 1
        deadline = time.monotonic() + 5  # its threads count as active until they first wait
        while waitress_adapter.any_busy(server) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not waitress_adapter.any_busy(server)
    finally:
        waitress_adapter.start_draining(server)
        waitress_adapter.close(server)
        server.task_dispatcher.shutdown(timeout=1)


def test_close_soon_ends_the_loop_whose_wake_up_pipe_is_closed(caplog):
    server = waitress_adapter.create(lambda e, s: [], host="127.0.0.1", port=0, threads=1,
                                     bounds=BOUNDS, ident="test")
    loop = threading.Thread(target=server.run)
    loop.start()
    client = socket.create_connection(("127.0.0.1", server.effective_port))
    try:
        deadline = time.monotonic() + 5
        while waitress_adapter.open_connections(server) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waitress_adapter.open_connections(server) == 1
        # as the loop does when a read of its pipe fails: the trigger leaves the map, closed
        waitress_adapter.in_loop(server, server.trigger.close)
        while not server.trigger._closed and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(OSError):
            waitress_adapter.in_loop(server, lambda: None)
        waitress_adapter.start_draining(server)
        waitress_adapter.close_soon(server)
        loop.join(5)
        assert not loop.is_alive(), "the loop did not end"
        assert "wake-up pipe is closed" in caplog.text
        assert client.recv(10) == b""  # its connection was closed
    finally:
        client.close()
        server.task_dispatcher.shutdown(timeout=1)


class _Listener:
    """A listening socket whose next accept meets a client that left while queued
    (ECONNABORTED), then the real ones; or one with four times ``storm`` in its queue."""

    def __init__(self, sock: socket.socket, storm: int = 0,
                 error: OSError | None = None) -> None:
        self._sock = sock
        self.error = error or ConnectionAbortedError(errno.ECONNABORTED, "connection abort")
        self.aborted = False
        self.storm = storm
        self.accepts = 0

    def accept(self):
        self.accepts += 1
        if self.storm:  # clients that connect as fast as the loop accepts, for a while
            if self.accepts > 4 * self.storm:
                raise BlockingIOError(11, "Resource temporarily unavailable")
            return socket.socketpair()[0], ("127.0.0.1", 40000 + self.accepts)
        if not self.aborted:
            self.aborted = True
            raise self.error
        return self._sock.accept()

    def __getattr__(self, name):
        return getattr(self._sock, name)


@pytest.mark.parametrize("error", [ConnectionAbortedError(errno.ECONNABORTED, "abort"),
                                   OSError(errno.EPROTO, "Protocol error")],
                         ids=["aborted", "network-error"])
def test_the_drain_takes_the_connections_queued_behind_one_that_left(error):
    """waitress's accept reads ECONNABORTED (a queued client that reset) as an empty
    queue: the drain stopped there and closed the listener on every connection queued
    behind it, which were reset. Linux's accept also returns the network errors pending on
    one connection (EPROTO, ENETDOWN...), to be retried."""
    server = waitress_adapter.create(lambda e, s: [], host="127.0.0.1", port=0, threads=1,
                                     bounds=dataclasses.replace(BOUNDS, max_connections=8),
                                     ident="test")
    clients = [socket.create_connection(("127.0.0.1", server.effective_port))
               for _ in range(3)]
    try:
        listener = server.socket = _Listener(server.socket, error=error)
        waitress_adapter.start_draining(server)
        assert listener.aborted and waitress_adapter.open_connections(server) == 3
    finally:
        for client in clients:
            client.close()
        waitress_adapter.close(server)
        server.task_dispatcher.shutdown(timeout=1)


def test_the_drain_takes_at_most_a_backlog_of_connections():
    """The drain's accepts run in the loop's thread, where every other connection waits:
    a storm of new connections kept it there, past the drain's deadline."""
    server = waitress_adapter.create(lambda e, s: [], host="127.0.0.1", port=0, threads=1,
                                     bounds=dataclasses.replace(BOUNDS, max_connections=10_000),
                                     ident="test")
    try:
        listener = server.socket = _Listener(server.socket, storm=server.adj.backlog)
        waitress_adapter.start_draining(server)
        assert listener.accepts == server.adj.backlog and server.socket is None
    finally:
        waitress_adapter.close(server)
        server.task_dispatcher.shutdown(timeout=1)


class _LateClient:
    """A listening socket whose queue a client joins, its request sent, just after the
    drain's last accept found the queue empty (as when the loop waits to get the
    interpreter lock back after that accept), and before the listener closes."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.client: socket.socket | None = None
        self.made = False

    def accept(self):
        try:
            return self._sock.accept()
        except BlockingIOError:
            if self.client is None:
                self.client = socket.socket()
                self.client.setblocking(False)
                self.client.connect_ex(self._sock.getsockname())
                _, writable, _ = select.select([], [self.client], [], 0.3)
                if writable and not self.client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    self.made = True  # queued: its request waits for an accept
                    self.client.sendall(b"POST /embed HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
            raise

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def outcome(self) -> str:
        """What the client met once the listener closed."""
        assert self.client is not None
        select.select([self.client], [self.client], [], 5)
        error = self.client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            return errno.errorcode[error]
        try:
            return "answered" if self.client.recv(100) else "closed"
        except OSError as exc:
            return errno.errorcode[exc.errno]


def test_a_client_arriving_as_the_drain_closes_the_listener_is_refused_not_reset():
    """The drain took the queued connections, then closed the listener; a client that
    connected in between was queued, sent its request, and was reset by the close (one
    run in ten of the gunicorn SIGTERM test). Now it is kept out of the queue: its
    connection is not made, and is refused once the listener is gone."""
    server = waitress_adapter.create(lambda e, s: [], host="127.0.0.1", port=0, threads=1,
                                     bounds=BOUNDS, ident="test")
    listener = server.socket = _LateClient(server.socket)
    try:
        waitress_adapter.start_draining(server)
        assert server.socket is None and listener.client is not None
        assert not listener.made
        assert listener.outcome() == "ECONNREFUSED"
    finally:
        if listener.client is not None:
            listener.client.close()
        waitress_adapter.close(server)
        server.task_dispatcher.shutdown(timeout=1)


def test_the_drain_leaves_a_listener_held_elsewhere_as_it_found_it():
    """The filter that keeps connections out of the queue is on the kernel's socket: where
    another process keeps that socket past this one (systemd's socket activation, for the
    next start), it must come off, or every later connection would be dropped."""
    server = waitress_adapter.create(lambda e, s: [], host="127.0.0.1", port=0, threads=1,
                                     bounds=BOUNDS, ident="test")
    kept = server.socket.dup()  # as the socket's other holder
    try:
        waitress_adapter.start_draining(server)
        assert server.socket is None
        client = socket.create_connection(kept.getsockname(), timeout=0.5)  # queued at once
        client.close()
    finally:
        kept.close()
        waitress_adapter.close(server)
        server.task_dispatcher.shutdown(timeout=1)


def test_the_probe_listener_leaves_the_queue_of_a_socket_the_other_fronts_serve_open():
    """The fronts of `embedsvc serve --workers N` share one probe socket, which the
    supervisor keeps until the last front stops: a front that stops its probes must not shut
    that socket's queue under the others (their probes' connections would wait a second)."""
    from embedsvc.serving.probe import ProbeListener
    from embedsvc.settings import Settings

    shared = socket.socket()
    shared.bind(("127.0.0.1", 0))
    shared.listen(16)
    probes = ProbeListener(lambda e, s: [], Settings(health_port=0), sock=shared.dup())
    listener = probes.server.socket = _LateClient(probes.server.socket)
    probes.start()
    try:
        probes.stop()
        assert listener.client is not None and listener.made  # queued for another front
    finally:
        if listener.client is not None:
            listener.client.close()
        shared.close()


def test_an_unknown_waitress_version_is_named(monkeypatch):
    monkeypatch.setattr(internals, "version", lambda name: "9.0.0")
    assert any("9.0.0" in m for m in waitress_adapter.check_internals())
    with pytest.raises(RuntimeError, match="waitress>=3.0,<3.1"):
        waitress_adapter.create(lambda e, s: [], host="127.0.0.1", port=0, threads=1,
                                bounds=BOUNDS, ident="test")


@pytest.mark.parametrize("err, code", [
    (RequestEntityTooLarge("exceeds max_body of 101"), "body_too_large"),
    (BadRequest("bad content-length"), "bad_request"),
    (RequestTimeout("late"), "request_timeout"),
])
def test_waitress_errors_become_the_json_error_shape(err, code):
    body = json.loads(error_body(err, 100))["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["code"] == code and body["type"] == "invalid_request_error"


def test_a_server_side_error_says_nothing_of_its_details():
    body = json.loads(error_body(Error("Traceback: /secret/path"), 100))["error"]
    assert "secret" not in body["message"] and body["code"] == "internal_error"


@contextlib.contextmanager
def serving(app, threads: int = 1, bounds: Bounds = BOUNDS) -> Iterator[waitress_adapter.Server]:
    """An adapter server for ``app`` with its loop in a thread; closed on exit."""
    server = waitress_adapter.create(app, host="127.0.0.1", port=0, threads=threads,
                                     bounds=bounds, ident="test")
    loop = threading.Thread(target=server.run)
    loop.start()
    try:
        yield server
    finally:
        waitress_adapter.close_soon(server)
        loop.join(5)
        server.task_dispatcher.shutdown(timeout=1)


def answering(body: bytes):
    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", str(len(body)))])
        return [body]

    return app


def wait_for(condition, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.effective_port), timeout=5)


def test_a_connection_past_the_bound_gets_503_and_is_closed():
    with serving(answering(b"ok")) as server:
        held = [connect(server) for _ in range(BOUNDS.max_connections)]
        wait_for(lambda: waitress_adapter.open_connections(server) == BOUNDS.max_connections)
        with connect(server) as extra:
            answer = b""
            while chunk := extra.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        held.pop().close()  # one leaves: the next is served
        wait_for(lambda: waitress_adapter.open_connections(server) < BOUNDS.max_connections)
        with connect(server) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 200")
        for sock in held:
            sock.close()


def test_a_stalled_connection_its_client_closed_first_is_not_counted_as_reset():
    """The sweep marks a stalled connection and its reset runs one loop round later; a
    client that closed in between was not reset, and is not counted as one."""
    with serving(answering(b"ok")) as server:
        closed: list[str] = []
        server.on_close = closed.append
        with connect(server):
            wait_for(lambda: len(server.channels()) == 1)
            [channel] = server.channels()
        wait_for(lambda: not channel.connected)  # its client's close, seen by the loop
        server._abort(channel)
        assert closed == []


def answer_files(server) -> list[int]:
    return [sum(1 for b in ch.outbufs if b.overflowed) for ch in server.channels()]


def test_pipelined_answers_never_read_hold_at_most_two_temporary_files_and_no_thread():
    """Eight 4 MB answers asked at once and not read (more than the kernel's buffers take):
    the requests after the second wait for the answers before them to leave, in the loop,
    not in a request thread."""
    big = b"x" * (4 << 20)
    with serving(answering(big)) as server:  # one request thread
        greedy = connect(server)
        greedy.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 8)
        wait_for(lambda: any(ch.parked for ch in server.channels()))
        assert answer_files(server) in ([1], [2])  # as many as the kernel left waiting
        with connect(server) as other:  # the one thread is free for another client
            other.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while len(got) < len(big):
                got += other.recv(1 << 20)
        taken = 0
        while taken < 8 * len(big):  # reading on, the greedy client gets all eight
            chunk = greedy.recv(1 << 20)
            assert chunk, "closed early"
            taken += len(chunk)
            assert max(answer_files(server), default=0) <= 2
        greedy.close()


def test_a_connection_reads_ahead_at_most_one_body_in_a_temporary_file():
    """Pipelined uploads past the in-memory share: the body being served and the next one
    are held in files; the rest are not read until the first is answered."""
    release = threading.Event()

    def app(environ, start):
        environ["wsgi.input"].read()
        release.wait(5)
        start("200 OK", [])
        return [b"ok"]

    body = b"x" * (waitress_adapter.BODY_IN_MEMORY + 1000)
    upload = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    bounds = Bounds(header_timeout_s=5, body_timeout_s=5, idle_timeout_s=5, max_connections=4,
                    max_body_bytes=len(body))
    with serving(app, bounds=bounds) as server:
        client = connect(server)
        sender = threading.Thread(target=client.sendall, args=(upload * 4,))
        sender.start()
        wait_for(lambda: sum(ch.body_files() for ch in server.channels()) == 2)
        time.sleep(0.2)  # reading on would spill a third
        [channel] = server.channels()
        assert channel.body_files() == 2 and not channel.readable()
        release.set()
        sender.join(10)
        answers = b""
        while answers.count(b"HTTP/1.1 200") < 4:
            chunk = client.recv(65536)
            assert chunk, answers
            answers += chunk
        client.close()


def test_the_rest_of_a_refused_body_read_as_the_refusal_closes_gets_no_second_answer(
        monkeypatch):
    """A 413 at the head, its request thread done (the connection closing), and one more read
    of the body in the same loop turn: those bytes begin no request, and are dropped, not
    answered a 400 after the 413 on the same connection (seen about once in 100 such
    uploads under `embedsvc serve`, one process or --workers 2)."""
    server = waitress_adapter.create(answering(b"ok"), host="127.0.0.1", port=0, threads=1,
                                     bounds=BOUNDS, ident="test")
    queued: list = []
    monkeypatch.setattr(server, "add_task", queued.append)  # the request thread, run below
    ours, theirs = socket.socketpair()
    try:
        channel = waitress_adapter.Channel(server, ours, ("127.0.0.1", 1), server.adj, map={})
        channel.received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        assert queued == [channel] and channel.requests[0].error.code == 413
        channel.service()  # as the request thread: the 413 written, the connection closing
        assert channel.close_when_flushed and channel.requests == []
        channel.received(b" " * 50)  # the body's next bytes, in a read already under way
        assert channel.requests == [] and queued == [channel]
        channel.handle_write()
        answer = b""
        while chunk := theirs.recv(65536):
            answer += chunk
        assert answer.count(b"HTTP/1.") == 1 and answer.startswith(b"HTTP/1.1 413")
    finally:
        theirs.close()
        ours.close()
        waitress_adapter.close(server)
        server.task_dispatcher.shutdown(timeout=1)


def test_the_loop_leaves_an_answer_to_the_request_thread_flushing_it(monkeypatch):
    """While a request thread flushes its answer in write_soon (holding the output lock, its
    send releasing the GIL), the loop does not poll the connection for writing: it would find
    the lock taken and turn again at once, about ten turns an answer under 32 clients. What
    the client did not take is the loop's to send once the thread is out; a thread waiting
    for the loop to take its output below the high-water mark has the loop meanwhile."""
    server = waitress_adapter.create(answering(b"ok"), host="127.0.0.1", port=0, threads=1,
                                     bounds=BOUNDS, ident="test")
    pulls: list = []
    monkeypatch.setattr(server, "pull_trigger", lambda *args: pulls.append(args))
    ours, theirs = socket.socketpair()
    try:
        channel = waitress_adapter.Channel(server, ours, ("127.0.0.1", 1), server.adj, map={})
        seen: list[bool] = []
        sends = channel._flush_some

        def flush(do_close: bool = True) -> bool:
            seen.append(channel.writable())  # what the loop would see now
            return sends(do_close=do_close)

        monkeypatch.setattr(channel, "_flush_some", flush)
        channel.write_soon(b"x" * 100)
        assert seen == [False]
        assert theirs.recv(200) == b"x" * 100 and not channel.writable() and pulls == []

        def takes_nothing(do_close: bool = True) -> bool:
            seen.append(channel.writable())
            return False

        monkeypatch.setattr(channel, "_flush_some", takes_nothing)
        channel.write_soon(b"y" * 100)
        assert seen == [False, False]
        assert channel.writable() and pulls  # the loop is woken, and sends the rest
        # A thread waits in write_soon while its output is above the high-water mark, and
        # the loop wakes it once the output is below: output left exactly at the mark is
        # the loop's to send too, or the thread waits until the send timeout resets it.
        channel.writing = True
        channel.total_outbufs_len = server.adj.outbuf_high_watermark + 1
        assert channel.writable()
        channel.total_outbufs_len = server.adj.outbuf_high_watermark
        assert channel.writable()
        channel.total_outbufs_len = server.adj.outbuf_high_watermark - 1
        assert not channel.writable()
    finally:
        theirs.close()
        ours.close()
        waitress_adapter.close(server)
        server.task_dispatcher.shutdown(timeout=1)


def test_an_answer_still_leaving_is_not_closed_as_an_idle_connection():
    """A client reading a large answer slowly keeps the kernel's send buffer full, so no send
    succeeds for longer than the idle timeout: waitress took that for an idle connection and
    closed it mid-answer (a 9.7 MB answer read through a 4 KiB receive buffer was cut at
    6.3 MB). Only a connection with nothing to send is idle; SEND_TIMEOUT_S bounds the other."""
    server = waitress_adapter.create(answering(b"ok"), host="127.0.0.1", port=0, threads=1,
                                     bounds=BOUNDS, ident="test")
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        leaving, idle = (waitress_adapter.Channel(server, ours, ("127.0.0.1", 1), server.adj,
                                                  map=server._map) for ours, _ in pairs)
        long_ago = time.time() - 10 * server.adj.channel_timeout
        leaving.last_activity = idle.last_activity = long_ago
        leaving.total_outbufs_len = 4096  # an answer's rest, waiting for the client's window
        server.maintenance(time.time())
        assert not leaving.will_close
        assert idle.will_close
    finally:
        for pair in pairs:
            for sock in pair:
                sock.close()
        waitress_adapter.close(server)
        server.task_dispatcher.shutdown(timeout=1)


def test_a_body_still_arriving_is_not_closed_as_an_idle_connection():
    """A request whose body stops short is the body timeout's to answer (408), not the idle
    sweep's: with IDLE_TIMEOUT_S (30 s by default) below BODY_TIMEOUT_S (60 s), the sweep
    closed it first, and the client got no answer at all."""
    bounds = Bounds(header_timeout_s=3, body_timeout_s=3, idle_timeout_s=1, max_connections=4,
                    max_body_bytes=1000)
    with serving(answering(b"ok"), bounds=bounds) as server, connect(server) as sock:
        sock.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        sock.settimeout(10)
        started = time.monotonic()
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
        assert time.monotonic() - started > 2  # at the body timeout, not the idle one


def test_a_head_with_content_length_and_chunked_is_refused_and_its_connection_closed():
    """Content-Length beside Transfer-Encoding: chunked is how a request is smuggled past a
    proxy that reads the length: 400, as gunicorn answers it, and the connection closed
    (RFC 9112, 6.1), so the bytes after the chunked body are never read as a request."""
    body = b'{"input": "a"}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    head = (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Length: %d\r\n\r\n" % len(chunked + smuggled))
    with serving(answering(b"ok")) as server, connect(server) as sock:
        sock.sendall(head + chunked + smuggled)
        answer = b""
        while chunk := sock.recv(65536):  # closed by the server, else the timeout fails it
            answer += chunk
    assert answer.count(b"HTTP/1.") == 1 and answer.startswith(b"HTTP/1.1 400")
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "bad_request" and "Transfer-Encoding" in error["message"]


def test_a_chunk_announced_past_the_body_limit_gets_413_at_once():
    """A chunk size line that alone takes the body past MAX_BODY_BYTES is a 413 as soon as
    it is read, in the JSON shape: waitress counted a chunk's bytes only as they came, so a
    client that announced a huge chunk and sent nothing more waited for the body's deadline
    and got 408. A body within the limit, in chunks, is still read whole."""
    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    bounds = dataclasses.replace(BOUNDS, body_timeout_s=5, max_body_bytes=1000)
    with serving(answering(b"ok"), bounds=bounds) as server:
        with connect(server) as sock:
            sock.sendall(head + b"%x\r\n" % 5000 + b"!" * 10)
            started, answer = time.monotonic(), b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert time.monotonic() - started < 2.5  # not the body's deadline, 5 s
        assert answer.startswith(b"HTTP/1.1 413") and answer.count(b"HTTP/1.") == 1
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "body_too_large"
        # exactly the limit in one chunk: with its framing the body's bytes pass it, which
        # waitress refuses once they are read; known at the size line
        with connect(server) as sock:
            sock.sendall(head + b"%x\r\n" % 1000)
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:100]
        with connect(server) as sock:  # within it, in chunks: read whole
            sock.sendall(head + b"%x\r\n%s\r\n" % (500, b"!" * 500) + b"%x\r\n%s\r\n" % (
                400, b"!" * 400) + b"0\r\n\r\n")
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
        # the most waitress takes in one chunk (its framing counted: 5 + 988 + 2 + 5 bytes)
        with connect(server) as sock:
            sock.sendall(head + b"%x\r\n%s\r\n0\r\n\r\n" % (988, b"!" * 988))
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:100]


def test_an_upload_refused_at_its_head_gets_413_at_once_not_100_continue():
    """`Expect: 100-continue` (curl sends it for bodies over 1 MiB) with a Content-Length
    past MAX_BODY_BYTES: 413 at once. waitress sent 100 Continue and took the refused request
    back to wait for its body: 408 at the body's deadline, or 413 only after MAX_BODY_BYTES
    of an upload it had already refused."""
    head = b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 1000\r\n\r\n"
    with serving(answering(b"ok")) as server, connect(server) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and answer.count(b"HTTP/1.") == 1
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "body_too_large"


def _answer_of(port: int, request: bytes) -> bytes:
    """The whole answer to ``request`` on a connection that closes after it."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        out = b""
        while chunk := sock.recv(1 << 16):
            out += chunk
    return out


@pytest.mark.parametrize(("method", "body", "length", "writes"), [
    ("GET", b"ok" * 50, True, 1),  # head and body in one write: one send
    ("GET", b"x" * (waitress_adapter._HEAD_WITH_BODY + 1), True, 2),  # a copy too large
    ("GET", b"ok" * 50, False, 3),  # chunked, as waitress writes it: head, chunk, last chunk
    ("HEAD", b"ok" * 50, True, 1),  # the head alone
])
def test_an_answers_head_leaves_with_its_body_in_one_write(monkeypatch, method, body, length,
                                                            writes):
    """waitress wrote the head of every answer alone, then its body, each sent at once: two
    sends and two packets an answer. A body of Content-Length bytes now goes with its head,
    and the client reads the same answer; the other cases are written as waitress writes
    them."""
    written: list[bytes] = []
    write_soon = waitress_adapter.Channel.write_soon

    def spy(channel, data):
        written.append(bytes(data))
        return write_soon(channel, data)

    monkeypatch.setattr(waitress_adapter.Channel, "write_soon", spy)

    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", str(len(body)))] if length else [])
        if environ["REQUEST_METHOD"] == "HEAD":
            return []
        return [body] if length else iter([body])  # no length said or known: chunked

    with serving(app, bounds=dataclasses.replace(BOUNDS, max_body_bytes=1 << 20)) as server:
        got = _answer_of(server.effective_port,
                         f"{method} / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and len(written) == writes, (head, written)
    assert b"".join(written) == got
    if method == "HEAD":
        assert rest == b"" and f"Content-Length: {len(body)}".encode() in head
    elif length:
        assert rest == body and f"Content-Length: {len(body)}".encode() in head
    else:
        assert b"Transfer-Encoding: chunked" in head
        assert rest == f"{len(body):X}\r\n".encode() + body + b"\r\n0\r\n\r\n"


class _StubServer:
    def __init__(self, ident: str) -> None:
        self.adj = dataclasses.make_dataclass("Adj", [("ident", str)])(ident)


class _StubChannel:
    def __init__(self, ident: str) -> None:
        self.server = _StubServer(ident)


class _StubRequest:
    def __init__(self, version: str, connection: str | None) -> None:
        self.version = version
        self.headers = {} if connection is None else {"CONNECTION": connection}


_HEADERS = [
    [("Content-Type", "application/json"), ("Content-Length", "12"), ("x-total-time", "1.5")],
    [("content-type", "text/plain"), ("X-Queue-Time", "0.1"), ("x-compute-tokens", "3")],
    [("Content-Length", "0"), ("Date", "Thu, 01 Jan 1970 00:00:00 GMT"), ("server", "app")],
    [("Set-Cookie", "a=1"), ("set-cookie", "b=2"), ("CONNECTION", "close")],
    [],
]


def test_an_answers_head_is_the_one_waitress_builds():
    """``Task.build_response_header`` keeps each name's spelling and the date instead of
    building them for every answer: the same bytes as waitress's own, and the same choice
    of chunked encoding and of closing the connection, for every mix of protocol version,
    Connection header, status, the app's headers, a known length and the server's name."""
    import itertools

    from waitress.task import WSGITask

    cases = itertools.product(["1.0", "1.1"], [None, "keep-alive", "close", "Keep-Alive"],
                              ["200 OK", "204 No Content", "304 Not Modified", "404 Not Found"],
                              _HEADERS, [None, 12], ["embedsvc", ""])
    for version, connection, status, headers, length, ident in cases:
        built = []
        for cls in (WSGITask, waitress_adapter.Task):
            task = cls(_StubChannel(ident), _StubRequest(version, connection))
            task.status, task.response_headers = status, list(headers)
            task.content_length, task.start_time = length, 1_765_000_000.25
            head = task.build_response_header()
            built.append((head, task.chunked_response, task.close_on_finish,
                          task.response_headers))
        assert built[0] == built[1], (version, connection, status, headers, length, ident)


def test_waitress_own_500_for_an_app_that_raised_answers_its_request_head_and_route():
    """waitress answers an app that raised with a 500 built on a parser of its own, which
    had lost the request's method and path: a HEAD got the body, and every route OpenAI's
    error shape."""
    def app(environ, start_response):
        raise RuntimeError("boom")

    def ask(server, method: str, path: str) -> tuple[bytes, bytes]:
        with connect(server) as sock:
            sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(65536):  # the 500 closes the connection
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 500 "), head
        length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
        assert length > 0
        return head, body

    with serving(app) as server:
        _, body = ask(server, "HEAD", "/v1/embeddings")
        assert body == b""
        _, body = ask(server, "GET", "/v1/embeddings")
        assert json.loads(body)["error"]["code"] == "internal_error"  # OpenAI's shape
        _, body = ask(server, "POST", "/api/embed")
        assert isinstance(json.loads(body)["error"], str)  # Ollama's shape
