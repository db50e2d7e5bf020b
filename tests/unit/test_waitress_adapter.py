"""The waitress adapter: the internals it relies on are where it expects them."""

import json
import socket
import threading
import time

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
        assert server.adj.connection_limit == BOUNDS.max_connections + 2
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
