"""Reservations under --workers (remote/: ``Reserve`` before a front tokenizes): every path
a request can end by gives its room in the engine's admission back, and is answered once."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

from embedsvc.admission import Admission
from embedsvc.errors import ApiError, EngineGone
from embedsvc.metrics import Metrics
from embedsvc.model.fake import FakeEncoder
from embedsvc.remote import client as client_module
from embedsvc.remote import server as server_module
from embedsvc.remote import wire
from embedsvc.remote.place import engine_address, private_dir
from embedsvc.remote.server import EngineServer, _Burst
from embedsvc.remote.stream import Stream
from embedsvc.service import Service
from embedsvc.settings import Settings
from embedsvc.tenants import Keyring, Limits, Quotas, Tenant
from embedsvc.work import EMBED, TOKENS, Work
from tests.frames import answers_in
from tests.unit.test_remote import _in_threads, _next, _raw, serving
from tests.waiting import soon


@contextlib.contextmanager
def _loop_steps(tmp_path, registry, settings: Settings | None = None
                ) -> Iterator[tuple[EngineServer, Admission]]:
    """An engine's ``EngineServer`` with no loop running, for a test that drives the loop's
    steps itself, in their order within a turn, and the engine's admission."""
    engine = Service(settings or Settings(),
                     encoder=FakeEncoder(dimension=4, max_input_tokens=16),
                     metrics=Metrics(registry))
    engine.start(background=False)
    server = EngineServer(engine.runner, engine_address(private_dir(tmp_path / "run")),
                          card={}, state=lambda: "ready", metrics=engine.metrics)
    try:
        yield server, engine.runner.admission
    finally:
        server.close()
        engine.drain(1)


def test_a_reservation_of_a_request_failed_when_the_engine_went_silent_is_given_back(
        tmp_path, registry, monkeypatch):
    """An engine silent past ``LOST_AFTER_S`` (its loop held up) is taken for gone: the
    front answers its requests 503 and forgets them. The engine, once it runs again, reads
    their reservations: they must not hold its room until their deadlines for ids that will
    never come."""
    monkeypatch.setattr(client_module, "LOST_AFTER_S", 1.0)
    with serving(tmp_path, registry) as (engine, front, _, server, _stop):
        admission = engine.runner.admission
        held, resume = threading.Event(), threading.Event()
        reserve = server._reserve

        def held_up(burst):  # the engine's loop stops answering as the reservation comes
            if burst and not held.is_set():
                held.set()
                resume.wait(10)
            reserve(burst)

        monkeypatch.setattr(server, "_reserve", held_up)
        thread, errors = _waiting_for_a_grant(front)
        assert held.wait(5)
        thread.join(5)
        assert [type(e) for e in errors] == [EngineGone], errors
        resume.set()
        assert soon(lambda: front.state == "ready", 5)
        assert soon(lambda: admission.used_inputs == 0, 3), \
            (admission.used_inputs, server._reserved)
        assert admission.used_tokens == 0


def _waiting_for_a_grant(front: Service) -> tuple[threading.Thread, list[Exception]]:
    """A request of 9 inputs (it waits for its grant before tokenizing) through ``front``,
    in a thread of its own, and the list that gets what it raises."""
    errors: list[Exception] = []

    def request(_: int) -> None:
        try:
            front.ready().run(Work(EMBED, [f"text {i}" for i in range(9)],
                                   deadline=time.monotonic() + 30))
        except Exception as exc:  # noqa: BLE001 - the test reads what it got
            errors.append(exc)

    (thread,) = _in_threads(request, [0])
    return thread, errors


def test_embed_all_charges_its_tenant_its_exact_tokens(tmp_path, registry):
    """/embed_all is admitted at the model's limit for each input (what it may produce), and
    its tenant charged that estimate before tokenizing, as every request is; once tokenized
    the charge is the exact count (docs/operations.md, quotas), in one process as through
    the engine. Left at the estimate, three one-word inputs cost 48 tokens of a 60-a-minute
    quota, and the next such request was refused for most of a minute."""
    with serving(tmp_path, registry) as (engine, front, _, server, _stop):
        for service in (engine, front):  # one process; a front and the engine process
            ring = Keyring.of([Tenant("t", b"", Limits(tokens_per_minute=60))])
            engine.runner.admission.quotas = quotas = Quotas(ring)
            for _ in range(2):
                out = service.ready().run(Work(TOKENS, ["a", "b", "c"], tenant="t",
                                               deadline=time.monotonic() + 5))
                assert out.tokens == 9
            usage = quotas._usage.get("t")
            assert usage is not None and usage.tokens >= 60 - 18 - 1 and usage.in_flight == 0


