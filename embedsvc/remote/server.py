"""The engine process's loop: one ``Runner`` served on a Unix socket to every front.

One thread (the loop) owns the listening socket and every front's connection to it
(``stream.Stream``: length-prefixed frames, no thread of their own). At each wake-up it reads
the frames that are there, from every connection that has some, and takes their requests as
one burst. A front reserves a request's room before it
tokenizes it (``Reserve``), as one process does: the reservations of a burst are admitted
by one call without blocking (``Admission.request_many``, each in turn as if alone: one
that does not fit waits in the same FIFO as in one process, parked here until its grant),
a refusal answered at once, a grant when the front asked to be told. Then come the
requests' ids (``Submit``, several in a ``Submits``): each checked, its reservation settled
at the exact tokens, and queued for the batcher by one append with a callback each (a
submit whose reservation is still parked waits with it). It
writes the answers when the batcher's thread (or the watchdog's) says their jobs are done:
those threads only append to a queue and write one byte to a pipe the loop polls, so a
batch's answers cost one wake-up, not one per request, and the answers a turn has for one
front go out in one frame (``Answers``; a lone one as itself), the one-input dense rows of a
batch as one ``Rows`` for each front. Batches form
from every front's requests, in the batcher's one queue, with its turns and admission's
rules, exactly as in one process.

A frame that does not decode, or ids that do not fit the model, are refused there: a
malformed frame (one whose contents its type cannot hold: a front's metrics with a name,
type or value a scrape could not render, ids that do not add up; a request under an id its
connection has in the engine already) is dropped with one log line, a frame larger than
the largest request can make (``wire.max_frame_bytes``), or bytes that are not a frame,
close the sender's connection with one log line as soon as the length is read, and the
loop goes on. A connection that
closes takes its requests with it: they are dropped as a departed client's.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import select
import socket
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from ..admission import Ask, Ticket, deadline_error
from ..batching.batcher import Job
from ..errors import ApiError, ClientDisconnected, InvalidRequest, QuotaExceeded
from ..image.preprocess import Preprocessor
from ..metrics import Metrics, Snapshots, check_families, thread_waiting_seconds
from ..runner import Runner
from ..work import Embedded, Work
from ..work_kinds import WORK_KINDS
from . import wire
from .stream import Stream, socket_path
from .wake import WakePipe

log = logging.getLogger(__name__)

_TICK_S = 0.1  # how often parked requests are checked for their deadline and their client
_DROPPED = ("", "disconnected", "timeout")  # what a front's Cancel may say of its inputs
_BACKLOG = 128  # connections not yet accepted (one a front, and a scrape's at a time)
_IN, _OUT = select.POLLIN, select.POLLIN | select.POLLOUT
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL
# How long a stopping engine, its last request answered, still sends what its fronts have
# not taken yet (a large answer is megabytes, and a front reads it as its turns come)
_LINGER_S = 5.0
# Past this many bytes waiting for a front that has not read them, a ping gets a pong only
# once a ``_PONG_EVERY_S``: pongs are the one frame a peer can have the engine queue for it
# without bound (a front's answers are bounded by admission), and a peer that pings and
# never reads grew the engine by 40 MB a second. A front slow to read its backlog still
# hears, once a second, which of its requests the engine holds (``Pong.holding``: its
# waits go on).
_PONG_BACKLOG = 1 << 20
_PONG_EVERY_S = 1.0
_FRONT_GONE_S = 5.0  # a front not heard from for this long is no longer listed
_FRONT_SILENT_S = 2.0  # a front silent this long (it pings every 0.5 s) whose pid is gone died


@dataclass(eq=False)
class _Request:
    peer: bytes
    id: int
    work: Work | None  # None: reserved, its ids not yet here (``Reserve``)
    ticket: Ticket | None = None
    job: Job | None = None
    gone: bool = False
    result: Embedded | ApiError | None = None  # /embed_all's, computed in its own thread
    front: int | None = None  # the pid of the front it came from
    deadline: float = math.inf
    tell: bool = False  # a reservation that answers ``Granted``


@dataclass
class _Front:
    pid: int
    seen: float = field(default_factory=time.monotonic)


class EngineServer:
    """Serves ``runner`` on ``address`` (``ipc://...``) until ``stop`` and drained.

    ``state()`` is the engine's (``ready``, ``draining``, ``unhealthy``), told to every
    front in its pongs; ``card`` is what a front needs of the model (``Card``'s fields but
    the state); ``metrics`` is the engine's own, merged with the fronts' snapshots for a
    scrape.
    """

    def __init__(self, runner: Runner, address: str, *, card: dict[str, Any],
                 state: Callable[[], str], metrics: Metrics) -> None:
        self.runner = runner
        self.address = address
        self.card = card
        self.state = state
        self.metrics = metrics
        self.snapshots = Snapshots()
        info = runner.info
        # an image-text model's images arrive as float32 arrays of the one shape its
        # preprocessor gives (image/preprocess.py)
        self._image_shape = None if info.image is None else \
            Preprocessor.from_config(info.image).output_shape()
        image_bytes = 0 if self._image_shape is None else \
            4 * math.prod(self._image_shape) * runner.settings.max_images_per_request
        self._frame_limit = wire.max_frame_bytes(
            runner.settings.max_inputs_per_request, info.max_input_tokens, image_bytes)
        self._listener = _listen(socket_path(address))
        self._listener_fd = self._listener.fileno()
        self._listener_ino = os.stat(socket_path(address)).st_ino
        # each front's connection, by its peer name (a reply to a gone one is dropped); what
        # waits to go to a front is bounded by what admission lets in (answers) and by what
        # it asks (pongs, scrapes)
        self._streams: dict[bytes, Stream] = {}
        self._by_fd: dict[int, bytes] = {}
        self._names = itertools.count(1)
        self._poller = select.poll()
        self._poller.register(self._listener_fd, _IN)
        self._wake = WakePipe()  # jobs finished, /embed_all's answers: from other threads
        self._ready: deque[_Request] = deque()  # granted while parked
        self._done: deque[_Request] = deque()  # finished jobs, and /embed_all's answers
        self._parked: dict[tuple[bytes, int], _Request] = {}
        self._reserved: dict[tuple[bytes, int], _Request] = {}  # room held, ids not yet here
        self._running: dict[tuple[bytes, int], _Request] = {}
        # answers and grants, by front
        self._outbox: dict[bytes, list[wire.Answer | wire.Rows | wire.Failed | wire.Granted]] = {}
        self._fronts: dict[bytes, _Front] = {}
        self._ended: list[bytes] = []  # peers whose connection a send closed, this turn
        self._ponged: dict[bytes, float] = {}  # when each peer's last pong was queued
        self._malformed = 0
        self._most_s = runner.settings.request_timeout_s  # see ``_checked_deadline``
        self._most_inputs = runner.settings.max_inputs_per_request
        self._info = info  # the engine's one model's, read for each request's ids
        self._next_front_sweep = 0.0
        self._busy_s = 0.0  # the loop's time between a poll's return and the next poll
        metrics.watch_engine_loop(lambda: self._busy_s, self._waiting_s)
        runner.batcher.on_finished = self._wake_loop
        # a batch's rows normalised where two or more of its requests want theirs: for one
        # alone the loop's numpy calls cost more than its front's (bench/RESULTS.md,
        # 2026-12-07 14:48), and at one client the loop is what the request waits for
        runner.batcher.unit_least = 2
        self._loop_thread = 0  # the loop's thread, once it runs
        self._loop_tid = 0  # its id in the system (``_waiting_s``)

    def _waiting_s(self) -> float | None:
        """Seconds the loop's thread was ready to run but had no CPU (``/metrics``): held
        up by the fronts or anything else on the host's cores (bench/RESULTS.md, 2026-12-07
        15:57); None before the loop runs, or where the platform does not tell."""
        return thread_waiting_seconds(self._loop_tid) if self._loop_tid else None

    @property
    def in_flight(self) -> int:
        return len(self._parked) + len(self._reserved) + len(self._running)

    def run(self, stop: threading.Event) -> None:
        """The loop, until ``stop`` is set, nothing admitted is left unanswered, and the
        answers have gone (``_lingering``)."""
        poller = self._poller
        poller.register(self._wake.fileno(), _IN)
        next_tick = time.monotonic() + _TICK_S
        self._loop_thread = threading.get_ident()
        self._loop_tid = threading.get_native_id()
        batcher = self.runner.batcher
        # a device that costs nothing is run by the loop itself (Batcher.here)
        here = self.runner.device_free and batcher.limits.max_wait_s <= 0
        batcher.here = here
        drained_at: float | None = None  # when a stop found nothing admitted left
        try:
            while True:
                if stop.is_set() and not self.in_flight:
                    drained_at = drained_at or time.monotonic()
                    if not self._lingering(drained_at + _LINGER_S):
                        break
                events = poller.poll(int(_TICK_S * 1000))
                woke = time.perf_counter()
                readable = []
                for fd, event in events:
                    if fd == self._wake.fileno():
                        self._wake.woken()
                    elif fd == self._listener_fd:
                        self._accept()
                    else:
                        peer = self._by_fd.get(fd)
                        if peer is None:
                            continue
                        if event & select.POLLOUT:
                            self._flushed(peer)
                        if event & (_IN | _GONE):
                            readable.append(peer)
                if readable:
                    self._read(readable)
                self._start_granted()
                if here:
                    batcher.compute_here()
                self._answer_done()
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + _TICK_S
                    self._sweep_dead_fronts()
                    self._sweep_parked()
                self._flush()
                if self._ended:
                    self._end_connections()
                self._busy_s += time.perf_counter() - woke
        finally:
            batcher.here = False
            self.close()

    def _lingering(self, until: float) -> bool:
        """Whether answers already computed still wait to go to a front that is there (a
        stopping engine sends them, until ``until``, before it closes the connections)."""
        return time.monotonic() < until and any(
            s.pending and not s.closed for s in self._streams.values())

    def close(self) -> None:
        for peer in list(self._streams):
            self._streams.pop(peer).close()
        with contextlib.suppress(OSError):  # the socket's file, unless another engine's now
            if os.stat(self._listener.getsockname()).st_ino == self._listener_ino:
                os.unlink(self._listener.getsockname())
        self._listener.close()
        self._wake.close()

    # -- frames in ----------------------------------------------------------------------------

    def _accept(self) -> None:
        """A front's new connection: a peer of its own, named for this engine's life."""
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of descriptors: the front retries its connection
            log.warning("a front's connection to the engine was not accepted: %s", exc)
            return
        peer = b"%d" % next(self._names)
        stream = Stream(sock, self._frame_limit)
        self._streams[peer] = stream
        self._by_fd[stream.fileno()] = peer
        self._poller.register(stream.fileno(), _IN)

    def _disconnect(self, peer: bytes) -> None:
        """A front's connection closed (the front stopped or died, or a frame past the
        limit): what it had in the engine has no one to answer, and goes as a departed
        client's (its room freed at the next sweep, its queued inputs dropped)."""
        stream = self._streams.pop(peer)
        del self._by_fd[stream.fileno()]
        self._poller.unregister(stream.fileno())
        stream.close()
        front = self._fronts.pop(peer, None)
        self._outbox.pop(peer, None)
        self._ponged.pop(peer, None)
        if self._drop_where(lambda req: req.peer == peer):
            log.warning("front pid %s is gone: the work of its requests is dropped",
                        front.pid if front is not None else "unknown")

    def _read(self, peers: list[bytes]) -> None:
        """Read what is there on each of ``peers``' connections: the reservations among
        the frames are taken as one burst, then the requests' ids as another (a front sends
        a request's ids after its reservation, so the reservation of any submit read here is
        taken first); a control frame (a cancel, a ping) first has what was read before it
        taken, so that it finds it."""
        burst = _Burst()
        for peer in peers:
            stream = self._streams[peer]
            frames = stream.read()
            if stream.broken is not None:
                self._refuse_frame(f"{stream.broken}: its connection is closed")
            for data in frames:
                frame = self._decoded(data)
                if isinstance(frame, wire.Submits):
                    for item in frame.items:
                        burst.add(peer, item)
                elif isinstance(frame, (wire.Submit, wire.Reserve)):
                    burst.add(peer, frame)
                elif frame is not None:
                    self._reserve(burst)
                    self._submit(burst)
                    burst = _Burst()
                    try:
                        self._dispatch(peer, frame)
                    except ValueError as exc:  # contents the frame's type cannot hold
                        self._refuse_frame(f"{type(frame).__name__}: {exc}")
        self._reserve(burst)
        self._submit(burst)
        for peer in peers:
            if self._streams[peer].closed:
                self._disconnect(peer)

    def _decoded(self, data: bytes | bytearray) -> Any:
        """The frame ``data`` holds; None, said in one line, when it is not one."""
        try:
            return wire.decode_to_engine(data)
        except ValueError as exc:  # msgspec's DecodeError and ValidationError
            self._refuse_frame(str(exc))
            return None

    def _refuse_frame(self, why: str) -> None:
        self._malformed += 1
        log.warning("a malformed frame on the engine socket was dropped (%s); %d so far",
                    why[:200], self._malformed)

    def _dispatch(self, peer: bytes, frame: Any) -> None:
        if isinstance(frame, wire.Cancel):
            self._cancel(peer, frame.id, frame.dropped)
        elif isinstance(frame, wire.Ping):
            self._seen(peer, frame.pid)
            now = time.monotonic()
            if self._streams[peer].waiting <= _PONG_BACKLOG \
                    or now - self._ponged.get(peer, 0.0) >= _PONG_EVERY_S:
                self._ponged[peer] = now
                self._send(peer, wire.Pong(os.getpid(), self.state(),
                                           self.runner.admission.limit, self.fronts(),
                                           self._holding(peer)))
        elif isinstance(frame, wire.Hello):
            self._seen(peer, frame.pid)
            self._drop_earlier_connections(peer, frame.pid)
            self._send(peer, wire.Card(pid=os.getpid(), state=self.state(),
                                       queue_limit=self.runner.admission.limit, **self.card))
        elif isinstance(frame, wire.Snapshot):  # a Scrape too: it carries the asker's own
            check_families(frame.families)
            self._seen(peer, frame.pid)
            self.snapshots.keep(frame.pid, frame.origin, frame.seq, frame.families)
            if isinstance(frame, wire.Scrape):
                own = self.metrics.families(os.getpid())
                self._send(peer, wire.Exposition(self.snapshots.merged(own, self.fronts()),
                                                 seq=frame.seq))

    def _drop_earlier_connections(self, peer: bytes, pid: int) -> None:
        """A front that says hello on a new connection has failed every request it had on
        an earlier one (its link answers them 503 when it loses the engine, and a cancel
        from the new connection cannot name them): they go as a departed client's, their
        room freed at the next sweep, their queued inputs dropped."""
        self._drop_where(lambda req: req.front == pid and req.peer != peer)

    def _held(self) -> list[_Request]:
        """Every request in the engine: reserved, parked or running."""
        return [*self._parked.values(), *self._reserved.values(), *self._running.values()]

    def _drop_where(self, which: Callable[[_Request], bool]) -> int:
        """The requests ``which`` picks go as a departed client's (their room freed at the
        next sweep, their queued inputs dropped); how many were not gone already."""
        picked = [req for req in self._held() if not req.gone and which(req)]
        for req in picked:
            req.gone = True
        return len(picked)

    def _holding(self, peer: bytes) -> list[int]:
        """The ids of ``peer``'s requests in the engine (``Pong.holding``)."""
        return [key[1] for held in (self._parked, self._running) for key in held
                if key[0] == peer]

    def _seen(self, peer: bytes, pid: int) -> None:
        front = self._fronts.get(peer)
        if front is None or front.pid != pid:
            self._fronts[peer] = _Front(pid)
        else:
            front.seen = time.monotonic()

    def fronts(self) -> list[int]:
        """The pids of the fronts heard from lately (their control sockets ping)."""
        now = time.monotonic()
        for peer in [p for p, f in self._fronts.items() if now - f.seen > _FRONT_GONE_S]:
            del self._fronts[peer]
        return sorted({f.pid for f in self._fronts.values()})

    def _reserve(self, burst: _Burst) -> None:
        """Room for requests a front has not yet tokenized, admitted as one burst (one
        ``Admission.request_many``): a refusal answered now, a grant when asked for."""
        if not any(burst.reserves):
            return
        reqs, asks = [], []
        # a reservation under the id of one taken with its ids is a second one
        taken = {(peer, frame.id) for peer, frame, reserve in burst.submits if reserve}
        for reserved in burst.reserves:
            if reserved is None:
                continue
            peer, frame = reserved
            if not self._fresh(peer, frame, taken):
                continue
            try:
                deadline = self._reservation(frame)
            except ApiError as exc:
                self._reply(peer, failed(frame.id, exc))
                continue
            req = _Request(peer, frame.id, None, front=frame.front or None, deadline=deadline,
                           tell=frame.tell)
            reqs.append(req)
            asks.append(Ask(frame.inputs, frame.tokens, deadline, frame.flow, frame.tenant,
                            partial(self._granted, req)))
        for req in self._admit(reqs, asks):
            self._hold(req)

    def _fresh(self, peer: bytes, frame: wire.Reserve | wire.Submit,
               taken: set[tuple[bytes, int]]) -> bool:
        """Whether ``frame`` opens a request under an id its sender has no other request
        under (in the engine, or earlier in this burst, ``taken``); a frame that reuses one
        is dropped as malformed. Taken in, it replaced the first request in the tables
        while the first's ticket stayed open: its room was never given back."""
        key = (peer, frame.id)
        if key in taken or self._holds(key):
            self._refuse_frame(f"{type(frame).__name__} {frame.id}: an id in use")
            return False
        taken.add(key)
        return True

    def _holds(self, key: tuple[bytes, int]) -> bool:
        """Whether a request is in the engine under ``key`` (reserved, parked or running)."""
        return key in self._reserved or key in self._parked or key in self._running

    def _reservation(self, frame: wire.Reserve) -> float:
        """The deadline of a reservation that can be admitted; a 400 for one that cannot
        (a kind this model does not serve is refused before any tokenizing, as in one
        process)."""
        deadline = _checked_deadline(frame, self._most_s, time.monotonic())
        if not 0 < frame.inputs <= self._most_inputs:
            raise InvalidRequest(f"{frame.inputs} inputs in one reservation",
                                 code="invalid_frame")
        self.runner.check(Work(frame.kind, ()))
        return deadline

    def _hold(self, req: _Request) -> None:
        """A granted reservation waits for its ids; a front waiting to be told hears now."""
        self._reserved[(req.peer, req.id)] = req
        if req.tell:
            self._reply(req.peer, wire.Granted(req.id))

    def _give_back(self, req: _Request) -> None:
        """The room of a reservation whose request will not run (refused on its ids, its
        client or front gone, its deadline past), open or still parked."""
        key = (req.peer, req.id)
        if self._reserved.pop(key, None) is not None:
            assert req.ticket is not None
            self.runner.admission.cancel(req.ticket)
        elif self._parked.get(key) is req:
            assert req.ticket is not None
            del self._parked[key]  # a grant on its way finds it gone (``_start_granted``)
            if not self.runner.admission.withdraw(req.ticket):  # granted (or refused) already
                self.runner.admission.cancel(req.ticket)

    def _submit(self, burst: _Burst) -> None:
        """Check, admit and queue the requests of ``burst`` as one unit: one admission call
        (``Admission.request_many``: each in turn, as if one after another) and one append
        to the batcher's queue (one wake-up of its thread) for all. A reserved request is
        admitted already: its ids join its reservation (queued now if it is granted); one
        whose reservation came in this burst is admitted with its ids, as one that asked
        no reservation is."""
        reqs, asks, start = [], [], []
        taken: set[tuple[bytes, int]] = set()
        kinds: set[str] = set()  # those this model serves, checked once a burst
        now = time.monotonic()
        for peer, frame, reserve in burst.submits:
            if reserve is not None and self._holds((peer, frame.id)):
                # the reservation read with it repeats one held already: the ids join that
                self._refuse_frame(f"Reserve {frame.id}: an id in use")
                reserve = None
            if frame.reserved and reserve is None:
                held = self._join(peer, frame, kinds, now)
                if held is not None:
                    start.append(held)
                continue
            if not self._fresh(peer, frame, taken):
                continue
            try:
                work = self._checked(frame, kinds, now)
                if reserve is not None and len(work.ids) != reserve.inputs:
                    raise InvalidRequest(f"{len(work.ids)} inputs under a reservation of "
                                         f"{reserve.inputs}", code="invalid_frame")
            except ApiError as exc:
                self._reply(peer, failed(frame.id, exc))
                continue
            req = _Request(peer, frame.id, work, front=work.front)
            work.disconnected = partial(_is_gone, req)
            reqs.append(req)
            asks.append(Ask(len(work.ids), sum(map(len, work.ids)), work.deadline or 0.0,
                            work.flow, work.tenant, partial(self._granted, req)))
        self._start(start + self._admit(reqs, asks))  # one append to the batcher's queue

    def _admit(self, reqs: list[_Request], asks: list[Ask]) -> list[_Request]:
        """``reqs`` admitted by one call (``asks``, theirs): those with room now; the others
        parked in the FIFO until their grant, or answered their refusal."""
        if not reqs:
            return []
        opened = []
        for req, ticket in zip(reqs, self.runner.admission.request_many(asks), strict=True):
            if isinstance(ticket, ApiError):
                self._reply(req.peer, failed(req.id, ticket))
                continue
            req.ticket = ticket
            if ticket.open:
                opened.append(req)
            else:
                self._parked[(req.peer, req.id)] = req
        return opened

    def _join(self, peer: bytes, frame: wire.Submit, kinds: set[str], now: float
              ) -> _Request | None:
        """A reserved request's ids, joined to its reservation: the request when its room
        is granted (to start now); None when it is still parked (it starts at its grant),
        or was refused, withdrawn or swept (its ``Failed`` has gone: the ids are dropped), or
        its ids are refused (400, its room given back)."""
        key = (peer, frame.id)
        held = self._reserved.get(key) or self._parked.get(key)
        if held is None or held.ticket is None:
            return None
        try:
            work = self._checked(frame, kinds, now)
            if len(work.ids) != held.ticket.inputs:
                raise InvalidRequest(f"{len(work.ids)} inputs under a reservation of "
                                     f"{held.ticket.inputs}", code="invalid_frame")
        except ApiError as exc:
            self._give_back(held)
            self._reply(peer, failed(frame.id, exc))
            return None
        held.work = work
        work.disconnected = partial(_is_gone, held)
        return held if self._reserved.pop(key, None) is not None else None

    def _checked(self, frame: wire.Submit, kinds: set[str], now: float) -> Work:
        """The model side of ``frame``'s ``Work``, checked: ids a model cannot take are a
        400 here, never a failed batch that takes other requests down with it. Its kind is
        checked unless it is among ``kinds`` (checked already: a refusal depends on the kind
        and the model alone), which then holds it; its deadline counts from ``now``, when
        its burst was read."""
        deadline = _checked_deadline(frame, self._most_s, now)
        info = self._info
        try:
            ids = wire.unpack_ids(frame.ids, frame.lengths, frame.seconds,
                                  vocab=info.vocab_size, longest=info.max_input_tokens)
        except ValueError as exc:
            raise InvalidRequest(str(exc), code="invalid_frame") from None
        if not ids or len(ids) > self._most_inputs:
            raise InvalidRequest(f"{len(ids)} inputs in one frame", code="invalid_frame")
        if frame.images:
            if self._image_shape is None:
                raise InvalidRequest("images for a model that takes none", code="invalid_frame")
            try:
                wire.unpack_pixels(frame, ids, self._image_shape, info.image_tokens)
            except ValueError as exc:
                raise InvalidRequest(str(exc), code="invalid_frame") from None
        if not all(ids):  # a front sends an input's ids wrapped, an image its pixels: never none
            raise InvalidRequest("an input of no ids", code="invalid_frame")
        # ``normalize``: the front wants the answer at unit length (``Submit.unit``)
        work = Work(frame.kind, ids, raw=frame.raw, ids=ids, flow=frame.flow,
                    tenant=frame.tenant, front=frame.front, deadline=deadline,
                    normalize=frame.unit)
        if frame.kind not in kinds:
            self.runner.check(work)
            kinds.add(frame.kind)
        return work

    def _cancel(self, peer: bytes, request_id: int, dropped: str = "") -> None:
        """The front gave a request up: a reservation or a parked request goes now (499),
        its inputs counted dropped for the reason ``dropped`` says (as one process counts
        them: its client left, its deadline passed as it waited for room), none where it is
        empty; a queued one loses its inputs at the watchdog's next look
        (``Batcher.cancel_due``), then answers 499."""
        if dropped not in _DROPPED:
            self._refuse_frame(f"Cancel {request_id}: a reason it cannot have ({dropped[:40]!r})")
            dropped = ""
        key = (peer, request_id)
        req = self._parked.get(key) or self._running.get(key) or self._reserved.get(key)
        if req is not None:
            req.gone = True
        reserved = self._reserved.get(key)
        if reserved is not None:
            assert reserved.ticket is not None
            self._give_back(reserved)
            self._dropped(reserved.ticket.inputs, dropped)
            self._reply(peer, failed(request_id, _gone()))
            return
        parked = self._parked.get((peer, request_id))
        if parked is not None and parked.ticket is not None and \
                self.runner.admission.withdraw(parked.ticket):
            del self._parked[(peer, request_id)]
            self._dropped(parked.ticket.inputs, dropped)
            self._reply(peer, failed(request_id, _gone()))

    def _dropped(self, inputs: int, reason: str) -> None:
        if reason:
            self.metrics.dropped_inputs.labels(reason=reason).inc(inputs)

    # -- the model ----------------------------------------------------------------------------

    def _start(self, reqs: list[_Request]) -> None:
        """Admitted requests to the model: the batched ones queued together."""
        batched = []
        for req in reqs:
            assert req.work is not None
            self._running[(req.peer, req.id)] = req
            if WORK_KINDS[req.work.kind].batched:  # a kind its frame's check found
                batched.append(req)
            else:
                threading.Thread(target=self._embed_all, args=(req,),
                                 name="embedsvc-embed-all", daemon=True).start()
        if not batched:
            return
        works = []
        for req in batched:
            assert req.ticket is not None and req.work is not None  # admitted, submitted
            works.append((req.work, req.ticket, partial(self._finished, req)))
        try:
            jobs = self.runner.submit_many(works)
        except ApiError as exc:  # draining: every ticket given back
            for req in batched:
                del self._running[(req.peer, req.id)]
                self._reply(req.peer, failed(req.id, exc))
            return
        for req, job in zip(batched, jobs, strict=True):
            req.job = job

    def _embed_all(self, req: _Request) -> None:
        """/embed_all's per-token work, in a thread of its own (it takes the device between
        batches, as in one process), its admission held meanwhile."""
        assert req.work is not None
        try:
            out: Embedded | ApiError = self.runner.embed_all(req.work, req.ticket)
        except ApiError as exc:
            out = exc
        except Exception:  # noqa: BLE001 - answered as the batch failure it is
            log.exception("per-token work failed")
            out = ApiError("the per-token work failed; retry it", code="batch_failed")
        finally:
            if req.ticket is not None:
                self.runner.admission.cancel(req.ticket)
        req.result = out
        self._finished(req, None)
        self._wake.wake()

    # -- answers, from the loop ---------------------------------------------------------------

    def _granted(self, req: _Request, ticket: Ticket) -> None:
        """Called by admission (any thread, under its lock): a parked request's turn came."""
        self._ready.append(req)
        self._wake.wake()

    def _finished(self, req: _Request, job: Job | None) -> None:
        """Called as a job finishes (the batcher's thread, the watchdog's), which then wakes
        the loop once for all it finished (``Batcher.on_finished``)."""
        self._done.append(req)

    def _wake_loop(self) -> None:
        """``Batcher.on_finished``: jobs finished in another thread wake the loop; the loop
        itself (a device it computes, a deadline it enforced) answers them in this turn."""
        if threading.get_ident() != self._loop_thread:
            self._wake.wake()

    def _start_granted(self) -> None:
        start = []
        while self._ready:
            req = self._ready.popleft()
            if self._parked.pop((req.peer, req.id), None) is None:
                continue  # withdrawn meanwhile
            ticket = req.ticket
            if ticket is not None and ticket.refused is not None:
                self._reply(req.peer, failed(req.id, ticket.refused))
            elif req.work is None:  # a reservation: its ids come later
                self._hold(req)
            else:
                start.append(req)
        if start:
            self._start(start)

    def _answer_done(self) -> None:
        # the one-input dense rows of a batch, by front and by the batch's array (its raw
        # rows or their units): one ``Rows`` frame each; the array held by its group, so
        # that no later batch takes its address (its id) while this turn lasts
        rows: dict[tuple[bytes, int], _Rows] = {}
        while self._done:
            req = self._done.popleft()
            self._running.pop((req.peer, req.id), None)
            job = req.job
            assert req.work is not None
            # a batch's row (never failed after: a job finishes once) of a dense embedding
            if job is not None and job.batch_rows is not None \
                    and WORK_KINDS[req.work.kind].normalises:
                batch = job.batch_units if job.batch_units is not None else job.batch_rows
                group = rows.get((req.peer, id(batch)))
                if group is None:
                    group = rows[req.peer, id(batch)] = _Rows(batch, job)
                group.add(req.id, job)
            else:
                self._reply(req.peer, self._answer(req))
            # answered: its work, ticket and job each hold a callback that holds it (its
            # client's check, its grant, its end), cycles its count alone never freed; the
            # cyclic collector's passes over them took a tenth of the loop
            req.work = req.ticket = req.job = None
        for (peer, _), group in rows.items():
            self._reply(peer, group.frame())

    def _answer(self, req: _Request) -> wire.Answer | wire.Failed:
        """The answer of a request that is not one row of a batch's dense rows (``Rows``):
        a failure, /embed_all's, a kind's own arrays, a request of several inputs."""
        assert req.work is not None
        result = req.result
        if result is None:
            job = req.job
            assert job is not None
            if job.error is not None:
                return failed(req.id, job.error)
            assert job.rows is not None
            try:
                result = self.runner.finish(req.work, job.rows)
            except Exception:  # noqa: BLE001 - a scorer's activation, sparse pairs
                log.exception("shaping the rows of a batch failed")
                return failed(req.id, ApiError("the batch that held this request failed; "
                                               "retry it", code="batch_failed"))
            result.queue_s, result.inference_s = job.queue_s, job.inference_s
            result.batch_size = job.batch_size
        if isinstance(result, ApiError):
            return failed(req.id, result)
        return answer_frame(req.id, req.work.kind, result)

    def _sweep_dead_fronts(self) -> None:
        """The requests of a front that died (SIGKILL, a crash) have no client left to answer:
        they are dropped as a departed client's are (``gone``: parked ones at the next sweep,
        queued inputs at the watchdog's next look), instead of computed until their deadline.
        A front counts as dead when nothing came from it for ``_FRONT_SILENT_S`` and its pid
        no longer exists: both, so that neither a slow front nor a reused pid loses work."""
        now = time.monotonic()
        if now < self._next_front_sweep:  # once a second: it walks every request in flight
            return
        self._next_front_sweep = now + 1.0
        pending = [r for r in self._held() if not r.gone and r.front]
        if not pending:
            return
        heard: dict[int, float] = {}
        for front in self._fronts.values():
            heard[front.pid] = max(front.seen, heard.get(front.pid, front.seen))
        dead = {pid for pid in {r.front for r in pending if r.front is not None}
                if now - heard.get(pid, 0.0) > _FRONT_SILENT_S and not _alive(pid)}
        for req in pending:
            if req.front in dead:
                req.gone = True
        for pid in sorted(dead):
            log.warning("front pid %d is gone: the work of its requests is dropped", pid)

    def _sweep_parked(self) -> None:
        """Parked requests and reservations whose ids never came, past their deadline, get
        504, those whose client (or front) left 499."""
        now = time.monotonic()
        for key, req in [*self._parked.items(), *self._reserved.items()]:
            due = req.deadline if req.work is None or req.work.deadline is None \
                else req.work.deadline
            late = now > due
            if not (late or req.gone) or req.ticket is None:
                continue
            if key in self._reserved:
                self._give_back(req)
            elif self.runner.admission.withdraw(req.ticket):
                del self._parked[key]
            else:  # granted meanwhile: it starts
                continue
            self._dropped(req.ticket.inputs, "timeout" if late else "disconnected")
            self._reply(req.peer, failed(req.id, deadline_error() if late else _gone()))

    def _reply(self, peer: bytes,
               frame: wire.Answer | wire.Rows | wire.Failed | wire.Granted) -> None:
        """An answer to a request, sent with the others of its front at the end of the
        loop's turn (``_flush``)."""
        self._outbox.setdefault(peer, []).append(frame)

    def _flush(self) -> None:
        """One frame per front for every answer this turn has for it: one send, one
        wake-up of its reader for all of them."""
        for peer, frames in self._outbox.items():
            self._send(peer, frames[0] if len(frames) == 1 else wire.Answers(frames))
        self._outbox.clear()

    def _flushed(self, peer: bytes) -> None:
        """The connection to ``peer`` can take more: what waits goes."""
        stream = self._streams[peer]
        stream.flush()
        if stream.closed:
            self._ended.append(peer)
        elif not stream.pending:
            self._poller.modify(stream.fileno(), _IN)

    def _end_connections(self) -> None:
        """Close the connections a send ended (it failed, the front still there): the front
        sees the end, fails what it had here with 503 ``engine_gone`` and connects again;
        what it had here goes as a departed client's."""
        for peer in self._ended:
            stream = self._streams.get(peer)
            if stream is not None and stream.closed:
                log.warning("a send to a front failed: its connection is closed")
                self._disconnect(peer)
        self._ended.clear()

    def _send(self, peer: bytes, frame: wire.Frame) -> None:
        stream = self._streams.get(peer)
        if stream is None:  # the front went away
            log.debug("an answer to a front that has gone was dropped")
            return
        had = stream.pending
        stream.send(wire.encode(frame))
        if stream.closed:
            self._ended.append(peer)
        elif stream.pending and not had:  # the rest when its socket can take it
            self._poller.modify(stream.fileno(), _OUT)
        elif had and not stream.pending:
            self._poller.modify(stream.fileno(), _IN)


