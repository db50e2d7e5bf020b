"""api/lane.py: large bodies parse one at a time, at most a share of the time."""

import itertools
import threading
import time

import orjson
import pytest

from embedsvc.api.lane import LARGE_BODY_BYTES, BodyLane
from embedsvc.errors import DeadlineExceeded, Overloaded

from .conftest import assert_error, assert_still_serving, make_app


def timed(spans, seconds=0.03, value="done"):
    def parse():
        start = time.monotonic()
        time.sleep(seconds)  # what a large body's parse costs, holding the GIL
        spans.append((start, time.monotonic()))
        return value
    return parse


def test_after_a_parse_the_lane_stays_shut_for_its_share():
    lane, spans = BodyLane(share=0.25), []
    far = time.monotonic() + 10
    assert lane.run(timed(spans), far) == "done"
    assert lane.run(timed(spans), far) == "done"
    (s1, e1), (s2, _) = spans
    assert s2 - e1 >= 3 * (e1 - s1)  # parsing at most a quarter of the time


def test_parses_never_overlap_and_each_gets_its_turn():
    lane, spans = BodyLane(share=1.0, waiting=8), []
    threads = [threading.Thread(target=lane.run, args=(timed(spans, 0.01),
                                                         time.monotonic() + 10))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    spans.sort()
    assert len(spans) == 6
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(spans))


def test_bodies_take_their_turns_in_arrival_order():
    lane, order = BodyLane(share=1.0), []
    lane._open_at = time.monotonic() + 0.3  # shut: every body below queues

    def body(i):
        lane.run(lambda: order.append(i), time.monotonic() + 10)

    threads = []
    for i in range(5):
        threads.append(threading.Thread(target=body, args=(i,)))
        threads[-1].start()
        while len(lane._queue) + len(order) < i + 1:  # each arrives after the one before
            time.sleep(0.005)
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3, 4]


def test_a_body_that_times_out_in_the_queue_leaves_it_and_the_next_goes_on():
    lane, order = BodyLane(share=1.0), []
    lane._open_at = time.monotonic() + 0.3
    first = threading.Thread(target=lane.run, args=(lambda: order.append("first"),
                                                    time.monotonic() + 10))
    first.start()
    while not lane._queue:
        time.sleep(0.005)
    with pytest.raises(DeadlineExceeded):  # queued behind the first, its deadline passes
        lane.run(lambda: order.append("late"), time.monotonic() + 0.1)
    first.join(5)
    assert lane.run(lambda: "next", time.monotonic() + 1) == "next"
    assert order == ["first"] and not lane._queue


def test_past_its_waiting_room_a_body_gets_429_with_the_time_the_queue_needs():
    """Each waiting body holds a request thread: past ``waiting`` of them the next is
    refused at once, and those queued are all parsed."""
    lane, done = BodyLane(share=1.0, waiting=2), []
    lane._open_at = time.monotonic() + 0.5
    threads = [threading.Thread(target=lambda: done.append(lane.run(lambda: 1,
                                                                    time.monotonic() + 10)))
               for _ in range(3)]  # one whose turn it is, two behind it
    for t in threads:
        t.start()
    while len(lane._queue) < 3:
        time.sleep(0.01)
    started = time.monotonic()
    with pytest.raises(Overloaded) as info:
        lane.run(lambda: 1, time.monotonic() + 10)
    assert time.monotonic() - started < 0.1
    assert info.value.status == 429 and "3 large bodies" in info.value.message
    assert int(info.value.headers["Retry-After"]) >= 1
    for t in threads:
        t.join(5)
    assert done == [1, 1, 1] and not lane._queue


def test_a_refused_body_costs_the_lane_only_its_own_parse():
    """Issue 41: a large body that failed to parse shut the lane for four times its parse; a
    legitimate body behind it waited, and those whose deadline fell in that time got 504."""
    lane, spans, ended = BodyLane(share=0.25), [], []
    bad_started = threading.Event()

    def refused():
        bad_started.set()
        time.sleep(0.3)  # a large body's parse, then its 400
        ended.append(time.monotonic())
        raise ValueError("item 999999 is a number (1.5)")

    def bad():
        with pytest.raises(ValueError):
            lane.run(refused, time.monotonic() + 10)

    first = threading.Thread(target=bad)
    first.start()
    assert bad_started.wait(5)
    # behind it: a legitimate body whose deadline falls within the old shut time (0.9 s)
    assert lane.run(timed(spans, 0.0), time.monotonic() + 0.8) == "done"
    first.join(5)
    assert spans[0][0] - ended[0] < 0.2  # its turn came when the refused parse ended


def test_a_turn_after_the_deadline_is_504_at_once():
    lane = BodyLane(share=0.01)
    lane.run(timed([], 0.02), time.monotonic() + 10)  # shut for about 2 s
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        lane.run(timed([]), time.monotonic() + 0.5)
    assert time.monotonic() - started < 0.2  # refused without waiting for nothing
    assert info.value.status == 504 and "REQUEST_TIMEOUT_S" in info.value.message
    with pytest.raises(ValueError):
        BodyLane(share=0)


def test_only_large_bodies_wait_for_the_lane(fake, registry):
    """With the lane shut for a minute, a small body is answered at once and a large one gets
    its 504 in the error shape; the service goes on."""
    app = make_app(fake, registry, request_timeout_s=2)
    lane = app.wsgi_app.lane
    lane._open_at = time.monotonic() + 60
    client = app.test_client()
    assert client.post("/embed", json={"inputs": ["small"]}).status_code == 200
    large = orjson.dumps({"inputs": ["x" * 1000] * (LARGE_BODY_BYTES // 1000)})
    assert len(large) >= LARGE_BODY_BYTES
    err = assert_error(client.post("/embed", data=large, content_type="application/json"),
                       504, "timeout")
    assert "parsed one at a time" in err["message"]
    lane._open_at = 0.0
    assert_still_serving(client, fake)


def test_after_a_refused_large_body_the_next_is_parsed_at_once(fake, registry):
    """Through the pipeline: a 2 MB invalid list (refused in its parse) leaves the lane open,
    and a legitimate 1 MB /embed behind it is answered (issue 41: it waited 16.8 s)."""
    app = make_app(fake, registry)
    lane = app.wsgi_app.lane
    client = app.test_client()
    bad = orjson.dumps({"texts": [1] * 999_999 + [1.5]})
    assert client.post("/v2/embed", data=bad, content_type="application/json").status_code == 400
    assert lane._open_at <= time.monotonic()  # the refused parse shut it for nothing
    good = orjson.dumps({"inputs": ["many words " * 92] * (LARGE_BODY_BYTES // 1000)})
    assert len(good) >= LARGE_BODY_BYTES
    resp = client.post("/embed", data=good, content_type="application/json")
    assert resp.status_code == 200 and len(resp.get_json()) == LARGE_BODY_BYTES // 1000