def test_ids_refused_under_a_reservation_whose_grant_is_on_its_way_free_its_room_at_once(
        tmp_path, registry):
    """Ids that are not the inputs reserved are a 400 and free the reservation's room, also
    where the reservation was parked and its grant came (another request's room freed) in
    the same turn of the engine's loop, before the loop took the grant: the grant must not
    hold the room again until the deadline, then answer the request a second time."""
    # the loop's steps, driven in their order within one turn
    with _loop_steps(tmp_path, registry) as (server, admission):
        full = admission.limit
        server._reserve(_Burst.of(b"front", wire.Reserve(1, "embed", full, full, timeout=20)))
        server._reserve(_Burst.of(b"front", wire.Reserve(2, "embed", 2, 6, timeout=20)))
        assert (b"front", 2) in server._parked
        admission.cancel(server._reserved.pop((b"front", 1)).ticket)  # room: 2 is granted
        one_input = wire.pack_ids([[1, 5, 2]])  # under a reservation of two
        server._submit(_Burst.of(b"front", wire.Submit(2, "embed", *one_input, timeout=20,
                                                       reserved=True)))
        server._start_granted()
        server._sweep_parked()
        assert admission.used_inputs == 0 and admission.used_tokens == 0, server._reserved
        assert [(f.id, f.status) for f in server._outbox[b"front"]] == [(2, 400)]
        assert not server.in_flight


def test_a_reservation_read_with_its_ids_is_one_request_admitted_with_them(
        tmp_path, registry):
    """A small request's reservation and ids, read in one burst, are taken as one request
    admitted at its exact tokens (no reservation held, nothing to join), with the checks a
    reservation's ids get: ids that are not the inputs reserved are a 400 with no room held,
    a second reservation under the id is dropped as malformed, and one that asked to be
    told is taken as sent."""
    one_input, two_inputs = wire.pack_ids([[1, 5, 2]]), wire.pack_ids([[1, 5, 2], [1, 2]])
    with _loop_steps(tmp_path, registry) as (server, admission):
        burst = _Burst.of(
            b"front",
            wire.Reserve(1, "embed", 1, 40, timeout=20),
            wire.Reserve(2, "embed", 1, 40, timeout=20),
            wire.Submit(1, "embed", *one_input, timeout=20, reserved=True),
            wire.Submit(2, "embed", *two_inputs, timeout=20, reserved=True),  # 2 under 1
            wire.Reserve(1, "embed", 1, 40, timeout=20),  # its id in use
            wire.Reserve(3, "embed", 1, 40, timeout=20, tell=True),
            wire.Submit(3, "embed", *one_input, timeout=20, reserved=True))
        assert [r is None for r in burst.reserves] == [True, True, False, False]
        assert [reserve is not None for _, _, reserve in burst.submits] == [True, True, False]
        server._reserve(burst)
        server._submit(burst)
        assert server._malformed == 1 and not server._reserved and not server._parked
        assert sorted(key[1] for key in server._running) == [1, 3]  # 3 joined its grant
        assert admission.used_tokens == 3 + 3  # the exact tokens: nothing else held
        assert [(f.id, f.status) for f in server._outbox[b"front"]
                if isinstance(f, wire.Failed)] == [(2, 400)]
        assert [f.id for f in server._outbox[b"front"] if isinstance(f, wire.Granted)] == [3]
        server._outbox.clear()
        assert soon(lambda: (server._answer_done(), len(server._running))[1] == 0)
        answered = server._outbox[b"front"]
        assert sorted(a.id for f in answered for a in answers_in(f)
                      if isinstance(a, wire.Row)) == [1, 3]
        assert admission.used_inputs == 0 and admission.used_tokens == 0