class _Burst:
    """The request frames of one read, in order: reservations (``reserves``) and requests'
    ids (``submits``, each with its reservation where that came in this burst too). A small
    request's reservation and ids usually travel together (the front sends the two at
    once): taken as one request admitted with its ids, at its exact tokens, they cost one
    pass, where the reservation's admission, then the ids' joining it, each cost their own.
    The end is the same: the room held at the exact tokens. A reservation that asked to be
    told, or one whose id comes twice, is taken as sent; one that repeats a reservation the
    engine holds already is dropped, and the ids join the one held (``_submit``)."""

    __slots__ = ("reserves", "submits", "_open")

    def __init__(self) -> None:
        self.reserves: list[tuple[bytes, wire.Reserve] | None] = []  # None: taken with ids
        self.submits: list[tuple[bytes, wire.Submit, wire.Reserve | None]] = []
        # a reservation's place in ``reserves`` (None: its id came twice)
        self._open: dict[tuple[bytes, int], int | None] = {}

    @classmethod
    def of(cls, peer: bytes, *frames: wire.Reserve | wire.Submit) -> _Burst:
        burst = cls()
        for frame in frames:
            burst.add(peer, frame)
        return burst

    def add(self, peer: bytes, frame: wire.Reserve | wire.Submit) -> None:
        key = (peer, frame.id)
        if isinstance(frame, wire.Reserve):
            self._open[key] = None if frame.tell or key in self._open else len(self.reserves)
            self.reserves.append((peer, frame))
            return
        at = self._open.get(key) if frame.reserved else None
        if at is None:
            self.submits.append((peer, frame, None))
            return
        self._open[key] = None
        taken = self.reserves[at]
        assert taken is not None
        self.reserves[at] = None  # taken with its ids
        self.submits.append((peer, frame, taken[1]))


