"""The micro-batcher: admission, queue, batch forming, the device lock, deadlines, drain.

One thread owns the model. Request threads ``submit`` their (already tokenized) inputs and
wait on the returned ``Job``; the thread forms each device batch from what is queued when
the device frees up, runs it under the device lock and writes each row back to its job. (A
device that costs nothing is run by the one caller that queues instead: ``here``.)

>>> from embedsvc.model.fake import FakeEncoder
>>> b = Batcher(FakeEncoder(dimension=4).encode, BatchLimits(256, 16384, 0.0, 2048, 1 << 20,
...                                                             30.0, 2048))
>>> b.start()
>>> job = b.submit([[1, 7, 2], [1, 9, 9, 2]], deadline=time.monotonic() + 5)
>>> job.result().shape
(2, 4)
>>> b.shutdown(timeout=1.0).failed
0
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..admission import Admission, Ticket, deadline_error
from ..errors import (
    ApiError,
    BatchFailed,
    ClientDisconnected,
    DeadlineExceeded,
    DeviceOutOfMemory,
    shutting_down,
)
from ..metrics import Metrics
from ..work import ShutdownReport
from . import heap

log = logging.getLogger(__name__)

# A batch keeps growing with longer inputs while the padding it adds stays under this share
# of its padded tokens, or under _FREE_PADDING tokens (small batches cost the same either way).
_MIN_PADDING_EFFICIENCY = 0.8
_FREE_PADDING = 256
_DEEP_QUEUE_SHARE = 0.8
_DEEP_QUEUE_LOG_EVERY_S = 10.0
# Freed heap pages go back to the OS right after a batch, at most this often, and after
# this long without a batch (see heap.py for why).
_TRIM_AFTER_BATCH_S = 0.5
_TRIM_IDLE_S = 5.0
_MAX_FLOWS = 4096  # flows remembered before those not ahead of the virtual time are dropped


class DeviceLock:
    """The device, handed to its waiters in the order of their tags, then of their asking.

    Tags are virtual start times in tokens (``Batcher.start_tag``): the batcher asks with the
    earliest tag queued when it took its batch, /embed_all with each slice's own. ``virtual``
    is the tag of the work that last took the device, the system's virtual time. A plain
    lock would go to whichever thread runs first after a release: usually the one that
    released it, so /embed_all kept the device through all its slices while the batcher
    waited.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # taken as such: ``with`` on a Condition costs two calls
        self._cond = threading.Condition(self._lock)
        self._held = False
        self._waiting: list[tuple[float, int]] = []  # a heap of (tag, ticket)
        self._tickets = itertools.count()
        self.virtual = 0.0

    def acquire(self, blocking: bool = True, timeout: float = -1, tag: float = 0.0) -> bool:
        with self._lock:
            if not self._held and not self._waiting:
                self._take(tag)
                return True
            if not blocking:
                return False
            me = (tag, next(self._tickets))
            heapq.heappush(self._waiting, me)
            until = None if timeout < 0 else time.monotonic() + timeout
            try:
                while self._held or self._waiting[0] != me:
                    left = None if until is None else until - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                self._take(tag)
                return True
            finally:
                self._waiting.remove(me)
                heapq.heapify(self._waiting)
                self._cond.notify_all()  # the next in line may take it (or find it held)

    def _take(self, tag: float) -> None:
        self._held = True
        self.virtual = max(self.virtual, tag)

    def release(self) -> None:
        with self._lock:
            if not self._held:
                raise RuntimeError("release of a device lock that is not held")
            self._held = False
            if self._waiting:  # a waiter is listed before it waits, under this lock
                self._cond.notify_all()

    def locked(self) -> bool:
        return self._held


@dataclass(frozen=True)
class BatchLimits:
    max_batch_size: int
    max_batch_tokens: int
    max_wait_s: float
    max_queue: int | None  # None: derived from the measured rate (admission.Admission.limit)
    max_queue_tokens: int
    timeout_s: float  # REQUEST_TIMEOUT_S, for the derived MAX_QUEUE
    max_request: int  # MAX_INPUTS_PER_REQUEST: the derived MAX_QUEUE is never below it

    @classmethod
    def from_settings(cls, settings: Any) -> BatchLimits:
        s = settings
        return cls(s.max_batch_size, s.max_batch_tokens, s.max_wait_ms / 1000, s.max_queue,
                   s.max_queue_tokens, s.request_timeout_s, s.max_inputs_per_request)