def test_the_rows_of_a_turn_never_come_from_a_batch_freed_during_it(tmp_path, registry):
    """The loop gathers a turn's one-row answers by their batch's id (``_Rows``). Kept by id
    alone, a batch whose requests were answered could be freed during the turn (the batcher's
    thread goes on) and the next batch take its address: a request was answered with
    another's row. The turn holds each batch it gathers from until its frames are made:
    here the first request's batch, which nothing else holds once it is answered, is still
    there when a later request finishes, and each request gets its own row."""
    from embedsvc.batching.batcher import Job
    from embedsvc.remote.server import _Request

    def finished(request_id: int, batch: np.ndarray) -> _Request:
        job = Job([[1, 2]], 0.0)
        job.at, job.batch_rows, job.rows = 0, batch, batch[:1]
        return _Request(b"front", request_id, Work(EMBED, ["x"]), job=job)

    class Turn:  # the loop's ``_done``: the last request finishes as the others are answered
        def __init__(self) -> None:
            first = finished(1, np.full((2, 4), 1.0, np.float32))
            self.first = weakref.ref(first.job.batch_rows)
            self.queue = [first, finished(2, np.full((2, 4), 2.0, np.float32))]
            self.held: bool | None = None  # the first batch, as the last request finished

        def __bool__(self) -> bool:
            return bool(self.queue) or self.held is None

        def popleft(self) -> _Request:
            if self.queue:
                return self.queue.pop(0)
            self.held = self.first() is not None
            return finished(3, np.full((2, 4), 3.0, np.float32))

    with _loop_steps(tmp_path, registry) as (server, _):
        turn = Turn()
        server._done = turn  # type: ignore[assignment]
        server._answer_done()
        assert turn.held, "the first batch was freed while the turn still gathered by ids"
        rows = {a.id: a.row() for f in server._outbox[b"front"] for a in answers_in(f)}
        assert sorted(rows) == [1, 2, 3]
        for request_id in (1, 2, 3):
            np.testing.assert_array_equal(rows[request_id],
                                          np.full((1, 4), float(request_id), np.float32))


def test_a_batch_shared_by_two_fronts_sends_each_its_own_rows_in_one_frame(tmp_path, registry):
    """A batch holding two fronts' one-input requests, finished in one turn: each front gets
    one ``Rows`` frame with its own requests' rows, in the order it lists their ids (a
    gather of the batch's rows where it holds only some of them, the batch's bytes as they
    are where it holds all), raw or at unit length as the batch made them."""
    from embedsvc.batching.batcher import Job
    from embedsvc.remote.server import _Request

    raw = np.arange(20, dtype=np.float32).reshape(5, 4)
    units = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    alone = np.full((1, 4), 7.0, np.float32)  # another batch, all of it one front's

    def finished(peer: bytes, request_id: int, batch: np.ndarray, at: int,
                 unit: np.ndarray | None = None) -> _Request:
        job = Job([[1, 2]], 0.0)
        job.at, job.batch_rows, job.batch_units = at, batch, unit
        job.inference_s, job.batch_size = 0.01, len(batch)
        return _Request(peer, request_id, Work(EMBED, ["x"]), job=job)

    with _loop_steps(tmp_path, registry) as (server, _):
        server._done.extend([finished(b"a", 1, raw, 3), finished(b"b", 1, raw, 0),
                             finished(b"a", 2, raw, 1), finished(b"b", 2, raw, 4, units),
                             finished(b"a", 3, alone, 0), finished(b"b", 3, raw, 2)])
        server._answer_done()
        frames = {peer: server._outbox[peer] for peer in (b"a", b"b")}
    assert [type(f) for f in frames[b"a"]] == [wire.Rows, wire.Rows]
    assert [type(f) for f in frames[b"b"]] == [wire.Rows, wire.Rows]  # raw rows, unit rows
    want = {(b"a", 1): raw[3], (b"a", 2): raw[1], (b"a", 3): alone[0],
            (b"b", 1): raw[0], (b"b", 2): units[4], (b"b", 3): raw[2]}
    for peer, sent in frames.items():
        for frame in sent:
            assert frame.unit is (frame.ids == [2] and peer == b"b")
            for answer in answers_in(frame):
                np.testing.assert_array_equal(answer.row()[0], want[peer, answer.id])
        assert sorted(a.id for f in sent for a in answers_in(f)) == [1, 2, 3]