def answer_frame(request_id: int, kind: str, out: Embedded) -> wire.Answer:
    """The frame of a computed answer: the arrays its kind packs it into."""
    return wire.answer(request_id, WORK_KINDS[kind].pack(out), out.queue_s, out.inference_s,
                       out.batch_size)


class _Rows:
    """One front's one-input dense answers from one batch's rows (``batch``: the raw rows,
    or their units where the batcher made them), gathered over a turn into one ``Rows``
    frame: one copy of their rows, where each answer cost a slice, a struct and its
    encoding."""

    __slots__ = ("batch", "ids", "at", "queue_s", "inference_s", "batch_size", "unit")

    def __init__(self, batch: np.ndarray, job: Job) -> None:
        self.batch = batch
        self.ids: list[int] = []
        self.at: list[int] = []  # each one's row in ``batch``
        self.queue_s: list[float] = []
        # a one-input job is in one batch: its time and size are the batch's
        self.inference_s, self.batch_size = job.inference_s, job.batch_size
        self.unit = job.batch_units is not None

    def add(self, request_id: int, job: Job) -> None:
        self.ids.append(request_id)
        self.at.append(job.at)
        self.queue_s.append(job.queue_s)

    def frame(self) -> wire.Rows:
        batch, at = self.batch, self.at
        # every row of the batch in order (one front's batch): its bytes as they are, where
        # a gather cost more numpy calls than the rest of a lone request's answer
        rows = batch if at == list(range(len(batch))) else batch[at]
        return wire.Rows(self.ids, np.ascontiguousarray(rows, dtype="<f4").tobytes(),
                         batch.shape[1], self.queue_s, self.inference_s, self.batch_size,
                         unit=self.unit)