class Job:
    """One request's inputs in the batcher; ``result()`` waits for their rows, in order."""

    def __init__(self, inputs: list[list[int]], deadline: float,
                 disconnected: Callable[[], bool] | None = None, *, flow: Hashable = None,
                 on_done: Callable[[Job], None] | None = None, origin: int | None = None,
                 tenant: str | None = None, unit: bool = True) -> None:
        self.inputs = inputs
        self.deadline = deadline
        self.disconnected = disconnected  # True once the client has gone (Batcher.cancel_due)
        self.submitted = time.monotonic()
        self.finished_at = 0.0
        self.inference_s = 0.0
        self.batch_size = 0  # inputs of the largest batch that held some of its inputs
        self.started = False  # some of its inputs reached the model: the deadline no longer applies
        self.queued = 0  # tokens of its inputs still queued (the queue's model reads it)
        self.left = 0  # its inputs still queued
        self.seq = 0  # its place in the order of submission (Batcher._enqueue)
        self.flow = flow
        self.origin = origin  # the front it came from (the engine process)
        self.tenant = tenant  # whose quota counts its inputs in flight
        self.on_done = on_done  # called once, as it finishes
        self._rows: np.ndarray | None = None
        self.unit = unit  # its one row is wanted at unit length too (Batcher.unit)
        # a one-input job's row is row ``at`` of its batch's rows (and of their unit rows,
        # where the batcher made them): the engine's loop takes its answer from the batch's
        # (one ``Rows`` frame a batch), one process a view of it (``rows``, ``units``)
        self.at = -1
        self.batch_rows: np.ndarray | None = None
        self.batch_units: np.ndarray | None = None
        self.remaining = len(inputs)
        self.error: ApiError | None = None
        self._finished = False
        # A held lock that _finish releases: cheaper to wait on than an Event (no Condition,
        # no waiter list), which counts when every request waits once.
        self._signal = threading.Lock()
        self._signal.acquire()

    @property
    def done(self) -> bool:
        return self._finished

    @property
    def rows(self) -> np.ndarray | None:
        """Its rows, in input order, once computed: a one-input job's a view of its batch's
        row, made when first read (the engine's loop reads the batch's instead)."""
        if self._rows is None and self.batch_rows is not None:
            self._rows = self.batch_rows[self.at:self.at + 1]
        return self._rows

    @rows.setter
    def rows(self, value: np.ndarray | None) -> None:
        self._rows = value

    @property
    def units(self) -> np.ndarray | None:
        """A one-input job's row at unit length, where its batch's were normalised
        (``Batcher.unit``): a view of those; None otherwise."""
        if self.batch_units is None:
            return None
        return self.batch_units[self.at:self.at + 1]

    def wait(self, timeout: float | None) -> bool:
        if self._finished:
            return True
        if self._signal.acquire(timeout=-1 if timeout is None else timeout):
            self._signal.release()  # open for any later wait
            return True
        return self._finished

    def result(self, timeout: float | None = None) -> np.ndarray:
        if not self.wait(timeout):
            raise DeadlineExceeded("no result in time", code="timeout")
        if self.error is not None:
            raise self.error
        rows = self.rows
        assert rows is not None
        return rows

    @property
    def queue_s(self) -> float:
        """Time spent waiting rather than computing, from submit to the last row."""
        return max(0.0, (self.finished_at or time.monotonic()) - self.submitted - self.inference_s)

    def _finish(self, error: ApiError | None = None) -> None:
        if self._finished:
            return
        self.error = error
        self.finished_at = time.monotonic()
        self._finished = True
        self._signal.release()
        if self.on_done is not None:
            self.on_done(self)


@dataclass(slots=True)
class _Item:
    job: Job
    index: int
    ids: list[int]
    queued: float
    tag: float  # its virtual start, in tokens (Batcher.start_tag)
    answered: bool = False  # its admission was given back


def _submission(job: Job) -> int:
    return job.seq


def _fits_one_batch(lengths: Sequence[int], max_items: int, max_tokens: int) -> bool:
    """Whether ``plan_batch`` takes every queued input, whichever it must hold: they fit
    the caps and their padding is free. Along the sorted queue both the padded tokens and
    the padding only grow, so a whole queue within the caps and _FREE_PADDING is one run.
    The common case (a queue that a batch empties), without the sort and the turn."""
    count = len(lengths)
    if count > max_items:
        return False
    padded = max(lengths) * count
    return padded <= max_tokens and padded - sum(lengths) <= _FREE_PADDING