def test_ids_read_with_a_repeat_of_their_held_reservation_join_the_one_held(
        tmp_path, registry):
    """A reservation held from an earlier read, then a repeat of it read with the request's
    ids: the repeat is dropped as malformed and the ids join the reservation held, as they
    did before a reservation and its ids were taken in one pass. Taken with the repeat, the
    ids were refused as a second request under the id, and the held room waited for its
    deadline (504)."""
    one_input = wire.pack_ids([[1, 5, 2]])
    with _loop_steps(tmp_path, registry) as (server, admission):
        held = _Burst.of(b"front", wire.Reserve(1, "embed", 1, 40, timeout=20))
        server._reserve(held)
        server._submit(held)
        assert (b"front", 1) in server._reserved
        burst = _Burst.of(b"front", wire.Reserve(1, "embed", 1, 40, timeout=20),
                          wire.Submit(1, "embed", *one_input, timeout=20, reserved=True))
        server._reserve(burst)
        server._submit(burst)
        assert server._malformed == 1 and list(server._running) == [(b"front", 1)]
        assert soon(lambda: (server._answer_done(), len(server._running))[1] == 0)
        assert [type(f) for f in server._outbox[b"front"]] == [wire.Rows]
        assert admission.used_inputs == 0 and admission.used_tokens == 0


def test_past_the_pong_backlog_a_front_still_hears_a_pong_a_second(tmp_path, registry):
    """More than ``_PONG_BACKLOG`` waiting for a front: its pings get a pong once a second,
    not one each (the bound on what a peer that never reads can have queued), and not none
    (a front slow to read its backlog still hears which requests the engine holds)."""
    with _loop_steps(tmp_path, registry) as (server, _):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        server._streams[b"p"], reader = Stream(mine), Stream(theirs)
        server._streams[b"p"].waiting = server_module._PONG_BACKLOG + 1  # a backlog, as if
        try:
            for _ in range(5):
                server._dispatch(b"p", wire.Ping(os.getpid()))
            server._ponged[b"p"] -= server_module._PONG_EVERY_S  # a second later
            server._dispatch(b"p", wire.Ping(os.getpid()))
            time.sleep(0.1)
            frames = [wire.decode_to_front(f) for f in reader.read()]
            assert [type(f) for f in frames] == [wire.Pong, wire.Pong]
        finally:
            reader.close()


def test_a_front_that_connects_again_frees_the_room_of_its_earlier_connection(
        tmp_path, registry):
    """A front whose connection to a live engine dropped (its socket closed for a frame
    past the engine's limit, say) fails its requests and says hello again on a new one: the
    reservations of the old connection, which no cancel from the new one can name, are
    freed at once instead of at their deadlines (the front lives: no sweep of dead fronts
    frees them)."""
    alive = os.getppid()  # a live process that is not this test's own front
    with serving(tmp_path, registry) as (engine, front, _, _, _):
        admission = engine.runner.admission
        with _raw(front) as old, _raw(front) as new:
            old.send(wire.encode(wire.Hello(alive)))
            assert [type(f) for f in _next(old)] == [wire.Card]
            old.send(wire.encode(wire.Reserve(1, "embed", 3, 30, timeout=30.0, front=alive,
                                              tell=True)))
            assert [type(f) for f in _next(old)] == [wire.Granted]
            assert admission.used_inputs == 3
            new.send(wire.encode(wire.Hello(alive)))
            assert [type(f) for f in _next(new)] == [wire.Card]
            assert soon(lambda: admission.used_inputs == 0, 4), admission.used_inputs


