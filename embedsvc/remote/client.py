"""A front's side of the engine's socket: ``Link`` (the card, the engine's state, its
liveness) and ``RemotePort`` (the engine as ``EngineClient``'s port).

Each request thread has its own socket to the engine (``Link.socket``): it sends its
``Submit`` and waits on that socket for the answer, so no other thread of the front is
woken on the way. A thread of the link's own pings the engine every half second, sends this
front's metrics every second, and watches the connection: when the engine process is gone
(its socket closes, or it stops answering), every request waiting on it gets 503 with
``Retry-After`` within ``LOST_AFTER_S`` plus one tick, and /health says ``loading`` until the
supervisor's new engine answers a ``Hello`` with its card.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import (
    ApiError,
    ClientDisconnected,
    DeadlineExceeded,
    QuotaExceeded,
    Unavailable,
    shutting_down,
)
from ..work import IMAGE, Embedded, Pending, ShutdownReport, Work
from ..work_kinds import WORK_KINDS
from . import wire

log = logging.getLogger(__name__)

_TICK_S = 0.1  # how often a waiting request looks at the engine's liveness and its client
_PING_S = 0.5
_SNAPSHOT_S = 1.0
# An engine silent this long is gone: one that dies closes its socket, which tells sooner;
# this is for one that hangs, and is long enough for a front whose interpreter is busy
# (building its tokenizer from the card held it 1.7 s once) not to mistake its own pause.
LOST_AFTER_S = 3.0
_CANCEL_GRACE_S = 1.0  # how long a departed client's request waits for the engine's 499
# How long past its deadline a request waits for the engine's answer: the engine answers 504
# at the deadline itself (its sweep looks every 0.1 s); past this, the front answers it
ANSWER_GRACE_S = 2.0
_CONNECT_S = 1.0  # how long a send waits for its socket to connect
_RECHECK_S = 1.0  # the longest a tenant's spent quota is refused here without the engine
_NOT_CONNECTED = "the engine process is not reachable now; retry in a moment"
_ENGINE_GONE = ("the engine process stopped while this request was in it; retry: a new one "
                "is starting")


def error_of(frame: wire.Failed) -> ApiError:
    """The model side's error, raised again here as the same class (by its name, where
    it is one of ours that says what the frame says; else by what the frame says)."""
    cls = _BY_NAME.get(frame.error)
    if cls is None or (cls.status, cls.type, cls.reason) != (frame.status, frame.type,
                                                            frame.reason):
        cls = _ERRORS.get((frame.status, frame.type, frame.reason), ApiError)
    error = cls.__new__(cls)
    ApiError.__init__(error, frame.message, param=frame.param, code=frame.code,
                      headers=dict(frame.headers))
    if cls is ApiError:
        error.status, error.type, error.reason = frame.status, frame.type, frame.reason
    if isinstance(error, QuotaExceeded):
        error.empty_s = frame.empty_s
    return error


def _subclasses(cls: type[ApiError]) -> list[type[ApiError]]:
    return [cls, *itertools.chain.from_iterable(_subclasses(c) for c in cls.__subclasses__())]


_ERRORS = {(c.status, c.type, c.reason): c for c in reversed(_subclasses(ApiError))}
_BY_NAME = {c.__name__: c for c in _subclasses(ApiError)}


class Link:
    """This front's connection to the engine at ``address``.

    ``state``: ``loading`` until the engine's card arrives (and again while it is gone),
    then the engine's own (``ready``, ``draining``, ``unhealthy``). ``generation`` grows each
    time the engine is lost: a request sent in an earlier generation will get no answer.
    ``snapshot()`` gives this front's metrics to send; ``keeper()``, called while no
    engine answers, starts one if there is none (where no supervisor does).
    """

    def __init__(self, address: str,
                 snapshot: Callable[[], tuple[int, int, list[Any]]] | None = None,
                 keeper: Callable[[], str | None] | None = None) -> None:
        self.address = address
        self._keeper = keeper  # starts an engine when there is none (gunicorn's workers)
        self.card: wire.Card | None = None
        self.state = "loading"
        self.generation = 0
        self.engine_pid: int | None = None
        self.queue_limit = 0
        self.fronts: list[int] = []
        self._snapshot = snapshot
        self._context = zmq.Context()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._sockets_lock = threading.Lock()
        self._carded = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="embedsvc-engine-link",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_card(self, timeout: float | None) -> wire.Card | None:
        """The engine's card, once one has come (waiting up to ``timeout``)."""
        self._carded.wait(timeout)
        return self.card

    def socket(self) -> zmq.Socket:
        """This thread's socket to the engine."""
        sock = getattr(self._local, "socket", None)
        if sock is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # no engine connected: a send fails at once
            sock.connect(self.address)
            self._local.socket = sock
            with self._sockets_lock:
                self._sockets.append(sock)
        return sock

    def send(self, sock: zmq.Socket, data: bytes) -> None:
        """``data`` on this thread's ``sock``; 503 if the engine is not connected. A socket
        connects within a moment of its creation (and again after the engine was replaced):
        a send waits that moment, never longer than ``_CONNECT_S``."""
        until = time.monotonic() + _CONNECT_S
        while True:
            try:
                sock.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                if self.state == "loading" or time.monotonic() > until:
                    raise Unavailable(_NOT_CONNECTED, code="engine_gone",
                                      headers={"Retry-After": "1"}) from None
                time.sleep(0.001)

    def ask(self, frame: wire.Frame, expect: type, timeout: float) -> Any:
        """One question on this thread's socket that has no request id (a scrape)."""
        sock = self.socket()
        self.send(sock, wire.encode(frame))
        until = time.monotonic() + timeout
        while (left := until - time.monotonic()) > 0:
            if sock.poll(int(left * 1000)):
                answer = wire.decode_to_front(sock.recv())
                if isinstance(answer, expect):
                    return answer
        raise Unavailable("the engine process did not answer in time", code="engine_timeout",
                          headers={"Retry-After": "1"})

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        with self._sockets_lock:
            for sock in self._sockets:
                sock.close(linger=0)
        self._context.term()

    # -- the link's thread --------------------------------------------------------------------

    def _watch(self) -> None:
        control = self._context.socket(zmq.DEALER)
        control.setsockopt(zmq.LINGER, 0)
        control.setsockopt(zmq.IMMEDIATE, 1)
        events = control.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(control, zmq.POLLIN)
        poller.register(events, zmq.POLLIN)
        heard = 0.0
        next_ping = next_snapshot = 0.0
        next_keep = time.monotonic() + LOST_AFTER_S
        try:
            control.connect(self.address)
            while not self._stop.is_set():
                found = dict(poller.poll(int(_TICK_S * 1000)))
                if events in found:
                    event = recv_monitor_message(events)["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        self._lost("its socket closed")
                    elif event == zmq.EVENT_CONNECTED:
                        next_ping = 0.0  # say hello now
                while control in found and control.poll(0):
                    heard = time.monotonic()
                    self._heard(wire.decode_to_front(control.recv()))
                now = time.monotonic()
                if self.card is not None and self.state != "loading" \
                        and now - heard > LOST_AFTER_S:
                    self._lost(f"no answer for {LOST_AFTER_S}s")
                if self._keeper is not None and self.state in ("loading", "unhealthy") \
                        and now >= next_keep:
                    next_keep = now + LOST_AFTER_S  # none has answered: start one if needed
                    self._failed(self._keeper())
                if now >= next_ping:
                    next_ping = now + _PING_S
                    hello = wire.Ping(os.getpid()) if self.state != "loading" \
                        else wire.Hello(os.getpid())
                    _send(control, hello)
                if self._snapshot is not None and now >= next_snapshot \
                        and self.state != "loading":
                    next_snapshot = now + _SNAPSHOT_S
                    _send(control, wire.Snapshot(os.getpid(), *self._snapshot()))
        except Exception:  # noqa: BLE001 - the front must hear the engine is gone, not hang
            log.exception("the link to the engine failed")
            self._lost("the link failed")
        finally:
            control.disable_monitor()
            events.close(linger=0)
            control.close(linger=0)

    def _heard(self, frame: Any) -> None:
        if isinstance(frame, wire.Card):
            if self.engine_pid is not None and frame.pid != self.engine_pid:
                self.generation += 1  # a new engine: the old one's requests are lost
            self.card, self.engine_pid = frame, frame.pid
            self.state, self.queue_limit = frame.state, frame.queue_limit
            log.info("engine ready: pid=%d device=%s model=%s (this front: pid %d)",
                     frame.pid, frame.info.get("device"), frame.info.get("name"), os.getpid())
            self._carded.set()
        elif isinstance(frame, wire.Pong):
            if self.engine_pid is not None and frame.pid != self.engine_pid:
                self._lost("another engine answered")
                return
            self.state, self.queue_limit, self.fronts = frame.state, frame.queue_limit, \
                frame.fronts

    def _failed(self, why: str | None) -> None:
        """The keeper could not start an engine: unhealthy, and why, until one answers."""
        if why is not None and self.state != "unhealthy":
            self.state = "unhealthy"
            log.error("%s", why)

    def _lost(self, why: str) -> None:
        if self.state == "loading":
            return
        self.generation += 1
        self.state = "loading"
        log.warning("the engine process (pid %s) is gone (%s); waiting for a new one",
                    self.engine_pid, why)


def _send(sock: zmq.Socket, frame: wire.Frame) -> None:
    with contextlib.suppress(zmq.Again):  # not connected (yet): the next tick tries again
        sock.send(wire.encode(frame), zmq.NOBLOCK)


class RemotePort:
    """The engine process as ``EngineClient``'s port: admission and batching happen there.

    Tenants' quotas are charged there too, on arrival, after this process tokenized the
    request. So that a tenant over a rate quota does not cost its fronts the tokenizing of
    every refused request, the engine's refusal says how long the quota stays spent
    (``Failed.empty_s``), and ``admit`` refuses the tenant's requests here, with the same
    error and the Retry-After left, for that long but at most ``_RECHECK_S``: the engine
    decides again at least that often, since a reload of the keys file or a refund (a
    parked request of the tenant withdrawn) can free the quota sooner than it said. So one
    refused request a second per front is tokenized, not all of them.
    """

    def __init__(self, link: Link) -> None:
        self.link = link
        self._ids = itertools.count(1)
        self._draining = False
        self._in_flight = 0
        self._cond = threading.Condition()
        # tenant -> (refused here until, the engine's wait ends, its refusal)
        self._spent: dict[str, tuple[float, float, wire.Failed]] = {}

    @property
    def state(self) -> str:
        return "draining" if self._draining else self.link.state

    @property
    def alive(self) -> bool:
        return self.state == "ready"

    @property
    def queue_limit(self) -> int:
        return self.link.queue_limit

    def admit(self, work: Work, tokens: int) -> None:
        """The engine admits (on arrival, with the exact tokens); here, only whether it is
        there to ask: 503 while it is loading, gone or draining."""
        state = self.state
        if state == "draining":
            raise shutting_down({"Retry-After": "1"})
        if state != "ready":
            raise Unavailable("the engine process is starting; retry in a few seconds",
                              code=state, headers={"Retry-After": "1"})
        if work.tenant is not None and self._spent:
            self._refuse_if_spent(work.tenant)

    def _refuse_if_spent(self, tenant: str) -> None:
        """The engine's last refusal of ``tenant``'s rate quota again, while it holds."""
        held = self._spent.get(tenant)
        if held is None:
            return
        recheck, until, refusal = held
        now = time.monotonic()
        if now >= recheck:
            self._spent.pop(tenant, None)
            return
        error = error_of(refusal)
        error.headers["Retry-After"] = str(max(1, math.ceil(until - now)))
        raise error

    def cancel(self, ticket: None) -> None:
        """Nothing is reserved on this side."""

    def submit(self, work: Work, ticket: None) -> Pending:
        sock = self.link.socket()
        request_id = next(self._ids)
        generation = self.link.generation
        assert work.deadline is not None
        rows: list[Any] = work.ids
        images: dict[str, Any] = {}
        if work.kind == IMAGE:  # the pixels beside the ids
            rows, images = wire.pack_pixels(rows)
        ids, lengths, seconds = wire.pack_ids(rows)
        frame = wire.Submit(request_id, work.kind, ids, lengths, seconds, raw=work.raw,
                            timeout=work.deadline - time.monotonic(),
                            flow=None if work.flow is None else repr(work.flow),
                            tenant=work.tenant, front=os.getpid(), **images)
        self.link.send(sock, wire.encode(frame))
        with self._cond:
            self._in_flight += 1
        give_up = work.deadline + ANSWER_GRACE_S
        return Pending(lambda: self._wait(sock, request_id, generation, work, give_up))

    def _wait(self, sock: zmq.Socket, request_id: int, generation: int, work: Work,
              give_up: float) -> Embedded:
        cancelled_at = None
        try:
            while True:
                if sock.poll(int(_TICK_S * 1000)):
                    frame = _for(request_id, wire.decode_to_front(sock.recv()))
                    if frame is not None:
                        if isinstance(frame, wire.Failed) and frame.empty_s > 0 \
                                and work.tenant is not None:
                            now = time.monotonic()
                            self._spent[work.tenant] = (
                                now + min(frame.empty_s, _RECHECK_S), now + frame.empty_s,
                                frame)
                        return embedded(frame, work.kind)
                    continue  # an answer to an earlier request of this thread
                if self.link.generation != generation:
                    raise Unavailable(_ENGINE_GONE, code="engine_gone",
                                      headers={"Retry-After": "1"})
                if time.monotonic() > give_up:
                    _send(sock, wire.Cancel(request_id))  # the engine may drop it now
                    raise DeadlineExceeded("the engine process did not answer in time",
                                           code="timeout")
                if cancelled_at is None and work.disconnected is not None \
                        and work.disconnected():
                    cancelled_at = time.monotonic()
                    _send(sock, wire.Cancel(request_id))
                elif cancelled_at is not None and \
                        time.monotonic() - cancelled_at > _CANCEL_GRACE_S:
                    raise ClientDisconnected("the client disconnected",
                                             code="client_disconnected")
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def shutdown(self, timeout: float) -> ShutdownReport:
        """Refuse new work (503); wait up to ``timeout`` for this front's requests in the
        engine to be answered."""
        self._draining = True
        until = time.monotonic() + timeout
        with self._cond:
            while self._in_flight and (left := until - time.monotonic()) > 0:
                self._cond.wait(left)
            left_over = self._in_flight
        return ShutdownReport(0, left_over, left_over == 0)


def _for(request_id: int, frame: Any) -> Any:
    """The answer to ``request_id`` in ``frame`` (an ``Answers`` holds several), or None."""
    if isinstance(frame, wire.Answers):
        return next((item for item in frame.items if item.id == request_id), None)
    return frame if getattr(frame, "id", None) == request_id else None


def embedded(frame: Any, kind: str) -> Embedded:
    """An answer frame to work of ``kind`` as ``Embedded`` (its tokens and tokenizing time
    are the front's)."""
    if isinstance(frame, wire.Failed):
        raise error_of(frame)
    if isinstance(frame, wire.Answer):
        try:
            out = WORK_KINDS[kind].unpack(wire.arrays(frame))
        except (KeyError, ValueError) as exc:
            raise Unavailable(f"the engine's answer does not read as {kind} work ({exc})",
                              code="engine_protocol") from None
        out.queue_s, out.inference_s = frame.queue_s, frame.inference_s
        out.batch_size = frame.batch_size
        return out
    raise Unavailable(f"the engine answered with {type(frame).__name__}",
                      code="engine_protocol")