def plan_batch(lengths: Sequence[int], max_items: int, max_tokens: int, first: int = 0,
               tags: Sequence[float] | None = None) -> list[int]:
    """Pick the next batch from queued inputs of these lengths, holding input ``first``.

    The queue is sorted by length and cut into runs that fit the item cap and the padded
    token budget (count x longest) and keep padding low; the batch is the run that holds
    input ``first`` (the batcher passes the input whose turn it is: see ``Batcher._turn``).
    Inputs of equal length are in the order of their ``tags`` (fair queueing's virtual
    starts): in submission order, a burst of same-length requests ran first come, first
    served whatever the tags said, and the requests admission had predicted to start within
    a batch or two waited for all those submitted before them, into a 504.
    """
    keys = lengths if tags is None else list(zip(lengths, tags, strict=True))
    order = sorted(range(len(lengths)), key=keys.__getitem__)  # no Python call an input
    run: list[int] = []
    real = 0
    has_first = False
    for i in order:
        n = lengths[i]
        count = len(run) + 1
        padded = n * count
        waste = padded - real - n
        too_big = count > max_items or padded > max_tokens
        too_wasteful = waste > max(_FREE_PADDING, (1 - _MIN_PADDING_EFFICIENCY) * padded)
        if run and (too_big or too_wasteful):
            if has_first:
                break
            run, real = [], 0
        run.append(i)
        real += n
        has_first = has_first or i == first
    return run


