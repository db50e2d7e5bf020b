"""A front's side of the engine's socket: ``Link`` (the card, the engine's state, its
liveness, and the one tracker of this front's requests in the engine) and ``RemotePort``
(the engine as ``EngineClient``'s port).

The front has one connection to the engine (``stream.Stream``), read by one thread at a
time. A request thread lists its request's future (``_Call``) with the link as it queues
its ``Reserve`` (room in the engine's admission, before it tokenizes), then queues its
``Submit``, sends what is queued itself (its reservation and its ids in one frame), and
waits for the future, until its deadline. Where another thread is sending at that
moment, what is queued meanwhile goes as one ``Submits`` frame, sent by the link's thread
(woken through a pipe only where no wake-up is pending yet). The front's one request in
the engine reads the connection itself while it waits (``Link.wait``); otherwise the link's
thread does. Whoever reads routes every answer (an ``Answer``, a ``Failed``, a ``Granted``,
each row of a ``Rows``, or each of an ``Answers``) and sets the future it answers, which
wakes that request's thread and no other. The link's thread pings the engine every half
second, sends this front's metrics every second, cancels the requests whose
client left, and watches the connection (connecting again until an engine listens):
when the engine process is gone (its connection closes, it stops answering, another answers),
it fails every future in it at once with 503 ``engine_gone`` and ``Retry-After``, and
/health says ``loading`` until the supervisor's new engine answers a ``Hello`` with its card.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import msgspec

from ..admission import deadline_error
from ..errors import (
    ApiError,
    ClientDisconnected,
    DeadlineExceeded,
    EngineGone,
    QuotaExceeded,
    Unavailable,
    shutting_down,
)
from ..work import IMAGE, Embedded, Pending, ShutdownReport, Work
from ..work_kinds import WORK_KINDS, wants_units
from . import wire
from .stream import Stream, connect
from .wake import WakePipe

log = logging.getLogger(__name__)

_TICK_S = 0.1  # how often the link looks at the engine's liveness and the clients
_PING_S = 0.5
_SNAPSHOT_S = 1.0
# An engine silent this long is gone: one that dies closes its socket, which tells sooner;
# this is for one that hangs, and is long enough for a front whose interpreter is busy
# (building its tokenizer from the card held it 1.7 s once) not to mistake its own pause.
LOST_AFTER_S = 3.0
# A gap longer than this between two of the link's looks at the engine is this process's own
# pause (SIGSTOP, a host that did not schedule it, its interpreter held): not the engine's silence
_STALL_S = 0.5
_CANCEL_GRACE_S = 1.0  # how long a departed client's request waits for the engine's 499
# How long past its deadline, or past the engine's last pong that listed it as held, a
# request waits for the engine's answer: the engine answers 504 at the deadline itself (its
# sweep looks every 0.1 s) unless the request reached the model; past this, the front does
ANSWER_GRACE_S = 2.0
_CONNECT_S = 1.0  # how long a queued frame waits for the socket to connect
_RETRY_S = 0.01  # how soon a link with frames waiting tries to connect again
_RECHECK_S = 1.0  # the longest a tenant's spent quota is refused here without the engine
# The most bytes of ids and pixels one Submits frame carries: the engine closes the
# connection of a frame past the largest one request can make, which is at least 1 MiB
# (wire.max_frame_bytes' margin), and that would cost every request of this front
_BURST_BYTES = 1 << 19
# What a Submit's encoding adds to its arrays (its field names, numbers, kind), counted
# beside them: one-input requests are a dozen bytes of ids in a frame of some 160
_SUBMIT_BYTES = 256
# A request this large waits for the engine's grant before it tokenizes (``Reserve.tell``),
# so that a refusal costs no tokenizing; a smaller one tokenizes at once (a round trip would
# cost it more than its tokenizing) and the engine holds its ids until the grant.
_TELL_INPUTS = 8
_TELL_TOKENS = 1024
_IN = select.POLLIN
# While a request thread reads the connection, the link's poll waits for its peer's hang-up
# alone (where the platform tells it apart; else the link's tick sees it within _TICK_S)
_HANGUP = getattr(select, "POLLRDHUP", 0)
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


class _Call:
    """A question to the engine, answered by the link's thread: a request's future (its
    answer frame, or the error that ended it), or a scrape's. ``disconnected`` (the
    request's client left), ``cancelled_at``: the link's, for a departed client."""

    __slots__ = ("id", "disconnected", "cancelled_at", "held_at", "answer", "error", "_unset",
                 "submitted", "_granted")

    def __init__(self, request_id: int, disconnected: Callable[[], bool] | None = None,
                 tell: bool = False) -> None:
        self.id = request_id
        self.disconnected = disconnected
        self.cancelled_at: float | None = None
        self.held_at = 0.0  # when the engine last said it holds the request (Pong.holding)
        self.answer: Any = None
        self.error: ApiError | None = None
        self.submitted = False  # its ids were queued: the engine holds its reservation now
        # held until settled: a bare lock costs a tenth of an Event's wait and set, and
        # the link settles a call once (whoever takes it off the link's lists settles it)
        self._unset = threading.Lock()
        self._unset.acquire()
        # a reservation that asked to be told: set when granted (or settled: refused);
        # an Event, since both may come, and only requests large enough to wait have one
        self._granted = threading.Event() if tell else None

    def settle(self, answer: Any = None, error: ApiError | None = None) -> None:
        self.answer, self.error = answer, error
        self._unset.release()
        self.grant()  # a waiter for the grant hears the refusal

    def grant(self) -> None:
        if self._granted is not None:
            self._granted.set()

    def wait_granted(self, timeout: float) -> bool:
        """Whether the engine granted the reservation, or answered otherwise, within
        ``timeout`` seconds."""
        return self._granted is None or self._granted.wait(max(0.0, timeout))

    def wait(self, timeout: float | None) -> bool:
        """Whether it was settled within ``timeout`` seconds (None: however long)."""
        if timeout is None:
            got = self._unset.acquire()
        elif timeout > 0:
            got = self._unset.acquire(timeout=timeout)
        else:
            got = self._unset.acquire(blocking=False)
        if got:
            self._unset.release()  # settled for every later look too
        return got

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.answer


class Link:
    """This front's connection to the engine at ``address``.

    ``state``: ``loading`` until the engine's card arrives (and again while it is gone),
    then the engine's own (``ready``, ``draining``, ``unhealthy``). ``snapshot()`` gives this
    front's metrics to send; ``keeper()``, called while no engine answers, starts one if
    there is none (where no supervisor does). A request goes through ``send_call`` (its
    future) and ``post`` (later frames about it, ``Cancel``); a scrape through ``ask``.
    """

    def __init__(self, address: str,
                 snapshot: Callable[[], tuple[int, int, list[Any]]] | None = None,
                 keeper: Callable[[], str | None] | None = None) -> None:
        self.address = address
        self._keeper = keeper  # starts an engine when there is none (gunicorn's workers)
        self.card: wire.Card | None = None
        self.state = "loading"
        self.engine_pid: int | None = None
        self.queue_limit = 0
        self.fronts: list[int] = []
        self._snapshot = snapshot
        # the connection: read by whoever holds ``_reader`` (``wait``); sent on, flushed,
        # replaced and closed under ``_send_lock``, by the link or by a request thread
        # (``_send_now``), and replaced or closed by the link holding ``_reader`` too
        self._stream: Stream | None = None
        self._send_lock = threading.Lock()  # also over ``_unsent``
        self._reader = threading.Lock()
        self._reading = False  # the link's thread holds ``_reader`` and polls for reads
        self._own_poll: tuple[Stream, Any] | None = None  # the reading request's poll
        self._events = 0  # what the link's poll waits for on the connection
        self._poller = select.poll()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the futures listed, the askers, the state's loss
        self._calls: dict[int, _Call] = {}
        self._askers: deque[tuple[type, int | None, _Call]] = deque()  # ``ask``'s
        self._outbox: deque[tuple[float, wire.Frame]] = deque()  # any thread appends
        self._unsent: list[tuple[float, wire.Frame]] = []  # under ``_send_lock``
        self._wake = WakePipe()  # frames to send, a reader that leaves: from request threads
        self._heard_at = 0.0
        self._looked_at = time.monotonic()  # the link's last look at the engine (``_tick``)
        self._next_ping = self._next_snapshot = self._next_tick = 0.0
        self._pinged = False  # a ping awaits its pong: the link reads for it
        self._next_keep = time.monotonic() + LOST_AFTER_S
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

    def next_id(self) -> int:
        return next(self._ids)

    def send_call(self, frame: wire.Reserve | wire.Submit,
                  disconnected: Callable[[], bool] | None) -> _Call:
        """``frame`` (a request's first: its reservation) on its way, and its future; 503
        while no engine answers. A reservation that does not wait for its grant goes with
        the next frame the link sends (its request's ids at the latest), not in a wake-up of
        its own: one frame and one wake-up of the engine for the two where requests are
        few."""
        tell = isinstance(frame, wire.Reserve) and frame.tell
        call = _Call(frame.id, disconnected, tell)
        with self._lock:
            if self.state == "loading":
                raise _gone(_NOT_CONNECTED)
            self._calls[call.id] = call
            # queued with the listing: a Cancel the link queues for a call it sees listed
            # goes after its Submit, never before (the engine ignores a Cancel of no request)
            self._outbox.append((time.monotonic(), frame))
        if tell or not isinstance(frame, wire.Reserve):
            self._send_now()
        if tell:  # its grant is read by the link's thread (``_settle_mode``)
            self._signal()
        return call

    def send_ids(self, call: _Call, frame: wire.Submit) -> None:
        """A reserved request's ``Submit`` on its way, unless its future is settled (a
        refusal, the engine gone: the wait raises it)."""
        call.submitted = True
        with self._lock:
            if call.id not in self._calls:
                return
            self._outbox.append((time.monotonic(), frame))
        self._send_now()

    def _send_now(self) -> None:
        """What is queued, sent by this (request) thread at once, without a wake-up of the
        link's: where another thread is sending already (it may have taken its frames before
        this one's), or the connection is not there or cannot take it all, the link is woken
        to see to it."""
        if not self._send_lock.acquire(blocking=False):
            self._signal()
            return
        try:
            self._flush_locked()
            stream = self._stream
            if stream is None or stream.pending:
                self._signal()
        finally:
            self._send_lock.release()

    def wait(self, call: _Call, timeout: float) -> bool:
        """Whether ``call`` was answered within ``timeout`` seconds. This front's one request
        in the engine, where no other thread reads the connection, reads it itself and
        routes what comes, its own answer among it: the link's thread is not woken to read
        it and then wake this one. Others wait for the reader to set their futures (the
        link's thread, woken where none reads: several requests in flight is where one
        wake-up of it reads many answers). A reader that leaves while other requests are in
        the engine wakes the link's thread, which reads for them (``_settle_mode``)."""
        if call.wait(0):
            return True
        end = time.monotonic() + timeout
        if len(self._calls) == 1 and self._reader.acquire(blocking=False):
            self._read_for(call, end)
        elif not self._reader.locked():  # nobody reads: the link's thread will
            self._signal()
        return call.wait(max(0.0, end - time.monotonic()))

    def _read_for(self, call: _Call, end: float) -> None:
        """Read the connection until ``call`` is answered, ``end``, or the connection ends;
        ``_reader`` held, and let go after. Polled in slices of ``_TICK_S``: a future set by
        the link's thread (the engine gone, the client gone) is seen within one."""
        stream = self._stream
        try:
            if stream is None:
                return
            own = self._own_poll
            if own is None or own[0] is not stream:
                poll = select.poll()
                poll.register(stream.fileno(), _IN)
                own = self._own_poll = (stream, poll)
            # answered first: the link's thread may have read it between this thread's
            # look at its future and its taking the reader (its tick, its pong)
            while not call.wait(0) and not stream.closed and self._stream is stream:
                left = end - time.monotonic()
                if left <= 0:
                    break
                if own[1].poll(math.ceil(min(left, _TICK_S) * 1000)):
                    self._read(stream)
        except Exception:  # noqa: BLE001 - what it read may be others' answers: fail them all
            log.exception("reading the engine's connection failed")
            self._lost("a read of its connection failed")
        finally:
            with self._lock:
                self._reader.release()
                # others wait on the engine (this one too, where it was not answered): a
                # request listed before this release is seen here, and one listed after
                # finds the reader free; so does a frame waiting to go, or a closed
                # connection: the link's thread sees to it
                hand = bool(self._calls or self._askers)
            if hand or self._outbox or stream is None or stream.closed:
                self._signal()

    def forget(self, call: _Call) -> bool:
        """Stop waiting for ``call``'s answer; False if it has come (or the link failed it)."""
        with self._lock:
            return self._calls.pop(call.id, None) is not None

    def post(self, frame: wire.Frame) -> None:
        """``frame`` to the engine, by the link's thread, with whatever else is queued. The
        pipe is written only where no wake-up is pending: the link drains it before it
        clears the flag, so a wake-up is never lost (wake.py)."""
        self._outbox.append((time.monotonic(), frame))
        self._signal()

    def _signal(self) -> None:
        self._wake.wake()

    def ask(self, frame: wire.Frame, expect: type, timeout: float) -> Any:
        """One question that has no request id (a scrape): the next ``expect`` that carries
        the question's ``seq`` (where it has one) answers it."""
        call = _Call(0)
        asker = (expect, getattr(frame, "seq", None), call)
        with self._lock:
            if self.state == "loading":
                raise _gone(_NOT_CONNECTED)
            self._askers.append(asker)
        self.post(frame)
        if not call.wait(timeout):
            with self._lock, contextlib.suppress(ValueError):
                self._askers.remove(asker)
            if not call.wait(0):
                raise Unavailable("the engine process did not answer in time",
                                  code="engine_timeout", headers={"Retry-After": "1"})
        return call.result()

    def close(self) -> None:
        if self._stop.is_set():  # closed already: its pipe's numbers may be another's now
            return
        self._stop.set()
        self.post(wire.Ping(os.getpid()))  # wakes the link's thread now
        if self._thread.is_alive():
            self._thread.join(2)
        self._wake.close()

    # -- the link's thread --------------------------------------------------------------------

    def _watch(self) -> None:
        self._poller.register(self._wake.fileno(), _IN)
        try:
            while not self._stop.is_set():
                if self._stream is None:
                    self._connect()
                # frames wait for a connection: it is tried again soon
                wait = _RETRY_S if self._stream is None and self._unsent else _TICK_S
                self._turn(self._poller.poll(int(wait * 1000)))
        except Exception:  # noqa: BLE001 - the front must hear the engine is gone, not hang
            log.exception("the link to the engine failed")
            self._lost("the link failed")
        finally:  # closing: no request waits on a link that is gone, nor lists itself after
            with self._lock:
                self.state = "loading"
            self._fail_all(shutting_down)
            with self._send_lock:
                if self._stream is not None:
                    self._stream.close()

    def _connect(self) -> None:
        """A connection to the engine, if one listens; the hello goes at once."""
        try:
            stream = connect(self.address)
        except OSError:  # none yet (starting, or gone): the next turn tries again
            return
        with self._send_lock:
            self._stream = stream
        self._events = 0
        self._poller.register(stream.fileno(), 0)
        self._settle_mode()  # it reads the card
        self._next_ping = self._next_tick = 0.0  # say hello now

    def _disconnected(self) -> None:
        stream = self._stream
        assert stream is not None
        if not self._reading:  # a request thread reading it sees it closed and lets go
            self._reader.acquire()
            self._reading = True
        try:
            self._poller.unregister(stream.fileno())
            with self._send_lock:  # no request thread sends on it, or on its number reused
                stream.close()
                self._stream = None
        finally:
            self._reading = False
            self._reader.release()
        self._lost("its socket closed")

    def _turn(self, found: list[tuple[int, int]]) -> None:
        stream = self._stream
        for fd, event in found:
            if fd == self._wake.fileno():
                self._wake.woken()  # drained, then cleared (wake.py)
            elif stream is not None and fd == stream.fileno():
                if event & select.POLLOUT:
                    with self._send_lock:
                        stream.flush()
                if event & ~select.POLLOUT:  # frames, or (not reading) its hang-up
                    self._read_as_link(stream, wait=True)
        if stream is not None and stream.closed:
            self._disconnected()
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + _TICK_S
            self._tick(now)
        if self._outbox or self._unsent:
            self._flush()
        self._settle_mode()

    def _read_as_link(self, stream: Stream, wait: bool) -> None:
        """Read ``stream`` from the link's thread: at once where it is the reader, else
        once no request thread reads (``wait``: waiting for that one to let go, which it
        does within ``_TICK_S``); else not at all."""
        if self._reading:
            self._read(stream)
        elif self._reader.acquire(timeout=2 * _TICK_S) if wait \
                else self._reader.acquire(blocking=False):
            try:
                self._read(stream)
            finally:
                self._reader.release()

    def _settle_mode(self) -> None:
        """The link's thread reads the connection (holds ``_reader``, polls for frames)
        while anything waits on the engine that no request thread is reading for: a request
        between its reservation and its wait, or whose reader let go, a reservation waiting
        for its grant, a scrape, the engine's card, the pong to its ping (the engine's
        state, its fronts: read as it comes). Otherwise it lets go, and a request
        thread that waits alone reads its own answer (``wait``); the link's poll then waits
        for the connection's hang-up only (and for room to write, while bytes wait)."""
        stream = self._stream
        if stream is None:
            return
        with self._lock:
            wanted = bool(self._calls or self._askers) or self.state == "loading" \
                or self._pinged
            if self._reading and not wanted:
                self._reading = False
                self._reader.release()
        if wanted and not self._reading:
            self._reading = self._reader.acquire(blocking=False)
        events = (_IN if self._reading else _HANGUP) | (select.POLLOUT if stream.pending
                                                         else 0)
        if events != self._events:
            self._events = events
            self._poller.modify(stream.fileno(), events)

    def _tick(self, now: float) -> None:
        self._discount_stall(now)
        stream = self._stream
        if stream is not None and not self._reading:  # the pongs, where no request reads
            self._read_as_link(stream, wait=False)
            if stream.closed:
                self._disconnected()
        if self.card is not None and self.state != "loading" \
                and now - self._heard_at > LOST_AFTER_S:
            self._lost(f"no answer for {LOST_AFTER_S}s")
        if self._keeper is not None and self.state in ("loading", "unhealthy") \
                and now >= self._next_keep:
            self._next_keep = now + LOST_AFTER_S  # none has answered: start one if needed
            try:
                why = self._keeper()
            except Exception:  # noqa: BLE001 - a full disk, say: the next look tries again
                log.exception("starting the engine process failed; trying again")
            else:
                self._failed(why)
        if now >= self._next_ping:
            self._next_ping = now + _PING_S
            self._pinged = self.state != "loading"
            self._send(wire.Ping(os.getpid()) if self._pinged else wire.Hello(os.getpid()))
        if self._snapshot is not None and now >= self._next_snapshot \
                and self.state != "loading":
            self._next_snapshot = now + _SNAPSHOT_S
            self._send(wire.Snapshot(os.getpid(), *self._snapshot()))
        self._sweep_departed(now)

    def _discount_stall(self, now: float) -> None:
        """The time this process did not run is not counted as the engine's silence: no
        ping went out meanwhile, and what the engine sent is still unread. Counted, a front
        stopped for longer than ``LOST_AFTER_S`` took a live engine for gone the moment it
        ran again, and answered 503 the requests the engine was computing for it."""
        stalled = now - self._looked_at - _STALL_S
        if stalled > 0:  # never past now: a frame read as the process ran again was heard then
            self._heard_at = min(self._heard_at + stalled, now)
        self._looked_at = now

    def _read(self, stream: Stream) -> None:
        frames = stream.read()
        if not stream.closed:  # bytes came: the engine lives, though a frame is not whole
            self._heard_at = time.monotonic()
        elif stream.broken is not None:  # closed, then the engine is looked for again
            log.warning("the engine's connection sent what is not a frame (%s)", stream.broken)
        for data in frames:
            try:
                frame = wire.decode_to_front(data)
            except ValueError as exc:  # msgspec's DecodeError and ValidationError
                log.warning("a malformed frame from the engine was dropped (%s)",
                            str(exc)[:200])
                continue
            self._route(frame)

    def _send(self, frame: wire.Frame) -> None:
        """A frame of the link's own (a ping, a snapshot): dropped while not connected (the
        next tick sends another)."""
        with self._send_lock:
            if self._stream is not None:
                self._stream.send(wire.encode(frame))

    def _route(self, frame: Any) -> None:
        """An answer to the future it answers; the engine's card and pongs to the link."""
        if isinstance(frame, (wire.Answer, wire.Rows, wire.Failed, wire.Granted)):
            self._settle([frame])
        elif isinstance(frame, wire.Answers):
            self._settle(frame.items)
        elif isinstance(frame, (wire.Card, wire.Pong)):
            self._heard(frame)
        else:
            seq = getattr(frame, "seq", None)
            with self._lock:
                asker = next((a for a in self._askers
                              if isinstance(frame, a[0]) and a[1] in (None, seq)), None)
                if asker is not None:
                    self._askers.remove(asker)
            if asker is not None:  # else a late answer to a question that gave up
                asker[2].settle(frame)

    def _settle(self, answers: list[wire.Answer | wire.Rows | wire.Failed | wire.Granted]
                ) -> None:
        pop, get = self._calls.pop, self._calls.get
        calls: list[tuple[_Call | None, Any]] = []
        with self._lock:
            for item in answers:
                if isinstance(item, wire.Rows):  # each request its own row
                    calls += [(pop(i, None), wire.Row(item, k)) for k, i in enumerate(item.ids)]
                else:
                    calls.append((get(item.id) if isinstance(item, wire.Granted)
                                  else pop(item.id, None), item))
        for call, item in calls:
            if call is None:  # its request gave up meanwhile
                continue
            if isinstance(item, wire.Granted):
                call.grant()
            else:
                call.settle(item)

    def _flush(self) -> None:
        with self._send_lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        """What the request threads queued, in as few frames as fit: a run of ``Submit``s
        as one ``Submits`` (one alone as itself). While no engine is connected, frames wait
        for one, at most ``_CONNECT_S``. Under ``_send_lock``."""
        while self._outbox:
            self._unsent.append(self._outbox.popleft())
        stream = self._stream
        if stream is None:
            self._expire_unsent()
            return
        while self._unsent:
            count = _burst(self._unsent)
            frames = _fused([frame for _, frame in self._unsent[:count]])
            stream.send(wire.encode(frames[0] if len(frames) == 1 else wire.Submits(
                cast("list[wire.Reserve | wire.Submit]", frames))))
            del self._unsent[:count]

    def _expire_unsent(self) -> None:
        """Requests queued longer than ``_CONNECT_S`` on a socket that does not connect get
        503; other frames that old are dropped (a scrape's asker times out)."""
        until = time.monotonic() - _CONNECT_S
        late = [frame for queued, frame in self._unsent if queued < until]
        if not late:
            return
        self._unsent = [(queued, frame) for queued, frame in self._unsent if queued >= until]
        with self._lock:
            calls = [self._calls.pop(f.id, None) for f in late
                     if isinstance(f, (wire.Reserve, wire.Submit))]
        for call in calls:
            if call is not None:
                call.settle(error=_gone(_NOT_CONNECTED))

    def _sweep_departed(self, now: float) -> None:
        """A request whose client left: ``Cancel`` to the engine at once (it answers 499),
        and 499 here if that has not come within ``_CANCEL_GRACE_S``."""
        with self._lock:
            watched = [c for c in self._calls.values() if c.disconnected is not None]
        for call in watched:
            if call.cancelled_at is None:
                if call.disconnected():  # type: ignore[misc]
                    call.cancelled_at = now
                    # after its Submit; the engine counts what it had of it as dropped
                    self._outbox.append((now, wire.Cancel(call.id, dropped="disconnected")))
            elif now - call.cancelled_at > _CANCEL_GRACE_S and self.forget(call):
                call.settle(error=ClientDisconnected("the client disconnected",
                                                     code="client_disconnected"))

    def _heard(self, frame: wire.Card | wire.Pong) -> None:
        if isinstance(frame, wire.Card):
            if self.engine_pid is not None and frame.pid != self.engine_pid:
                self._engine_gone()  # a new engine: the old one's requests are lost
            self.card, self.engine_pid = frame, frame.pid
            self.state, self.queue_limit = frame.state, frame.queue_limit
            # the first ping at the next tick: its pong lists the engine's fronts (/info)
            self._next_ping, self._pinged = 0.0, False
            log.info("engine ready: pid=%d device=%s model=%s (this front: pid %d)",
                     frame.pid, frame.info.get("device"), frame.info.get("name"), os.getpid())
            self._carded.set()
        elif self.engine_pid is not None and frame.pid != self.engine_pid:
            self._lost("another engine answered")
        else:
            self.state, self.queue_limit, self.fronts = frame.state, frame.queue_limit, \
                frame.fronts
            self._pinged = False
            self._held(frame.holding)

    def _held(self, ids: list[int]) -> None:
        """The engine holds these requests: their waits go on (``RemotePort._wait``)."""
        now, calls = time.monotonic(), self._calls
        for request_id in ids:
            call = calls.get(request_id)
            if call is not None:
                call.held_at = now

    def _failed(self, why: str | None) -> None:
        """The keeper could not start an engine: unhealthy, and why, until one answers."""
        if why is not None and self.state != "unhealthy":
            self.state = "unhealthy"
            log.error("%s", why)

    def _lost(self, why: str) -> None:
        with self._lock:
            if self.state == "loading":
                return
            self.state = "loading"
        log.warning("the engine process (pid %s) is gone (%s); waiting for a new one",
                    self.engine_pid, why)
        self._engine_gone()

    def _engine_gone(self) -> None:
        """The one place a request learns the engine is gone: every future in it fails
        now, each with its own 503 ``engine_gone``. Each is cancelled too, after its frames:
        an engine only silent for a while reads them when it runs again, and a reservation
        whose ids will now never come would hold its room until its deadline."""
        now = time.monotonic()
        for request_id in self._fail_all(lambda: _gone(_ENGINE_GONE)):
            self._outbox.append((now, wire.Cancel(request_id)))

    def _fail_all(self, error: Callable[[], ApiError]) -> list[int]:
        """Every future failed with ``error``; the ids of the requests among them."""
        with self._lock:
            ids = list(self._calls)
            calls = [*self._calls.values(), *(call for _, _, call in self._askers)]
            self._calls.clear()
            self._askers.clear()
        for call in calls:
            call.settle(error=error())
        return ids


def _gone(message: str) -> EngineGone:
    return EngineGone(message, code="engine_gone", headers={"Retry-After": "1"})


def _burst(queued: list[tuple[float, wire.Frame]]) -> int:
    """How many of the first ``queued`` frames go in one: a run of ``Reserve``s and
    ``Submit``s whose ids, pixels and encoding fit ``_BURST_BYTES`` (at least one), or one
    other frame."""
    size = 0
    for n, (_, frame) in enumerate(queued):
        if isinstance(frame, wire.Submit):
            size += len(frame.ids) + len(frame.lengths) + len(frame.seconds) \
                + len(frame.pixels) + len(frame.images)
        elif not isinstance(frame, wire.Reserve):
            return max(n, 1)
        # its encoding beside its arrays: the names, at UTF-8's most bytes a character
        size += _SUBMIT_BYTES + 4 * (len(frame.tenant or "") + len(frame.flow or ""))
        if n and size > _BURST_BYTES:
            return n
    return len(queued)


def _fused(frames: list[wire.Frame]) -> list[wire.Frame]:
    """``frames`` less each reservation that goes with its request's ids: those ids go as a
    request the engine admits on arrival, which is what the engine made of the two (one
    request admitted with its ids, at its exact tokens: server._Burst), for one frame fewer
    to encode here and to decode there. A reservation sent earlier, or one that asked to be
    told (its request waits for the grant), stays as it is."""
    reserves: dict[int, int | None] = {}  # None: the id came twice (a bug): left as sent
    for i, frame in enumerate(frames):
        if type(frame) is wire.Reserve and not frame.tell:
            reserves[frame.id] = None if frame.id in reserves else i
    if not reserves:
        return frames
    out: list[wire.Frame | None] = list(frames)
    for i, frame in enumerate(frames):
        if type(frame) is wire.Submit and frame.reserved:
            at = reserves.get(frame.id)
            if at is not None:
                out[at] = None
                # a copy: the queued frames stay as they were until they have gone, so that
                # a send that fails before it (an encoding error) is retried as queued
                out[i] = msgspec.structs.replace(frame, reserved=False)
    return [frame for frame in out if frame is not None]


class RemotePort:
    """The engine process as ``EngineClient``'s port: admission and batching happen there.

    ``admit`` reserves the request's room in the engine's admission before it is tokenized,
    as one process reserves it (``Reserve``, docs/batching.md): a request of more than
    ``_TELL_INPUTS`` inputs or ``_TELL_TOKENS`` tokens waits for the engine's grant (a
    refusal costs it no tokenizing), a smaller one tokenizes meanwhile and its ids wait in
    the engine for the grant. ``submit`` sends the ids under that reservation, ``cancel``
    gives back a reservation whose request ends before (a 400 in tokenizing, its client
    gone, its deadline past).

    Tenants' quotas are charged there, on the reservation. So that a tenant over a rate
    quota does not cost its fronts a round trip a request, the engine's refusal says how
    long the quota stays spent (``Failed.empty_s``), and ``admit`` refuses the tenant's
    requests here, with the same error and the Retry-After left, for that long but at most
    ``_RECHECK_S``: the engine decides again at least that often, since a reload of the keys
    file or a refund (a parked request of the tenant withdrawn) can free the quota sooner
    than it said.
    """

    def __init__(self, link: Link) -> None:
        self.link = link
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

    def admit(self, work: Work, tokens: int) -> _Call:
        """Room for ``work`` (about ``tokens``) reserved in the engine, before it is
        tokenized; its refusal raised here (413, 429, 503, 504; 499 when the client leaves
        meanwhile) where the request waits for the grant. 503 while the engine is loading,
        gone or draining."""
        state = self.state
        if state == "draining":
            raise shutting_down()
        if state != "ready":
            raise Unavailable("the engine process is starting; retry in a few seconds",
                              code=state, headers={"Retry-After": "1"})
        if work.tenant is not None and self._spent:
            self._refuse_if_spent(work.tenant)
        assert work.deadline is not None
        tell = work.count > _TELL_INPUTS or tokens > _TELL_TOKENS
        frame = wire.Reserve(self.link.next_id(), work.kind, work.count, tokens,
                             timeout=work.deadline - time.monotonic(),
                             flow=None if work.flow is None else repr(work.flow),
                             tenant=work.tenant, front=os.getpid(), tell=tell)
        with self._cond:  # counted, or refused, in one step with the drain's look
            if self._draining:
                raise shutting_down()
            self._in_flight += 1
        try:
            call = self.link.send_call(frame, work.disconnected)
        except BaseException:
            self._done()
            raise
        if tell:
            try:
                self._await_grant(call, work)
            except ApiError as exc:  # its deadline or its client gone as it waited: dropped
                self.cancel(call, exc.reason if exc.reason in ("timeout", "disconnected")
                            else "")
                raise
            except BaseException:
                self.cancel(call)
                raise
        return call

    def _await_grant(self, call: _Call, work: Work) -> None:
        """Until the engine grants ``call``'s reservation; its refusal raised, 504 at the
        deadline, 499 when the client leaves."""
        assert work.deadline is not None
        while not call.wait_granted(min(_TICK_S, work.deadline - time.monotonic())):
            if time.monotonic() > work.deadline:
                raise deadline_error()
            if work.disconnected is not None and work.disconnected():
                raise ClientDisconnected("the client disconnected", code="client_disconnected")
        if call.wait(0):  # answered instead of granted: a refusal, the engine gone
            self._note_spent(call.answer if call.error is None else None, work)
            embedded(call.result(), work.kind)  # raises it

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

    def cancel(self, call: _Call, dropped: str = "") -> None:
        """A reservation whose request ends before its ids were sent, given back (``Cancel``:
        the engine frees its room, and counts its inputs dropped for the reason ``dropped``
        says, if any: none where this front counted them, or they are no drop, as a 400 found
        as it tokenized); a no-op once they were."""
        if call.submitted:
            return
        call.submitted = True  # once
        if self.link.forget(call) and call.cancelled_at is None:  # else the link did
            self.link.post(wire.Cancel(call.id, dropped=dropped))
        self._done()

    def submit(self, work: Work, call: _Call) -> Pending:
        assert work.deadline is not None
        rows: list[Any] = work.ids
        images: dict[str, Any] = {}
        if work.kind == IMAGE:  # the pixels beside the ids
            rows, images = wire.pack_pixels(rows)
        ids, lengths, seconds = wire.pack_ids(rows)
        frame = wire.Submit(call.id, work.kind, ids, lengths, seconds,
                            raw=work.raw, timeout=work.deadline - time.monotonic(),
                            flow=None if work.flow is None else repr(work.flow),
                            tenant=work.tenant, front=os.getpid(), reserved=True,
                            unit=wants_units(work), **images)
        self.link.send_ids(call, frame)
        give_up = work.deadline + ANSWER_GRACE_S
        return Pending(lambda: self._wait(call, work, give_up))

    def _wait(self, call: _Call, work: Work, give_up: float) -> Embedded:
        """The answer the link sets on ``call``, or the error it ends it with (the engine
        gone, the client gone); 504 and a ``Cancel`` past ``give_up`` and ``ANSWER_GRACE_S``
        past the engine's last pong that held it."""
        try:
            # a request that reached the model before its deadline is computed to the end,
            # as in one process: waited for while the engine's pongs say it holds it
            while not self.link.wait(call, give_up - time.monotonic()):
                if call.held_at + ANSWER_GRACE_S > give_up:
                    give_up = call.held_at + ANSWER_GRACE_S
                    continue
                if self.link.forget(call):
                    self.link.post(wire.Cancel(call.id))  # the engine may drop it now
                    raise DeadlineExceeded("the engine process did not answer in time",
                                           code="timeout")
                break
            call.wait(None)  # set, or being set: it was no longer listed
            frame = call.result()
            self._note_spent(frame, work)
            return embedded(frame, work.kind)
        finally:
            self._done()

    def _done(self) -> None:
        """One request of this front's less in the engine; ``shutdown`` hears it, and only
        it waits: ``_draining`` is set before it takes the lock to wait, so a request that
        ends after it looks finds it set."""
        with self._cond:
            self._in_flight -= 1
            if self._draining:
                self._cond.notify_all()

    def _note_spent(self, frame: Any, work: Work) -> None:
        """A refusal of ``work``'s tenant's rate quota, kept to refuse its next requests
        here while the quota stays spent (``_refuse_if_spent``)."""
        if isinstance(frame, wire.Failed) and frame.empty_s > 0 and work.tenant is not None:
            now = time.monotonic()
            self._spent[work.tenant] = (now + min(frame.empty_s, _RECHECK_S),
                                        now + frame.empty_s, frame)

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


def embedded(frame: Any, kind: str) -> Embedded:
    """An answer frame to work of ``kind`` as ``Embedded`` (its tokens and tokenizing time
    are the front's)."""
    if isinstance(frame, wire.Failed):
        raise error_of(frame)
    if isinstance(frame, (wire.Answer, wire.Row)):
        whole: wire.Answer | wire.Rows
        try:
            if isinstance(frame, wire.Row):  # one row of a batch's ``Rows``
                parts, whole, queue_s = [frame.row()], frame.frame, frame.frame.queue_s[frame.at]
            else:
                parts, whole, queue_s = wire.arrays(frame), frame, frame.queue_s
            out = WORK_KINDS[kind].unpack(parts)
        except (KeyError, ValueError) as exc:
            raise Unavailable(f"the engine's answer does not read as {kind} work ({exc})",
                              code="engine_protocol") from None
        out.queue_s, out.inference_s = queue_s, whole.inference_s
        out.batch_size = whole.batch_size
        if whole.unit:  # normalised in the engine with its batch (``Embed.shape`` takes them)
            out.units = out.vectors
        return out
    raise Unavailable(f"the engine answered with {type(frame).__name__}",
                      code="engine_protocol")
