"""http_errors.py: the HTTP server's own answers, the same from waitress and gunicorn."""

import json

import pytest
from waitress.utilities import BadRequest, RequestEntityTooLarge, RequestHeaderFieldsTooLarge

from embedsvc.api.wsgi import read_body
from embedsvc.errors import PayloadTooLarge
from embedsvc.serving.gunicorn_worker import json_error
from embedsvc.serving.http_errors import http_response, not_http, server_error
from embedsvc.serving.waitress_adapter import RequestTimeout, error_body


def gunicorn_error(status: int, reason: str, detail: str, head: bool = False) -> dict:
    raw = json_error(status, reason, detail, max_body_bytes=100, head=head)
    return json.loads(raw.partition(b"\r\n\r\n")[2])["error"]


@pytest.mark.parametrize("waitress_error, status, code", [
    (RequestEntityTooLarge("exceeds max_body of 101"), 413, "body_too_large"),
    (RequestTimeout("late"), 408, "request_timeout"),
    (RequestHeaderFieldsTooLarge("exceeds max_header of 8"), 431,
     "request_header_fields_too_large"),
    (BadRequest("bad content-length"), 400, "bad_request"),
])
def test_waitress_and_gunicorn_say_the_same_for_the_same_fault(waitress_error, status, code):
    from_waitress = json.loads(error_body(waitress_error, 100))["error"]
    from_gunicorn = gunicorn_error(status, waitress_error.reason, waitress_error.body)
    assert from_waitress == from_gunicorn and from_waitress["code"] == code


def test_the_body_limit_reads_the_same_from_the_server_and_from_the_app():
    from io import BytesIO

    with pytest.raises(PayloadTooLarge) as caught:
        read_body({"wsgi.input": BytesIO(b"x" * 101)}, 100)  # chunked: the app counts
    by_server = server_error(413, "Payload Too Large", "", max_body_bytes=100)
    for message in (caught.value.message, by_server.message):
        assert message.endswith("MAX_BODY_BYTES (100); split the request"), message


def test_shutting_down_and_server_faults():
    draining = server_error(503, "Service Unavailable", "", max_body_bytes=100)
    assert draining.status == 503 and draining.code == "draining"
    assert "another replica" in draining.message
    fault = server_error(500, "Internal Server Error", "Traceback /secret", max_body_bytes=100)
    assert fault.status == 500 and "secret" not in fault.message


def test_a_head_answer_states_the_length_and_sends_no_body():
    error = server_error(431, "Request Header Fields Too Large", "x", max_body_bytes=100)
    full, head = http_response(error), http_response(error, head=True)
    assert full.startswith(head) and head.endswith(b"\r\n\r\n")
    assert b"Content-Length: %d\r\n" % (len(full) - len(head)) in head


@pytest.mark.parametrize("start, why", [
    (b"\x16\x03\x01\x00\xa5\x01", "not TLS: use http://"),
    (b"\x80\x2e\x01", "must begin with its method"),
    (b"\r\n\x00GET", "must begin with its method"),
])
def test_bytes_that_begin_no_request_say_why(start, why):
    assert why in not_http(start)


@pytest.mark.parametrize("start", [b"GET / HTTP/1.1", b"\r\nPOST", b"get", b"GARBAGE", b""])
def test_a_method_or_what_may_be_one_is_left_to_the_parser(start):
    assert not_http(start) is None