class Batcher:
    """Coalesces the inputs of concurrent requests into device batches on one named thread."""

    def __init__(
        self,
        encode: Callable[[list[list[int]]], np.ndarray],
        limits: BatchLimits,
        *,
        metrics: Metrics | None = None,
        device_lock: DeviceLock | None = None,
        name: str = "embedsvc-batcher",
    ) -> None:
        self._encode = encode
        self.limits = limits
        self.metrics = metrics or Metrics()
        self.device_lock = device_lock or DeviceLock()
        self.name = name
        self._lock = threading.RLock()  # taken as such: ``with`` on a Condition costs two calls
        self._cond = threading.Condition(self._lock)  # for ``shutdown``'s wait
        # The thread sleeps on a held lock that a submit releases (``_ring``): a Condition's
        # wait made a lock and a list entry each time, and its notify walked the list, a dozen
        # Python calls a batch between them; the thread wakes about once a request when the
        # device is quick.
        self._bell = threading.Lock()
        self._bell.acquire()
        self._asleep = False  # the thread waits on the bell (under self._lock)
        self._closing = False  # ``shutdown`` waits on self._cond for the queue to empty
        self._pending: list[_Item] = []
        self._earliest_deadline = math.inf  # no queued job is due before this
        self._flows: dict[Hashable, float] = {}  # flow -> the end of its work's tags
        self._backlog: dict[Hashable, list[int]] = {}  # flow -> [tokens, inputs] queued
        self._anonymous_end = 0.0  # the end of the tags of work queued without a flow
        self._queued_tokens = 0  # of every backlog
        self._served: set[int] = set()  # the jobs of the last batch (ids)
        # started jobs with inputs still queued (a few at most: requests larger than a
        # batch), so that the oldest is found without a walk of the queue at every batch
        self._partly: dict[Job, None] = {}
        self._seq = itertools.count()
        self.admission = Admission(
            max_inputs=limits.max_queue, max_tokens=limits.max_queue_tokens,
            timeout_s=limits.timeout_s, floor_inputs=limits.max_request, metrics=self.metrics,
            queue=self.tokens_ahead, queue_most=self.tokens_ahead_most,
            batch=(limits.max_batch_size, limits.max_batch_tokens))
        self._in_flight = 0
        self._current: list[_Item] = []  # the batch on the device
        self._current_tokens = 0  # its inputs' tokens
        # the earliest tag queued when it was taken: the virtual time it runs at (_compute)
        self._current_tag = 0.0
        self._computed = 0  # inputs whose rows reached a waiting request
        self._stopping = False
        self._last_deep_log = 0.0
        self._thread: threading.Thread | None = None
        self._died = False  # set by a dying thread before it fails its requests
        # when the last batch's compute ended with work still queued (the next batch then
        # starts at once): its cycle, compute and the work between batches, is what a queue
        # drains at, and what admission learns the device's rate from
        self._queued_since: float | None = None
        # called by the thread that finished jobs once it has finished all it had at hand (a
        # batch's, a cancel's), after their ``on_done``s: for one wake-up of whoever answers
        # them, which then finds every one (the engine's loop: one frame a front a batch)
        self.on_finished: Callable[[], None] | None = None
        # rows -> the same rows at unit length (an embedding model's, set by its service):
        # a one-input job then gets its row normalised with the whole batch's (``Job.units``)
        # besides the raw one. In the request's thread each numpy call of a normalisation
        # cost several microseconds (its code cold between requests), once a request; here
        # they are paid once a batch.
        self.unit: Callable[[np.ndarray], np.ndarray] | None = None
        # how many of a batch's one-input jobs must want their unit rows for the batch's to be
        # made (the engine's loop: a lone request's row is normalised by its front)
        self.unit_least = 1
        self._units_wanted = False  # by enough jobs of the batch taken last (``_take``)
        # True: the one caller that queues computes the queue itself (``compute_here``), and
        # the thread only trims; for a device that costs nothing (the simulated one), where
        # handing each batch to the thread cost more CPU (two thread switches and the
        # interpreter lock's hand-off) than the batch. Never for a real device.
        self._here = False
        # for the thread while ``here``: time to end, or to compute again (``here`` unset)
        self._nudged = threading.Event()
        # read at scrape time, so that the request path pays nothing for them
        self.metrics.queue_depth.set_function(lambda: self.depth)
        self.metrics.in_flight.set_function(lambda: self._in_flight)
        self.metrics.admission_limit.set_function(lambda: self.admission.limit)
        self.metrics.admitted_inputs.set_function(lambda: self.admission.used_inputs)

    @property
    def here(self) -> bool:
        return self._here

    @here.setter
    def here(self, value: bool) -> None:
        """Unset, the thread computes again at once: what the caller left queued as it
        stopped computing is not left for the thread's next trim."""
        self._here = value
        if not value:
            self._nudged.set()

    # -- request side -------------------------------------------------------------------------

    def submit(self, inputs: list[list[int]], deadline: float,
               disconnected: Callable[[], bool] | None = None,
               ticket: Ticket | None = None, flow: Hashable | None = None,
               on_done: Callable[[Job], None] | None = None, origin: int | None = None,
               tenant: str | None = None, unit: bool = True) -> Job:
        """Queue one request's wrapped token ids under its admission ``ticket``.

        Without a ticket, admits them first (``Admission.admit``: 413, 429, 503 or 504).
        Until its first input reaches the model, the job fails with 504 at ``deadline``; its
        inputs still queued are dropped once ``disconnected()`` is true (``cancel_due``).
        ``flow`` (the client's connection) decides its turn among other clients'
        (``start_tag``). ``on_done(job)`` is called once the job has its rows or its error
        (from the thread that finishes it: keep it short and never block in it).
        ``origin``: the HTTP process it came from, when several feed this batcher;
        ``tenant``: whose quota its inputs count against until answered.
        """
        if ticket is None:
            ticket = self.admission.admit(len(inputs), sum(map(len, inputs)), deadline,
                                          disconnected, flow, tenant)
        job = Job(inputs, deadline, disconnected, flow=flow, on_done=on_done, origin=origin,
                  tenant=tenant, unit=unit)
        self.submit_many([(job, ticket)])
        return job

    def submit_many(self, jobs: Sequence[tuple[Job, Ticket]]) -> None:
        """Queue each job under its open admission ticket (``submit``'s jobs, made by the
        caller) with one hold of the lock and one wake-up of the thread: the engine's loop
        queues every request one wake-up read at once. Woken at each, the thread took each
        batch as soon as it could and formed batches of two or three inputs, paying a
        batch's cost and two thread switches for each. 503 for all when stopping."""
        with self._lock:
            if self._stopping:
                for _, ticket in jobs:
                    self.admission.cancel(ticket)
                raise shutting_down()
            now = time.monotonic()
            for job, _ in jobs:
                self._enqueue(job, now)
            self.admission.settle_many([(ticket, job.queued) for job, ticket in jobs])
            self._warn_if_deep(now)
            self._ring()

    def _enqueue(self, job: Job, now: float) -> None:
        """``job``'s inputs into the queue (its ticket settled by the caller, at
        ``job.queued`` tokens). Under self._cond."""
        inputs, flow = job.inputs, job.flow
        tokens = sum(map(len, inputs))
        job.queued, job.left, job.seq = tokens, len(inputs), next(self._seq)
        tag = self._start_tag(flow, tokens)
        backlog = self._backlog.setdefault(flow, [0, 0])
        backlog[0] += tokens
        backlog[1] += len(inputs)
        self._queued_tokens += tokens
        if flow is None:
            self._anonymous_end = max(self._anonymous_end, tag + tokens)
        pending = self._pending
        for i, ids in enumerate(inputs):
            pending.append(_Item(job, i, ids, now, tag))
            tag += len(ids)
        if job.deadline < self._earliest_deadline:
            self._earliest_deadline = job.deadline

    def start_tag(self, flow: Hashable | None, tokens: int) -> float:
        """The virtual start of new work of ``tokens`` from ``flow``: start-time fair queueing.

        Work goes to the device in the order of its tags (``_turn``, ``DeviceLock``). A
        flow's work starts where its previous work ends, in tokens of device work, and never
        before the work on the device now (``DeviceLock.virtual``); the inputs of one
        request follow each other. So a client that sends large requests back to back runs
        ahead of the others' virtual time and waits while they, sending less, are served:
        each client with work queued gets the device in turn, about one batch at a time,
        and a light client waits for about one batch, whatever a heavy one sends. Without a
        flow, work starts at the virtual time now.
        """
        with self._lock:
            return self._start_tag(flow, tokens)

    def _start_tag(self, flow: Hashable | None, tokens: int) -> float:
        now = self.device_lock.virtual
        if flow is None:
            return now
        start = max(now, self._flows.get(flow, now))
        self._flows[flow] = start + tokens
        if len(self._flows) > _MAX_FLOWS:  # flows that are not ahead count as new ones
            ahead = {f: end for f, end in self._flows.items() if end > now}
            # still that many ahead: start them all afresh rather than scan at every submit
            self._flows = ahead if len(ahead) <= _MAX_FLOWS // 2 else {}
        return start

    def admit(self, inputs: int, tokens: int, deadline: float,
              disconnected: Callable[[], bool] | None = None, flow: Hashable = None) -> Ticket:
        """Reserve room for a request before it tokenizes (see ``Admission.admit``)."""
        return self.admission.admit(inputs, tokens, deadline, disconnected, flow)

    def tokens_ahead(self, flow: Hashable = None) -> int:
        """The tokens the device computes before new work of ``flow`` reaches it: the model
        of the queue that admission's 429 and its ``Retry-After`` come from.

        Start-time fair queueing puts ahead of the work what each flow has queued with
        earlier tags (a flow's queued work is the tail of its tags, so that is the part of
        it before the new work's start) and, at equal tags, the first input of each flow
        that came earlier; the floor of a started request (``_turn``) interleaves at most
        one batch of its own per batch of those; and the batch on the device finishes
        first. A new flow starts at the virtual time now, so about one batch per busy client
        is ahead of it, however much a heavy client has queued; a client with work queued
        has that work, and others' up to where its own ends, ahead of its next request.
        """
        with self._lock:
            now = self.device_lock.virtual
            start = now if flow is None else max(now, self._flows.get(flow, now))
            ahead = 0
            oldest = self._oldest_started()
            floor = oldest.queued if oldest is not None else 0
            for g, (queued, inputs) in self._backlog.items():
                first = (self._anonymous_end if g is None else self._flows.get(g, now)) - queued
                if first > start:
                    continue
                mine = min(queued, int(start - first) + queued // inputs)
                ahead += mine
                if oldest is not None and g == oldest.flow:
                    floor = max(0, floor - mine)
            budget = self.limits.max_batch_tokens
            interleaved = min(floor, -(-ahead // budget) * budget)
            return ahead + interleaved + self._current_tokens

    def tokens_ahead_most(self) -> int:
        """At least what ``tokens_ahead`` says for any flow, without walking the flows (at
        most every queued token, at most every queued token again interleaved, and the
        batch on the device); read without the lock, as admission reads the model anyway
        before its own."""
        return 2 * self._queued_tokens + self._current_tokens

    def cancel_due(self) -> int:
        """Cancel queued jobs past their deadline, and the queued inputs of clients that
        left (even when others of their inputs were computed); how many jobs.

        Called periodically (the service's watchdog), so that a waiting request thread needs
        no timeout of its own: a timed wait costs measurably more CPU than a plain one.
        """
        with self._lock:
            cancelled = self._cancel_late(time.monotonic())
            watched = list({id(it.job): it.job for it in self._pending
                            if it.job.disconnected is not None}.values())
        for job in watched:
            if job.disconnected():  # type: ignore[misc]
                gone = ClientDisconnected("the client disconnected", code="client_disconnected")
                with self._lock:
                    if not job.done:
                        self._cancel(job, gone)
                        cancelled += 1
        return cancelled

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._died

    @property
    def depth(self) -> int:
        """Inputs queued for the device (embedsvc_queue_depth)."""
        return len(self._pending)

    @property
    def admitted(self) -> int:
        """Inputs admitted: being tokenized, queued or on the device."""
        return self.admission.used_inputs

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._died = False
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        self.metrics.batcher_alive.set(1)

    def restart(self) -> bool:
        """Start a new thread if the last one died; the queue is kept. True if it did so."""
        with self._lock:
            if self.alive or self._stopping or self._thread is None:
                return False
            # counted before the new thread is seen alive: /health's 200 after a death
            # implies the count (a scrape between the two read a restart not counted)
            self.metrics.batcher_restarts.inc()
            self.start()
        log.warning("batcher thread restarted; %d inputs were waiting", len(self._pending))
        return True

    def shutdown(self, timeout: float) -> ShutdownReport:
        """Stop admitting, finish what was admitted within ``timeout``, fail the rest with 503.

        The report counts inputs: those computed while draining (a long request's included),
        those of the requests that got no answer, and how many of these were never computed
        (still queued at the timeout, or on the device when the thread did not end in time).
        """
        deadline = time.monotonic() + timeout
        self.admission.close()
        with self._lock:
            self._closing = True
            computed_before = self._computed
            while self.admitted and time.monotonic() < deadline and self.alive:
                self._cond.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            leftover = {id(it.job): it.job for it in self._pending}
            failed = sum(len(job.inputs) for job in leftover.values())
            # their inputs on the device now will be computed for nobody
            uncomputed = len(self._pending) + self._unanswered(lambda job: id(job) in leftover)
            for job in leftover.values():
                self._cancel(job, shutting_down("the server shut down before this request ran"))
            self._stopping = True
            self._nudged.set()
            self._ring()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        clean = not self.alive
        with self._lock:
            if not clean:  # the requests on the stuck batch will never be answered
                cut = {id(it.job): it.job for it in self._current
                       if not it.answered and id(it.job) not in leftover}
                failed += sum(len(job.inputs) for job in cut.values())
                uncomputed += self._unanswered(lambda job: id(job) in cut)
            completed = self._computed - computed_before
        self.metrics.batcher_alive.set(0)
        report = ShutdownReport(completed, failed, clean, uncomputed)
        if report.failed == 0 and report.clean:
            log.info("batcher stopped: %d inputs completed while draining, none failed",
                     report.completed)
        else:
            log.info("batcher stopped: %d inputs completed while draining; requests with %d "
                     "inputs failed, %d of them never computed; clean=%s",
                     report.completed, report.failed, report.uncomputed, report.clean)
        return report

    # -- the batcher thread -------------------------------------------------------------------

    def _run(self) -> None:
        last_trim = time.monotonic()
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    return
                if batch:
                    self._compute(batch)
                    with self._lock:
                        self._current = []
                        self._current_tokens = 0
                        self._in_flight = 0
                # Activations just freed would otherwise stay resident: varying batch shapes
                # fragment the heap, and a bulk run's memory grew with its length.
                gap = _TRIM_AFTER_BATCH_S if batch else _TRIM_IDLE_S
                if time.monotonic() - last_trim >= gap:
                    last_trim = time.monotonic()
                    heap.trim()
        except BaseException:  # noqa: BLE001 - the thread must not vanish silently
            log.exception("the batcher thread died; failing the batch it was computing")
            with self._lock:
                # Dead before the requests hear it: whoever got the 500 finds /health
                # unhealthy, and a restart (under this lock) waits until this thread is done.
                self._died = True
                self.metrics.batcher_alive.set(0)
                self._fail_items(self._current, "the batcher stopped while computing this "
                                 "request; retry it", "batcher_died")
                self._current = []
                self._current_tokens = 0
                self._in_flight = 0

    def compute_here(self) -> None:
        """Compute what is queued in the calling thread, batch after batch, as the thread
        would (``here``: the caller that queues calls it after queueing)."""
        while True:
            with self._lock:
                if self._stopping:
                    return
                self._cancel_late(time.monotonic())
                if not self._pending:
                    return
                batch = self._take()
            try:
                self._compute(batch)
            finally:
                with self._lock:
                    self._current = []
                    self._current_tokens = 0
                    self._in_flight = 0

    def _next_batch(self) -> list[_Item] | None:
        """The next batch; ``[]`` after an idle spell (time to trim), None when stopping."""
        if self._here:  # the caller computes: wait for nothing but the time to trim or end
            self._nudged.wait(_TRIM_IDLE_S)
        with self._lock:
            while True:
                if self._stopping:
                    return None
                if self._here:
                    self._nudged.clear()  # under the lock: a stop sets it under it too
                    return []
                if not self._pending:
                    if not self._sleep(_TRIM_IDLE_S):
                        return []
                    continue
                now = time.monotonic()
                wait = self._partial_wait(now)
                if wait > 0:
                    self._sleep(wait)
                    continue
                self._cancel_late(now)
                if not self._pending:
                    continue
                return self._take()

    def _sleep(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for a ``_ring``, self._lock released meanwhile (held once,
        by the thread); whether it rang."""
        self._asleep = True
        self._lock.release()
        try:
            rung = self._bell.acquire(timeout=timeout)
        finally:
            self._lock.acquire()
        if not rung:
            if self._asleep:
                self._asleep = False
            else:  # rung between the timeout and the lock: the bell is open, close it again
                self._bell.acquire()
                rung = True
        return rung

    def _ring(self) -> None:
        """Wake the thread if it sleeps (``_sleep``). Under self._lock."""
        if self._asleep:
            self._asleep = False
            self._bell.release()

    def _partial_wait(self, now: float) -> float:
        """How much longer a partial batch should wait for more inputs (MAX_WAIT_MS)."""
        if self.limits.max_wait_s <= 0 or len(self._pending) >= self.limits.max_batch_size:
            return 0.0
        return self._pending[0].queued + self.limits.max_wait_s - now

    def _turn(self, tags: list[float]) -> int:
        """The queued input whose turn it is: the one with the earliest tag, unless the
        oldest started request got nothing in the last batch (then its next input).

        The floor keeps a large request moving under a stream of small ones: once its first
        input reached the device, it has the turn at least every other batch, so it gets at
        least about half of the device however many light clients arrive (they wait one or
        two batches meanwhile). Without it, a request of 2,048 inputs beside 16 busy
        single-input clients had a seventeenth of each batch's turns.
        """
        first = tags.index(min(tags))
        oldest = self._oldest_started()
        if oldest is None or id(oldest) in self._served or self._pending[first].job is oldest:
            return first
        return next(i for i, it in enumerate(self._pending) if it.job is oldest)

    def _oldest_started(self) -> Job | None:
        """The earliest submitted request with inputs both computed and still queued."""
        return min(self._partly, key=_submission, default=None)

    def _take(self) -> list[_Item]:
        pending = self._pending
        lengths = [len(it.ids) for it in pending]
        tags = [it.tag for it in pending]
        if _fits_one_batch(lengths, self.limits.max_batch_size, self.limits.max_batch_tokens):
            batch, self._pending = pending, []  # what plan_batch would choose, whoever's turn
            self._current_tokens = sum(lengths)
        else:
            chosen = plan_batch(lengths, self.limits.max_batch_size,
                                self.limits.max_batch_tokens, self._turn(tags), tags)
            picked = set(chosen)
            batch = [pending[i] for i in sorted(chosen)]
            self._pending = [it for i, it in enumerate(pending) if i not in picked]
            self._current_tokens = sum(map(lengths.__getitem__, chosen))
        now = time.monotonic()
        taken: dict[Job, list[int]] = {}  # each job's tokens and inputs in this batch
        for it in batch:
            counts = taken.get(it.job)
            if counts is None:
                taken[it.job] = [len(it.ids), 1]
            else:
                counts[0] += len(it.ids)
                counts[1] += 1
        wanted = 0  # one-input jobs of the batch that want their row at unit length
        for job, (tokens, inputs) in taken.items():
            wanted += job.unit and len(job.inputs) == 1
            job.started = True
            self._dequeued(job, tokens, inputs)
            if job.left:
                self._partly[job] = None
        self._served = {id(job) for job in taken}
        self._units_wanted = wanted >= self.unit_least
        self.metrics.queue_wait.observe_many([now - it.queued for it in batch])
        self._in_flight = len(batch)
        self._current = batch
        self._current_tag = min(tags)
        return batch

    def _compute(self, batch: list[_Item]) -> None:
        ids = [it.ids for it in batch]
        try:
            # The virtual time is the earliest tag queued, not this batch's: a batch given to
            # the oldest started request (_turn's floor) holds tags far ahead of the others',
            # and had moved the virtual time there, so that a client arriving next queued
            # behind every other client's backlog up to it (issue 45: a burst's requests
            # admitted from the FIFO got 504 with their first input never run).
            self.device_lock.acquire(tag=self._current_tag)
            try:
                # from here: the wait for the lock (an /embed_all slice) is not the batch's
                # compute time, which the measured rate and the requests' inference_s count
                started = time.monotonic()
                rows = self._encode(ids)
            finally:
                self.device_lock.release()
            if len(rows) != len(batch):
                raise RuntimeError(f"the model returned {len(rows)} rows for {len(batch)} inputs")
        except DeviceOutOfMemory:
            if len(batch) == 1:
                self._fail_batch(batch, "the device ran out of memory for this input")
                return
            log.warning("device out of memory on a batch of %d; retrying it in halves", len(batch))
            self.metrics.oom_splits.inc()
            half = len(batch) // 2
            self._compute(batch[:half])
            self._compute(batch[half:])
            return
        except Exception:
            log.exception("batch of %d inputs failed; failing its requests", len(batch))
            self._fail_batch(batch, "the batch that held this request failed; retry it")
            return
        ended = time.monotonic()
        elapsed = ended - started
        # back to back, a batch costs its compute and the work since the last one ended
        # (answering it, forming this one: a few ms each under load, which add up over a
        # queue of small batches); after an idle spell, its compute alone
        cycle = elapsed if self._queued_since is None else ended - self._queued_since
        self._record(batch, elapsed, cycle)
        self._scatter(batch, rows, elapsed)
        self._queued_since = ended if self._pending else None

    def _record(self, batch: list[_Item], elapsed: float, cycle: float) -> None:
        lengths = [len(it.ids) for it in batch]
        fed = batch[0].job.origin is not None  # by several HTTP processes: counted
        self.metrics.observe_batch(lengths, elapsed,
                                   len({it.job.origin for it in batch}) if fed else 0)
        self.admission.observe(sum(lengths), len(batch), cycle)

    def _scatter(self, batch: list[_Item], rows: np.ndarray, elapsed: float) -> None:
        """Each job its rows; the batch's admission is given back before any job hears, so
        a request that has its answer holds no reservation (nor does ``_fail_items``')."""
        size = len(batch)
        views = rows.dtype == np.float32  # a one-input job's row, sliced without a copy
        units = self.unit(rows) if views and self.unit is not None and self._units_wanted \
            else None
        with self._lock:
            seen: set[Job] = set()  # by identity
            finished: list[Job] = []
            for k, it in enumerate(batch):
                job = it.job
                if job not in seen:
                    seen.add(job)
                    job.inference_s += elapsed
                    if job.batch_size < size:
                        job.batch_size = size
                if job._finished:  # failed meanwhile (another of its batches), or its client left
                    continue
                self._computed += 1
                if views and len(job.inputs) == 1:  # its row a view, made when read
                    job.at, job.batch_rows = k, rows
                    if units is not None and job.unit:
                        job.batch_units = units
                else:  # its rows gathered into an array of its own (``_rows``: no call)
                    row = rows[k]
                    if job._rows is None:
                        job._rows = np.empty((len(job.inputs), len(row)), dtype=np.float32)
                    job._rows[it.index] = row
                job.remaining -= 1
                if job.remaining == 0:
                    finished.append(job)
            self._release(batch)
            for job in finished:
                job._finish()
            if finished and self.on_finished is not None:
                self.on_finished()

    def _fail_batch(self, batch: list[_Item], message: str) -> None:
        self.metrics.batch_failures.inc()
        with self._lock:
            self._fail_items(batch, message, "batch_failed")

    # -- bookkeeping, under self._cond --------------------------------------------------------

    def _fail_items(self, items: list[_Item], message: str, code: str) -> None:
        """Fail the unfinished jobs of ``items``, their admission given back first (as
        ``_scatter`` does before its jobs hear)."""
        jobs = [job for job in {id(it.job): it.job for it in items}.values() if not job.done]
        self._release([it for it in items if not it.answered])
        for job in jobs:
            self._cancel(job, BatchFailed(message, code=code))

    def _cancel(self, job: Job, error: ApiError) -> None:
        """Fail ``job`` and take its queued inputs out of the queue (counted as dropped)."""
        mine = [it for it in self._pending if it.job is job]
        if mine:
            self._pending = [it for it in self._pending if it.job is not job]
            self._dequeued(job, sum(len(it.ids) for it in mine), len(mine))
            self._release(mine)
            self.metrics.dropped_inputs.labels(reason=error.reason).inc(len(mine))
        job._finish(error)
        if self.on_finished is not None:
            self.on_finished()
        if self._closing:
            self._cond.notify_all()

    def _dequeued(self, job: Job, tokens: int, inputs: int) -> None:
        """``inputs`` of ``job``'s, ``tokens`` in all, left the queue (for the device, or
        dropped): the backlogs shrink."""
        job.queued -= tokens
        job.left -= inputs
        if not job.left:
            self._partly.pop(job, None)
        self._queued_tokens -= tokens
        backlog = self._backlog[job.flow]
        backlog[0] -= tokens
        backlog[1] -= inputs
        if backlog[1] <= 0:
            del self._backlog[job.flow]

    def _unanswered(self, which: Callable[[Job], bool]) -> int:
        """Inputs on the device, not yet answered, of the jobs ``which`` picks."""
        return sum(1 for it in self._current if not it.answered and which(it.job))

    def _release(self, items: list[_Item]) -> None:
        """Give back the admission of inputs answered or dropped."""
        for it in items:
            it.answered = True
        tenants = {it.job.tenant for it in items}
        if len(tenants) == 1:  # usually: one tenant, or none
            self.admission.release(len(items), sum(len(it.ids) for it in items), tenants.pop())
        else:
            for tenant in tenants:
                mine = [it for it in items if it.job.tenant == tenant]
                self.admission.release(len(mine), sum(len(it.ids) for it in mine), tenant)
        if self._closing:  # what shutdown waits for
            self._cond.notify_all()

    def _cancel_late(self, now: float) -> int:
        """Cancel queued jobs past their deadline; how many."""
        if now < self._earliest_deadline:  # nothing queued can be due: skip the scan
            return 0
        due = {id(it.job): it.job for it in self._pending
               if it.job.deadline <= now and not it.job.started}
        for job in due.values():
            self._cancel(job, deadline_error())
        self._earliest_deadline = min((it.job.deadline for it in self._pending), default=math.inf)
        return len(due)

    def _warn_if_deep(self, now: float) -> None:
        admitted, limit = self.admission.used_inputs, self.admission.limit
        if admitted < _DEEP_QUEUE_SHARE * limit:
            return
        if now - self._last_deep_log >= _DEEP_QUEUE_LOG_EVERY_S:
            self._last_deep_log = now
            log.warning(
                "queue is deep: %d of %d inputs admitted; add a replica or raise MAX_QUEUE "
                "if latency allows", admitted, limit,
            )