def failed(request_id: int, exc: ApiError) -> wire.Failed:
    return wire.Failed(request_id, exc.status, exc.type, exc.reason, exc.message, exc.code,
                       exc.param, dict(exc.headers),
                       exc.empty_s if isinstance(exc, QuotaExceeded) else 0.0,
                       type(exc).__name__)


def _checked_deadline(frame: wire.Reserve | wire.Submit, most_s: float, now: float) -> float:
    """The deadline here of a request's frame read at ``now``: the seconds it says, but
    never more than ``most_s`` (REQUEST_TIMEOUT_S: a front's say at most that; taken as
    sent, a reservation whose ids never came held its room for as long as its sender said).
    A 400 for a kind of work that no kind is, or a deadline that is not a number."""
    if frame.kind not in WORK_KINDS:
        raise InvalidRequest(f"unknown kind of work {frame.kind[:40]!r}", code="invalid_frame")
    timeout = frame.timeout
    if not -math.inf < timeout < math.inf:  # nor NaN
        raise InvalidRequest("a deadline that is not a number of seconds", code="invalid_frame")
    return now + (most_s if timeout > most_s else timeout if timeout > 0 else 0.0)


def _gone() -> ClientDisconnected:
    return ClientDisconnected("the client disconnected", code="client_disconnected")


def _is_gone(req: _Request) -> bool:
    return req.gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it exists
        return True
    return True


def _listen(path: str) -> socket.socket:
    """The engine's listening socket at ``path``, in place of a dead engine's socket file
    there (one engine at a time is started for a directory)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock
