"""Admission rules, each with an exact answer: FIFO order, deadlines, budgets, Retry-After."""

import threading
import time

import pytest

from embedsvc.admission import Admission, Ask
from embedsvc.errors import (
    ClientDisconnected,
    DeadlineExceeded,
    Overloaded,
    PayloadTooLarge,
    Unavailable,
)
from embedsvc.metrics import Metrics


def later(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


def gate(registry=None, **kw) -> Admission:
    values = {"max_inputs": 4, "max_tokens": 1000, "timeout_s": 30.0, "floor_inputs": 4, **kw}
    return Admission(metrics=Metrics(registry), **values)


def admit_in_thread(a: Admission, inputs: int, tokens: int, order: list, name: str,
                    **kw) -> threading.Thread:
    def run():
        try:
            a.admit(inputs, tokens, kw.pop("deadline", later()), **kw)
            order.append(name)
        except Exception as exc:  # noqa: BLE001 - the test reads what happened
            order.append((name, type(exc).__name__))

    t = threading.Thread(target=run)
    t.start()
    return t


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert condition()


def test_freed_room_goes_to_the_oldest_waiter_and_nobody_overtakes_it():
    a = gate()
    a.admit(3, 30, later())  # 3 of 4 inputs in use
    order: list = []
    big = admit_in_thread(a, 4, 40, order, "big")  # needs all four: waits
    wait_for(lambda: a.waiting == 1)
    small = admit_in_thread(a, 1, 10, order, "small")  # would fit now, but is behind "big"
    wait_for(lambda: a.waiting == 2)
    time.sleep(0.05)
    assert order == [] and a.used_inputs == 3
    a.release(3, 30)
    big.join(5)
    assert order == ["big"] and (a.used_inputs, a.used_tokens) == (4, 40)
    a.release(4, 40)
    small.join(5)
    assert order == ["big", "small"] and (a.used_inputs, a.used_tokens) == (1, 10)


def test_work_that_cannot_reach_the_model_before_its_deadline_gets_429_at_once():
    a = gate(max_inputs=100, max_tokens=10_000)
    a.observe(tokens=1000, inputs=10, seconds=1.0)  # the device does 1000 tokens/s
    a.admit(50, 5000, later())  # 5 s of work ahead
    started = time.monotonic()
    with pytest.raises(Overloaded) as info:
        a.admit(1, 10, time.monotonic() + 2.5)
    assert time.monotonic() - started < 1  # refused at once, not after waiting
    assert info.value.status == 429
    assert info.value.headers["Retry-After"] == "3"  # 5 s ahead - 2.5 s of deadline, rounded up
    ticket = a.admit(1, 10, time.monotonic() + 6)  # a later deadline fits: admitted
    assert ticket.open and a.used_inputs == 51


def test_one_stalled_batch_cannot_turn_a_burst_into_429s():
    a = gate(max_inputs=1000, max_tokens=100_000)
    for _ in range(5):
        a.observe(tokens=1000, inputs=10, seconds=0.1)  # 10,000 tokens/s
    a.observe(tokens=4000, inputs=40, seconds=80.0)  # a large batch stalled 200x (a page-in)
    assert a.rate == 10_000  # the best of the recent batches
    a.admit(100, 45_000, later())  # 4.5 s of work ahead at that rate
    assert a.admit(1, 10, time.monotonic() + 5).open  # not refused


def test_small_batches_before_a_burst_do_not_make_it_look_slow():
    a = gate(max_inputs=1000, max_tokens=100_000)
    for _ in range(20):
        a.observe(tokens=5, inputs=1, seconds=0.005)  # idle: single short inputs, 1,000 tokens/s
    a.observe(tokens=2000, inputs=16, seconds=0.5)  # the burst's first full batch: 4,000
    assert a.rate == 4000
    a.admit(100, 18_000, later())  # 4.5 s ahead at 4,000 tokens/s
    assert a.admit(1, 10, time.monotonic() + 4.6).open


def test_a_lasting_slowdown_is_believed_after_eight_batches():
    a = gate()
    a.observe(tokens=1000, inputs=10, seconds=1.0)  # 1000 tokens/s
    for _ in range(7):
        a.observe(tokens=1000, inputs=10, seconds=10.0)  # now 100 tokens/s
    assert a.rate == 1000  # seven slow batches: the fast one is still among the last eight
    a.observe(tokens=1000, inputs=10, seconds=10.0)
    assert a.rate == 100


def test_a_batch_below_the_clock_resolution_teaches_nothing():
    a = gate()
    a.observe(tokens=10, inputs=1, seconds=0.0)
    assert a.rate == 0 and a.predicted_wait(10**6) == 0  # no rate: nothing refused as late
    a.observe(tokens=10, inputs=1, seconds=0.01)
    assert a.rate == pytest.approx(1000)


def test_retry_after_counts_the_waiting_requests_too():
    a = gate(max_inputs=10)
    a.observe(tokens=100, inputs=1, seconds=1.0)  # 100 tokens/s
    a.admit(10, 100, later())  # full: 1 s ahead
    order: list = []
    waiter = admit_in_thread(a, 10, 300, order, "waiter", deadline=later(30))  # +3 s, waits
    wait_for(lambda: a.waiting == 1)
    with pytest.raises(Overloaded) as info:
        a.admit(1, 1, time.monotonic() + 1.5)
    assert info.value.headers["Retry-After"] == "3"  # (100 + 300) / 100 - 1.5, rounded up
    a.close()
    waiter.join(5)
    assert order == [("waiter", "Unavailable")]


def test_the_token_budget_holds_and_a_larger_request_runs_alone():
    a = gate(max_inputs=100, max_tokens=100)
    a.admit(1, 60, later())
    order: list = []
    second = admit_in_thread(a, 1, 60, order, "second")  # 120 > 100 tokens: waits
    wait_for(lambda: a.waiting == 1)
    time.sleep(0.05)
    assert order == []
    a.release(1, 60)
    second.join(5)
    assert order == ["second"]
    a.release(1, 60)
    huge = a.admit(1, 5000, later())  # larger than the whole budget: admitted when alone
    assert huge.tokens == 100 and a.used_tokens == 100


def test_settle_swaps_the_estimate_for_the_exact_count_and_cancel_is_idempotent():
    a = gate()
    ticket = a.admit(2, 50, later())
    a.settle(ticket, 12)
    assert (a.used_inputs, a.used_tokens, ticket.open) == (2, 12, False)
    a.cancel(ticket)  # the batcher owns it now: nothing to free
    assert (a.used_inputs, a.used_tokens) == (2, 12)
    other = a.admit(1, 7, later())
    a.cancel(other)
    a.cancel(other)
    assert (a.used_inputs, a.used_tokens) == (2, 12)


def test_a_waiter_whose_client_left_goes_and_its_inputs_count_as_dropped(registry):
    a = gate(registry)
    a.admit(4, 10, later())
    gone = threading.Event()
    order: list = []
    t = admit_in_thread(a, 3, 10, order, "leaver", disconnected=gone.is_set)
    wait_for(lambda: a.waiting == 1)
    gone.set()
    t.join(5)
    assert order == [("leaver", ClientDisconnected.__name__)] and a.waiting == 0
    assert registry.get_sample_value("embedsvc_dropped_inputs_total",
                                     {"reason": "disconnected"}) == 3


def test_a_waiter_still_waiting_at_its_deadline_gets_504_and_its_inputs_count_as_dropped(
        registry):
    """As a waiter whose client left: the metric says why queued inputs never ran."""
    a = gate(registry)  # no measured rate yet: nothing to predict with, so it waits
    a.admit(4, 10, later())
    with pytest.raises(DeadlineExceeded):
        a.admit(2, 1, time.monotonic() + 0.1)
    assert a.waiting == 0 and a.used_inputs == 4
    assert registry.get_sample_value("embedsvc_dropped_inputs_total",
                                     {"reason": "timeout"}) == 2


def test_draining_refuses_new_requests_with_503():
    a = gate()
    a.close()
    with pytest.raises(Unavailable) as info:
        a.admit(1, 1, later())
    assert info.value.headers["Retry-After"] == "1"


def test_draining_refuses_the_waiting_requests_with_503_and_retry_after():
    """A drain sends the requests waiting in the FIFO away with a 503 that says when to come
    back, as a new request's 503 does: in an engine process that drains alone, the fronts
    serve on and its supervisor starts another engine."""
    a = gate()
    a.admit(4, 4, later())  # the room, all of it
    waiting = a.request(1, 1, later())
    assert waiting.waiting
    a.close()
    assert waiting.refused is not None and waiting.refused.status == 503
    assert waiting.refused.headers["Retry-After"] == "1"


def test_more_inputs_than_max_queue_is_413_not_an_eternal_wait():
    with pytest.raises(PayloadTooLarge, match="MAX_QUEUE"):
        gate().admit(5, 5, later())


def test_unset_max_queue_follows_the_measured_rate_within_its_bounds():
    a = gate(max_inputs=None, floor_inputs=100, timeout_s=30.0)
    assert a.limit == 100  # nothing measured: MAX_INPUTS_PER_REQUEST
    a.observe(tokens=100, inputs=10, seconds=1.0)  # 10 inputs/s x 30 s
    assert a.limit == 300
    a.observe(tokens=100, inputs=1010, seconds=1.0)  # now 10 + 0.2 x 1000 = 210 inputs/s
    assert a.limit == 1600  # 6300, capped at 16 x 100
    assert gate(max_inputs=50).limit == 50  # an explicit MAX_QUEUE is kept


def test_the_queue_model_is_asked_only_where_its_bound_would_refuse():
    """The bound admits what it can; the exact model (a walk over every client's backlog)
    decides the rest, so the decision is the model's either way."""
    asked: list = []

    def model(flow):
        asked.append(flow)
        return 100  # 0.1 s at 1000 tokens/s

    a = gate(max_inputs=100, max_tokens=100_000, queue=model, queue_most=lambda: 400)
    a.observe(tokens=1000, inputs=10, seconds=1.0)
    a.request(1, 10, time.monotonic() + 1.0, flow="x")  # the bound's 0.4 s fits: no walk
    assert asked == []
    a.request(1, 10, time.monotonic() + 0.3, flow="y")  # the bound would refuse; 0.1 s fits
    assert asked == ["y"]
    with pytest.raises(Overloaded):  # the model refuses too
        a.request(1, 10, time.monotonic() + 0.05, flow="z")
    assert asked == ["y", "z"]
    assert a.used_inputs == 2 and a.waiting == 0  # the refused one left nothing behind


def test_a_request_waiting_for_room_counts_the_batch_it_then_waits_for():
    """Granted from the FIFO once room frees, a request still waits for the batch then on
    the device before its first input runs: a full batch of inputs like its own. Without
    it, a burst's requests granted near their deadline started just past it (504)."""
    a = gate(max_inputs=10, max_tokens=10_000, queue=lambda flow: 0, batch=(2, 10_000))
    a.observe(tokens=1000, inputs=10, seconds=1.0)  # 1000 tokens/s
    a.admit(10, 1000, later())  # the room is full: room for 5 frees after 500 tokens
    # 0.5 s for room, and a batch of 2 inputs of 100 tokens, 0.2 s: past 0.65 s
    with pytest.raises(Overloaded):
        a.request(5, 500, time.monotonic() + 0.65)
    ticket = a.request(5, 500, time.monotonic() + 0.9)  # in time: waits for room
    assert ticket.waiting


def test_a_request_that_would_wait_for_room_past_its_deadline_gets_429_at_once():
    """The queue's model says the device is free for new work (its turn comes at once), but
    the room is taken: the request would first wait in the FIFO while 500 admitted tokens
    are answered, 0.5 s at 1000 tokens/s, past its 0.3 s deadline. It used to be queued in
    the FIFO and get 504 there."""
    a = gate(max_inputs=10, max_tokens=10_000, queue=lambda flow: 0)
    a.observe(tokens=1000, inputs=10, seconds=1.0)
    a.admit(10, 1000, later())  # the room is full: 100 tokens an input
    with pytest.raises(Overloaded) as info:
        a.request(5, 500, time.monotonic() + 0.3)  # room for 5 frees after 500 tokens
    assert info.value.headers["Retry-After"] == "1"
    assert a.waiting == 0
    ticket = a.request(5, 500, time.monotonic() + 5)  # in time: waits for room
    assert ticket.waiting and not ticket.open


def test_a_burst_is_admitted_as_its_requests_one_after_another():
    """``request_many`` (the engine's loop: one call for what one wake-up read) gives each
    request of the burst what ``request`` would have given it asked in turn: opened while
    room lasts, 413 for one larger than MAX_QUEUE, the FIFO for the rest in order (a later
    small one never overtakes), 429 for one that could not start before its deadline; a
    refusal leaves nothing behind, and the waiters are granted in order as room frees."""
    def burst():
        return [Ask(2, 20, later(), "a"), Ask(9, 90, later(), "b"), Ask(1, 10, later(), "c"),
                Ask(2, 20, later(), "d"), Ask(1, 10, later(), "e"),
                Ask(1, 10, time.monotonic() + 0.05, "f")]

    def outcome(got):
        return [type(t).__name__ if not hasattr(t, "open") else
                ("open" if t.open else "waiting") for t in got]

    granted: list = []
    one_by_one, many = gate(), gate()
    for a in (one_by_one, many):
        a.observe(tokens=100, inputs=10, seconds=1.0)  # 100 tokens/s: f cannot make it
    each = []
    for ask in burst():
        try:
            each.append(one_by_one.request(ask.inputs, ask.tokens, ask.deadline, ask.flow))
        except Exception as exc:  # noqa: BLE001 - compared below
            each.append(exc)
    asks = burst()
    for ask in asks:
        ask.notify = lambda ticket, flow=ask.flow: granted.append(flow)
    got = many.request_many(asks)
    assert outcome(got) == outcome(each) == [
        "open", "PayloadTooLarge", "open", "waiting", "waiting", "Overloaded"]
    assert (many.used_inputs, many.waiting) == (one_by_one.used_inputs, one_by_one.waiting)
    many.release(2, 20)  # a's answered: d, then e, in their order
    assert granted == ["d", "e"] and many.used_inputs == 4