def test_a_request_id_already_in_use_is_dropped_and_the_first_requests_room_comes_back(
        tmp_path, registry):
    """A front numbers its requests once each; a frame that opens a second request under
    an id its connection has in the engine (a buggy or hostile local sender) is dropped as
    malformed. Taken in, it replaced the first in the engine's tables while the first's
    ticket stayed open: cancelling the id freed one reservation's room, and the other's was
    held for good (3 and 2 inputs here), so every later request had that much less."""
    with serving(tmp_path, registry) as (engine, front, _, server, _stop):
        admission = engine.runner.admission
        with _raw(front) as sock:
            for _ in range(2):  # the same id twice, in two frames: one grant
                sock.send(wire.encode(wire.Reserve(1, "embed", 3, 30, timeout=30.0,
                                                   tell=True)))
            assert [type(f) for f in _next(sock)] == [wire.Granted]
            # and twice in one frame, then an unreserved request under a held id
            twice = wire.Reserve(2, "embed", 2, 20, timeout=30.0)
            ids = wire.pack_ids([[1, 5, 2]])
            sock.send(wire.encode(wire.Submits([twice, twice])))
            sock.send(wire.encode(wire.Submit(1, "embed", *ids, timeout=30.0)))
            assert soon(lambda: server._malformed == 3, 3), server._malformed
            assert admission.used_inputs == 5
            for request_id in (1, 2):
                sock.send(wire.encode(wire.Cancel(request_id)))
                assert [(f.id, f.status) for f in _next(sock)] == [(request_id, 499)]
            assert not sock.poll(300), "a dropped frame was answered"
        assert admission.used_inputs == 0 and admission.used_tokens == 0
        assert not server.in_flight


def test_a_request_parked_in_an_engine_that_drains_gets_503_with_retry_after(
        tmp_path, registry):
    """An engine process that drains alone (a SIGTERM of its own or of the whole process
    group) sends the reservations parked in its FIFO away with 503; the front, which serves
    on while a new engine starts, must pass on when to come back, as its own 503s say. It
    came without Retry-After."""
    with serving(tmp_path, registry) as (engine, front, _, _server, _stop):
        admission = engine.runner.admission
        with _raw(front) as sock:
            sock.send(wire.encode(wire.Reserve(1, "embed", admission.limit, 10, timeout=30.0,
                                               tell=True)))  # all the room
            assert [type(f) for f in _next(sock)] == [wire.Granted]
            thread, errors = _waiting_for_a_grant(front)  # parked: no room
            assert soon(lambda: admission.waiting == 1, 5)
            admission.close()  # the engine's drain begins
            thread.join(5)
        assert [(e.status, e.code) for e in errors] == [(503, "draining")], errors
        assert errors[0].headers["Retry-After"] == "1"


def test_a_reservation_whose_ids_never_come_holds_its_room_no_longer_than_the_timeout(
        tmp_path, registry):
    """A front's reservation says the seconds left before its request's deadline, which are
    never more than REQUEST_TIMEOUT_S; one that says more (a buggy or hostile local sender)
    and never sends its ids holds its room until REQUEST_TIMEOUT_S at most, then gets 504.
    Taken as sent, a timeout of a year held the room for good."""
    year = 365 * 24 * 3600.0
    # the loop's steps, driven in their order
    with _loop_steps(tmp_path, registry, Settings(request_timeout_s=0.5)) as (server, admission):
        server._reserve(_Burst.of(b"front", wire.Reserve(1, "embed", 3, 30, timeout=year)))
        server._reserve(_Burst.of(b"front", wire.Reserve(2, "embed", admission.limit, 30,
                                                         timeout=year)))  # parked: no room
        assert admission.used_inputs == 3 and admission.waiting == 1
        time.sleep(0.6)
        server._sweep_parked()
        assert sorted((f.id, f.status) for f in server._outbox.get(b"front", [])) == \
            [(1, 504), (2, 504)]
        assert admission.used_inputs == 0 and not admission.waiting and not server.in_flight
        # counted as one process counts a waiter past its deadline
        assert registry.get_sample_value("embedsvc_dropped_inputs_total",
                                         {"reason": "timeout"}) == 3 + admission.limit


def test_a_reservation_cancelled_as_its_client_leaves_counts_its_inputs_dropped(
        tmp_path, registry):
    """A front's client that leaves while its reservation is granted or still parked drops
    its inputs before compute, as one process counts them (``Admission``'s wait for a grant,
    ``still_wanted``): ``embedsvc_dropped_inputs_total{reason="disconnected"}`` says so under
    ``--workers N`` too, where the front's ``Cancel`` reaches the engine."""
    def dropped() -> float:
        return registry.get_sample_value("embedsvc_dropped_inputs_total",
                                         {"reason": "disconnected"}) or 0.0

    with serving(tmp_path, registry) as (engine, front, _, _server, _stop):
        admission = engine.runner.admission
        with _raw(front) as sock:
            sock.send(wire.encode(wire.Reserve(1, "embed", admission.limit - 2, 10,
                                               timeout=30.0, tell=True)))  # all but 2
            assert [type(f) for f in _next(sock)] == [wire.Granted]
            sock.send(wire.encode(wire.Reserve(2, "embed", 5, 50, timeout=30.0, tell=True)))
            assert soon(lambda: admission.waiting == 1, 5)  # parked: 5 do not fit in 2
            before = dropped()
            # the parked one's client left
            sock.send(wire.encode(wire.Cancel(2, dropped="disconnected")))
            assert [(f.id, f.status) for f in _next(sock)] == [(2, 499)]
            assert dropped() == before + 5
            sock.send(wire.encode(wire.Cancel(1, dropped="disconnected")))  # the granted one's
            assert [(f.id, f.status) for f in _next(sock)] == [(1, 499)]
            assert dropped() == before + 5 + admission.limit - 2
        assert admission.used_inputs == 0 and not admission.waiting


