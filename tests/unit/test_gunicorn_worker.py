"""The gunicorn worker: internals it relies on, deadline reads and JSON errors."""

import json
import os
import socket
import threading
import time

import pytest

from embedsvc.serving import gunicorn_worker, internals
from embedsvc.serving.gunicorn_worker import DeadlinePassed, DeadlineSocket, json_error


def test_every_gunicorn_internal_the_worker_uses_is_there():
    assert gunicorn_worker.check_internals() == []


def test_an_unknown_gunicorn_version_is_named(monkeypatch):
    monkeypatch.setattr(internals, "version", lambda name: "30.1")
    assert any("30.1" in m for m in gunicorn_worker.check_internals())


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield DeadlineSocket(a), b
    a.close()
    b.close()


def test_a_read_past_the_deadline_fails_without_waiting(pair):
    sock, _ = pair
    sock.deadline = time.monotonic() - 1
    with pytest.raises(DeadlinePassed):
        sock.recv(10)
    assert sock.expired


def test_bytes_already_here_are_read_after_the_deadline(pair):
    sock, peer = pair
    peer.sendall(b"GET / HTTP/1.1\r\n\r\n")
    sock.deadline = time.monotonic() - 1
    assert sock.recv(100) == b"GET / HTTP/1.1\r\n\r\n"


def test_a_trickle_is_cut_at_the_deadline(pair):
    sock, peer = pair
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.05):
            peer.send(b"x")

    thread = threading.Thread(target=trickle)
    thread.start()
    sock.deadline = time.monotonic() + 0.5
    got = b""
    try:
        with pytest.raises(DeadlinePassed):
            for _ in range(1000):  # bounded: 0.05 s a byte would take 50 s
                got += sock.recv(1)
    finally:
        stop.set()
        thread.join(5)
    assert 0 < len(got) < 100


def test_a_listener_event_after_the_listeners_closed_is_ignored():
    # SIGTERM's deferred _stop_listening and a new connection can be reported by the same
    # poll: the listener's event is then dispatched after the listener was closed
    listener = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(listener.getsockname())
    listener.close()
    worker = gunicorn_worker.ThreadWorker.__new__(gunicorn_worker.ThreadWorker)
    worker.sockets, worker.nr_conns = [], 0
    worker.accept(listener)
    assert worker.nr_conns == 0
    peer.close()


def test_errors_are_complete_json_responses():
    raw = json_error(431, "Request Header Fields Too Large", "too many headers",
                     max_body_bytes=100)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ") and b"application/json" in head
    assert int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]) == len(body)
    err = json.loads(body)["error"]
    assert err["code"] == "request_header_fields_too_large"
    body = json_error(500, "Internal Server Error", "/a/path",
                      max_body_bytes=100).partition(b"\r\n\r\n")[2]
    assert json.loads(body)["error"]["code"] == "internal_error" and b"/a/path" not in body


def test_a_send_nobody_reads_times_out_and_a_slow_reader_is_not_cut():
    a, b = socket.socketpair()
    try:
        sock = DeadlineSocket(a, send_timeout=0.5)
        with pytest.raises(TimeoutError):
            sock.sendall(b"x" * (8 << 20))  # far more than the socket buffers hold
    finally:
        a.close()
        b.close()
    a, b = socket.socketpair()
    got = []

    def slow_reader():  # takes some every 0.2 s: each wait is shorter than the timeout
        while chunk := b.recv(1 << 20):
            got.append(len(chunk))
            time.sleep(0.2)

    thread = threading.Thread(target=slow_reader)
    thread.start()
    try:
        DeadlineSocket(a, send_timeout=0.5).sendall(b"x" * (1 << 20))
    finally:
        a.close()
        thread.join(30)
        b.close()
    assert sum(got) == 1 << 20


def test_the_listener_is_closed_to_new_connections_only_when_the_master_let_go_of_it():
    """The worker keeps new connections out of the listener's queue (a filter on the
    kernel's socket) only when its master no longer holds it: on a reload, or with fewer
    workers, the master keeps it for the workers that go on serving."""
    import subprocess
    import sys

    from embedsvc.serving import drain

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        assert drain.held_by(os.getpid(), listener)
        holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                  stdin=subprocess.PIPE, pass_fds=[listener.fileno()])
        other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                 stdin=subprocess.PIPE)
        try:
            assert drain.held_by(holder.pid, listener)
            assert not drain.held_by(other.pid, listener)
        finally:
            for proc in (holder, other):
                proc.communicate(b"")
        assert drain.held_by(2**22 + 1, listener)  # no such process: cannot be told, held
