"""remote/lease.py: a front reserves room before it tokenizes, as one process does, and
predicts a request's wait from the engine's pongs: the engine's queue at the device's rate,
the front's own work at its share of it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from embedsvc.admission import Admission
from embedsvc.engine_client import EngineClient
from embedsvc.errors import Overloaded
from embedsvc.model.fake import FakeEncoder
from embedsvc.remote.client import RemotePort
from embedsvc.remote.lease import Lease
from embedsvc.settings import Settings


@dataclass
class Engine:
    """The fields of a link the lease reads, as an engine's pong sets them."""

    queue_limit: int = 64
    fronts: list[int] = field(default_factory=lambda: [1])
    rate: float = 0.0
    ahead: int = 0
    state: str = "ready"
    sent: list = field(default_factory=list)

    def next_id(self) -> int:
        return len(self.sent) + 1

    def send_call(self, frame, disconnected):  # a request that got this far was tokenized
        self.sent.append(frame)
        raise AssertionError("a request the lease refuses must not reach the engine")


class Counting(FakeEncoder):
    tokenized = 0

    def tokenize(self, texts, limit=None, direction="right"):
        self.tokenized += len(texts)
        return super().tokenize(texts, limit, direction)


def test_a_request_late_on_the_engines_queue_is_refused_before_it_is_tokenized():
    """The engine's pong: 5,000 tokens ahead at 1,000 a second; the deadline is 2 s away. The
    request gets 429 at once with the time in Retry-After, and neither the tokenizer nor the
    engine sees it (before leases, a front tokenized it and the engine refused it)."""
    engine = Engine(rate=1000.0, ahead=5000)
    encoder = Counting(dimension=4)
    settings = Settings(request_timeout_s=2.0)
    client = EngineClient(settings, encoder, RemotePort(engine, settings))  # type: ignore[arg-type]
    with pytest.raises(Overloaded) as refused:
        client.embed(["a short query"])
    assert int(refused.value.headers["Retry-After"]) >= 3
    assert encoder.tokenized == 0 and engine.sent == []


def test_the_engines_queue_counts_at_the_whole_rate_the_fronts_own_work_at_its_share():
    """Two fronts: 1,500 tokens ahead in the engine at 1,000 a second is 1.5 s, admitted
    within 2 s; the same front's own 1,500 tokens in the engine drain at half the rate, 3 s."""
    engine = Engine(rate=1000.0, ahead=1500, fronts=[1, 2])
    lease = Lease(engine, Settings())
    soon = time.monotonic() + 2.0
    ticket = lease.admit(1, 10, soon, flow="a")
    assert ticket.open and lease.predicted_wait(lease._ahead("a")) == pytest.approx(0.75 * 2)
    lease.sent(ticket, 1500)
    engine.ahead = 0
    with pytest.raises(Overloaded):
        lease.admit(1, 10, time.monotonic() + 2.0, flow="a")  # behind its own 1,500
    assert lease.admit(1, 10, time.monotonic() + 2.0, flow="b").open  # a new client is not
    lease.answered(ticket)
    assert lease._ahead("a") == 0 and lease.used_inputs == 1


def test_behind_a_full_room_a_request_waits_for_all_the_lease_holds():
    """Room for 4 inputs, all held by one request of 1,500 tokens, at 1,000 tokens a second:
    one process would have a waiter wait for a quarter of it (room frees input by input);
    a lease's room frees when the request ends, 1.5 s, so a waiter with 1 s left is refused
    at once, and one with 2 s left waits for its turn."""
    engine = Engine(queue_limit=4, rate=1000.0)
    lease = Lease(engine, Settings(max_inputs_per_request=4))
    held = lease.admit(4, 1500, time.monotonic() + 5, flow="a")
    lease.sent(held, 1500)
    with pytest.raises(Overloaded):
        lease.request(1, 10, time.monotonic() + 1.0, flow="b")
    local = Admission(max_inputs=4, max_tokens=1 << 20, timeout_s=30, floor_inputs=4,
                      queue=lambda flow: 0)  # the batcher's: a new client is next
    local._rates.append(1000.0)
    local.settle(local.admit(4, 1500, time.monotonic() + 5), 1500)
    assert local.request(1, 10, time.monotonic() + 1.0, flow="b").waiting  # input by input
    waiter = lease.request(1, 10, time.monotonic() + 2.0, flow="b")
    assert waiter.waiting and not waiter.open
    lease.answered(held)
    assert waiter.open and lease.used_inputs == 1


def test_the_lease_holds_the_engines_room_as_its_pongs_say_it():
    engine = Engine(queue_limit=0)
    lease = Lease(engine, Settings(max_inputs_per_request=8))
    assert lease.limit == 8  # no card yet: the largest request
    engine.queue_limit = 300
    assert lease.limit == 300 and lease.max_tokens == Settings().max_queue_tokens
    engine.fronts, engine.rate = [1, 2, 3], 900.0
    assert lease.rate == 300.0



def test_ahead_of_a_new_client_counts_the_queue_work_tokenizing_and_a_full_room():
    """What the engine's pongs say is ahead of a new client's first input: the queue's model
    of a new flow, the work still tokenizing (one input each), and when room is short what
    must be answered before it frees."""
    gate = Admission(max_inputs=4, max_tokens=1 << 20, timeout_s=30, floor_inputs=4,
                     queue=lambda flow: 7)
    assert gate.ahead_of_new() == 7
    gate.admit(2, 40, time.monotonic() + 5)  # tokenizing: its first input is ahead
    assert gate.ahead_of_new() == 7 + 20
    gate.admit(2, 40, time.monotonic() + 5)  # the room is full: one input's worth frees
    assert gate.ahead_of_new() == 7 + 40 + 20