def test_a_reservation_given_back_for_no_drop_counts_nothing(tmp_path, registry):
    """A front gives a reservation back after a 400 it found as it tokenized, or after it
    counted the drop itself (its deadline, its client, as it tokenized): its Cancel says no
    reason, and the engine counts nothing (it counted every Cancel as a client gone: twice
    for those, and a drop for a 400). A reason no front sends is one line, and no count."""
    def dropped() -> float:
        return sum(registry.get_sample_value("embedsvc_dropped_inputs_total",
                                             {"reason": r}) or 0.0
                   for r in ("disconnected", "timeout"))

    with serving(tmp_path, registry) as (engine, front, _, _server, _stop):
        admission = engine.runner.admission
        with _raw(front) as sock:
            sock.send(wire.encode(wire.Reserve(1, "embed", 3, 10, timeout=30.0, tell=True)))
            assert [type(f) for f in _next(sock)] == [wire.Granted]
            sock.send(wire.encode(wire.Cancel(1)))
            assert [(f.id, f.status) for f in _next(sock)] == [(1, 499)]
            sock.send(wire.encode(wire.Reserve(2, "embed", 3, 10, timeout=30.0, tell=True)))
            assert [type(f) for f in _next(sock)] == [wire.Granted]
            sock.send(wire.encode(wire.Cancel(2, dropped="because")))
            assert [(f.id, f.status) for f in _next(sock)] == [(2, 499)]
            assert dropped() == 0
        assert admission.used_inputs == 0 and not admission.waiting


def test_a_front_and_its_engine_count_each_drop_once_and_for_its_reason(tmp_path, registry):
    """Under --workers N, the service's dropped inputs are what one process counts: a
    request that waited for room past its deadline, once as ``timeout`` (the engine counted
    the front's Cancel as a client gone); a client gone as the front tokenized, once (the
    front counted it, and the engine again); a 400 found as the front tokenized, not at all
    (counted as a client gone)."""
    def dropped(front: Service) -> dict[str, float]:
        text = front.exposition().decode()
        return {reason: float(value) for reason, value in re.findall(
            r'^embedsvc_dropped_inputs_total\{reason="(\w+)"\} (\S+)$', text, re.M)}

    with serving(tmp_path, registry) as (engine, front, _, _server, _stop):
        client = front.ready()
        with pytest.raises(ApiError) as refused:  # a text past the limit, not truncated
            client.run(Work(EMBED, ["w " * 40, "short"], deadline=time.monotonic() + 30,
                            truncate=False))
        assert refused.value.status == 400
        with pytest.raises(ApiError) as left:  # its client gone as it is tokenized
            client.run(Work(EMBED, ["a b", "c d", "e f"], deadline=time.monotonic() + 30,
                            disconnected=lambda: True))
        assert left.value.status == 499
        admission = engine.runner.admission
        room = admission.admit(admission.limit, 1, time.monotonic() + 60)  # all of it
        try:
            with pytest.raises(ApiError) as late:  # enough inputs to wait for its grant
                client.run(Work(EMBED, ["w"] * 10, deadline=time.monotonic() + 0.5))
            assert late.value.status == 504
        finally:
            admission.cancel(room)
        assert soon(lambda: dropped(front) == {"disconnected": 3.0, "timeout": 10.0}, 5), \
            dropped(front)
        time.sleep(0.3)  # nothing more comes
        assert dropped(front) == {"disconnected": 3.0, "timeout": 10.0}
