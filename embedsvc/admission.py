"""Admission: who may tokenize and queue work now, who waits, and who is told to come back.

A request reserves its inputs (and an estimate of its tokens) here *before* it tokenizes,
settles the reservation to its exact token count once tokenized, and gives it back input by
input as the batcher answers them. Three rules:

* **First come, first served.** Requests that do not fit wait in one FIFO; capacity freed
  goes to the oldest waiter, and a later request never overtakes it, so a request of
  MAX_INPUTS_PER_REQUEST inputs waits at most for the work admitted before it.
* **The truth about deadlines.** The device's rate (tokens per second, the best of its
  last few batches) and the tokens ahead of a request predict when it would reach the
  model; a request that must first wait in the FIFO for room adds the tokens that must be
  answered before room for it frees. A request that would reach it after its deadline
  even at that rate gets 429 at once, with a ``Retry-After`` that says when the work ahead
  will have shrunk enough, instead of a 504 after waiting in vain.
* **Bounded work in progress.** At most MAX_QUEUE inputs and MAX_QUEUE_TOKENS tokens are
  admitted at once (a request larger than the token budget runs alone). MAX_QUEUE unset
  means: what the device, at its measured rate, starts within REQUEST_TIMEOUT_S, and never
  fewer than MAX_INPUTS_PER_REQUEST inputs.

>>> a = Admission(max_inputs=4, max_tokens=100, timeout_s=30, floor_inputs=4)
>>> t = a.admit(3, 30, deadline=time.monotonic() + 5)
>>> a.used_inputs, a.used_tokens
(3, 30)
>>> a.release(3, 30); a.used_inputs
0
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import (
    ApiError,
    ClientDisconnected,
    DeadlineExceeded,
    Overloaded,
    PayloadTooLarge,
    shutting_down,
)
from .metrics import Metrics

if TYPE_CHECKING:
    from .tenants import Quotas

_WATCH_S = 0.1  # how often a waiting request checks whether its client is still there
_RATE_WEIGHT = 0.2  # the weight of the newest batch in the measured inputs per second
# The rate that refuses work as late is the best of this many recent batches. A slow batch
# says little about the next ones: a stall (a page-in, a pause of the host), a burst of
# arrivals holding the interpreter while the batch runs, a small batch whose fixed costs
# outweigh its tokens. A 429 is therefore given only to work that would miss its deadline
# even at the device's best recent speed, and a lasting slowdown is believed once it has
# lasted this many batches.
_BEST_OF = 8
_AUTO_CAP = 16  # MAX_QUEUE unset: at most this many times MAX_INPUTS_PER_REQUEST


@dataclass(slots=True, eq=False)
class Ticket:
    """One request's reservation: ``open`` from its grant until the batcher takes it over or
    it is freed; ``waiting`` while it stands in the FIFO. ``notify`` (for a caller that does
    not block on ``admit``: the engine process's loop) is called, under the gate's lock, when
    a waiting ticket is granted or refused (``refused``: the error, when draining)."""

    inputs: int
    tokens: int
    deadline: float
    flow: Hashable = None
    tenant: str | None = None
    estimate: int = 0  # the tokens its tenant's quota was charged (tenants.py)
    open: bool = False
    waiting: bool = False
    notify: Callable[[Ticket], None] | None = None
    refused: ApiError | None = None


@dataclass(slots=True)
class Ask:
    """One request of a burst for ``Admission.request_many``: ``request``'s arguments."""

    inputs: int
    tokens: int
    deadline: float
    flow: Hashable = None
    tenant: str | None = None
    notify: Callable[[Ticket], None] | None = None


# The queue's model (``Batcher.tokens_ahead``): the tokens the device computes before new work
# of a flow reaches it; None without one (this gate's own count stands in for it). It walks
# every client's backlog, so a bound of it for any flow (``Batcher.tokens_ahead_most``, no
# walk) decides first, and the model is asked only where the bound would refuse.
QueueModel = Callable[[Hashable], int]
QueueBound = Callable[[], int]


class Admission:
    """The FIFO gate in front of tokenizing and queueing; thread-safe."""

    def __init__(self, *, max_inputs: int | None, max_tokens: int, timeout_s: float,
                 floor_inputs: int, metrics: Metrics | None = None,
                 queue: QueueModel | None = None, queue_most: QueueBound | None = None,
                 batch: tuple[int, int] | None = None) -> None:
        self.max_inputs = max_inputs  # None: derived from the measured rate (see ``limit``)
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.floor_inputs = floor_inputs
        self.metrics = metrics or Metrics()
        self.queue = queue
        self.queue_most = queue_most
        self.batch = batch  # the device batch's caps (inputs, padded tokens), when known
        self.quotas: Quotas | None = None  # the tenants' limits (tenants.py), when keys have any
        self.used_inputs = 0
        self.used_tokens = 0
        self._waiting: deque[Ticket] = deque()
        # open tickets (admitted, not yet queued): tokens by flow, and the sum of each
        # ticket's first input (what it puts ahead of another flow's work at equal tags)
        self._opened: dict[Hashable, list[int]] = {}  # flow -> [tokens, first inputs' tokens]
        self._opened_first = 0
        # taken with ``with self._lock`` (a C call, where ``with self._cond`` made two Python
        # calls: a dozen a request); the condition's own calls hold it
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._rates: deque[float] = deque(maxlen=_BEST_OF)  # tokens/s of the last batches
        self._inputs_ema = 0.0  # inputs and seconds of recent batches: inputs/s = ratio
        self._seconds_ema = 0.0
        self._derived, self._rate = 0, 0.0  # ``limit``'s and ``rate``'s (``_derive``)
        self._derive()

    @property
    def limit(self) -> int:
        """The inputs admitted at once (MAX_QUEUE, or its derived value)."""
        if self.max_inputs is not None:
            return self.max_inputs
        return self._derived

    def _derive(self) -> None:
        """The derived limit and the rate, from what ``observe`` learnt: computed once a
        batch, where every request reads them (a few calls each, twice a request)."""
        per_s = self._inputs_ema / self._seconds_ema if self._seconds_ema else 0.0
        derived = int(per_s * self.timeout_s)
        self._derived = max(self.floor_inputs, min(_AUTO_CAP * self.floor_inputs, derived))
        self._rate = max(self._rates, default=0.0)

    @property
    def rate(self) -> float:
        """Tokens per second: the best of the last _BEST_OF batches; 0 until one has run."""
        return self._rate

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def admit(self, inputs: int, tokens: int, deadline: float,
              disconnected: Callable[[], bool] | None = None, flow: Hashable = None,
              tenant: str | None = None) -> Ticket:
        """Reserve ``inputs`` and about ``tokens``; waits in FIFO order for room.

        Raises 413 (larger than MAX_QUEUE), 429 (cannot reach the model before
        ``deadline``), 503 (draining), 504 (still waiting at ``deadline``), 499 (the client
        left while waiting). ``flow`` (the client's connection) is the queue where its work
        will take turns with others' (``Batcher.start_tag``), which says what is ahead of it;
        ``tenant`` (the API key's) is charged against its quotas first (429 when over one).
        """
        ticket = self.request(inputs, tokens, deadline, flow, tenant=tenant)
        if not ticket.open:
            self._wait_granted(ticket, disconnected)
        return ticket

    def request(self, inputs: int, tokens: int, deadline: float, flow: Hashable = None,
                notify: Callable[[Ticket], None] | None = None, tenant: str | None = None
                ) -> Ticket:
        """``admit`` without waiting: the ticket is open, or stands in the FIFO (``waiting``)
        until room frees, when ``notify`` is called with it (or with ``refused`` set, when
        draining). 413, 429 and 503 are raised as by ``admit``. ``request_many`` for one,
        without its lists: one process's request threads ask one at a time."""
        ticket = self._charge(inputs, tokens, deadline, flow, tenant, self.limit)
        try:
            self._enter(ticket, notify)
        except ApiError:
            self._uncharge(ticket)
            raise
        return ticket

    def request_many(self, asks: Sequence[Ask]) -> list[Ticket | ApiError]:
        """``request`` for each of a burst, in order, each as if asked after the one before:
        its ticket or its refusal (413, 429, 503). The gate's lock is taken once for the
        burst (the engine's loop admits every request one wake-up read at once), and again
        only for a request the queue's bound would refuse, whose exact model must be read
        outside it."""
        out: list[Ticket | ApiError] = []
        limit = self.limit  # the burst's, read once
        for ask in asks:
            try:
                out.append(self._charge(ask.inputs, ask.tokens, ask.deadline, ask.flow,
                                        ask.tenant, limit))
            except ApiError as exc:
                out.append(exc)
        tickets = [(i, t) for i, t in enumerate(out) if isinstance(t, Ticket)]
        notify = [asks[i].notify for i, _ in tickets]
        for i, refusal in self._enter_many([t for _, t in tickets], notify):
            self._uncharge(tickets[i][1])
            out[tickets[i][0]] = refusal
        return out

    def _charge(self, inputs: int, tokens: int, deadline: float, flow: Hashable,
                tenant: str | None, limit: int) -> Ticket:
        """A request's ticket, charged to its tenant's quotas; 413 (more inputs than
        ``limit``, ``self.limit``), or 429 over a quota."""
        if inputs > limit:
            raise PayloadTooLarge(
                f"this request has {inputs} inputs but the server admits at most {limit} "
                "at once (MAX_QUEUE); split it into smaller requests",
                param="input", code="too_many_inputs",
            )
        if self.quotas is not None and tenant is not None:
            self.quotas.take(tenant, inputs=inputs, tokens=tokens)
        return Ticket(inputs, min(tokens, self.max_tokens), deadline, flow, tenant, tokens)

    def _uncharge(self, ticket: Ticket) -> None:
        """A ticket refused on entering charges its tenant nothing."""
        if self.quotas is not None and ticket.tenant is not None:
            self.quotas.refund(ticket.tenant, ticket.inputs, ticket.estimate)

    def _enter(self, ticket: Ticket, notify: Callable[[Ticket], None] | None) -> None:
        """``_enter_many`` for one ticket: opened or put in line, or its refusal raised."""
        bound = self.queue_most() if self.queue_most is not None else None
        if bound is not None or self.queue is None:
            with self._lock:
                if self._enter_locked(ticket, notify, bound, final=bound is None):
                    return
        ahead = self.queue(ticket.flow) if self.queue is not None else None
        with self._lock:
            self._enter_locked(ticket, notify, ahead, final=True)

    def _enter_many(self, tickets: list[Ticket],
                    notify: list[Callable[[Ticket], None] | None]) -> list[tuple[int, ApiError]]:
        """Open each ticket or put it in line, in order; the refusals, by position. The
        queue's model is read before our lock (it takes the batcher's); its bound first:
        admitted on it, a ticket is admitted on the model too (the wait predicted grows with
        the tokens ahead), so the walk is paid only near a refusal."""
        refused: list[tuple[int, ApiError]] = []
        i = 0
        while i < len(tickets):
            bound = self.queue_most() if self.queue_most is not None else None
            with self._lock:
                while i < len(tickets) and (bound is not None or self.queue is None):
                    try:
                        if not self._enter_locked(tickets[i], notify[i], bound,
                                                  final=bound is None):
                            break  # the bound would refuse it: the model decides, below
                    except ApiError as exc:
                        refused.append((i, exc))
                    i += 1
            if i < len(tickets):
                ahead = self.queue(tickets[i].flow) if self.queue is not None else None
                try:
                    with self._lock:
                        self._enter_locked(tickets[i], notify[i], ahead, final=True)
                except ApiError as exc:
                    refused.append((i, exc))
                i += 1
        return refused

    def _enter_locked(self, ticket: Ticket, notify: Callable[[Ticket], None] | None,
                      ahead: int | None, final: bool) -> bool:
        """Open ``ticket`` or put it in line, ``ahead`` tokens queued before it; False,
        with nothing changed, when it would be late and ``ahead`` was a bound (not final).
        Under self._cond."""
        flow = ticket.flow
        if ahead is not None:  # and the work admitted, still tokenizing
            ahead += self._opened_first
            own = self._opened.get(flow) if flow is not None else None
            if own is not None:  # all of its own, not just its first input
                ahead += own[0] - own[1]
        if self._closed:
            raise shutting_down()
        opens = not self._waiting and self._fits(ticket)
        if not opens and ahead is not None:  # room first, then its turn in the queue
            ahead += self._fifo_tokens(ticket) + self._one_batch(ticket)
        now = time.monotonic()
        rate = self._rate  # ``predicted_wait``'s, without its two calls a request
        wait = 0.0 if rate <= 0 else ahead / rate if ahead is not None else self.predicted_wait()
        if wait > ticket.deadline - now:  # late: refused, or a bound's walk asked for
            if not final:
                return False
            self._refuse_if_late(ticket, now, wait)
        if opens:
            self._open(ticket)
        else:  # in line behind others, or no room
            ticket.waiting, ticket.notify = True, notify
            self._waiting.append(ticket)
        return True

    def withdraw(self, ticket: Ticket) -> bool:
        """Take a waiting ticket out of the FIFO (its deadline passed, its client left);
        False if it was granted or refused meanwhile."""
        with self._lock:
            return self._take_back(ticket)

    def settle(self, ticket: Ticket, tokens: int) -> None:
        """The batcher takes the reservation over, at its exact token count."""
        self.settle_many([(ticket, tokens)])

    def settle_many(self, settled: Sequence[tuple[Ticket, int]]) -> None:
        """``settle`` for each (ticket, exact tokens) of a burst the batcher queues at once:
        one hold of the lock, and one look at the FIFO for all (settling changes only the
        tokens held, so the waiters granted after the last are those granted after each)."""
        with self._lock:
            for ticket, tokens in settled:
                if ticket.open:
                    self._close(ticket)
                    self.used_tokens += tokens - ticket.tokens
                    ticket.tokens = tokens
            self._grant()
        if self.quotas is not None:
            for ticket, tokens in settled:
                if ticket.tenant is not None:
                    self.quotas.settle(ticket.tenant, ticket.estimate, tokens)

    def tokenized(self, ticket: Ticket, tokens: int) -> None:
        """The exact tokens of a reservation held open while its work runs outside the
        batcher (/embed_all's): its tenant is charged them in place of the estimate, as
        ``settle`` charges queued work; its room stays as reserved until ``cancel``."""
        if self.quotas is not None and ticket.tenant is not None:
            self.quotas.settle(ticket.tenant, ticket.estimate, tokens)
        ticket.estimate = tokens

    def cancel(self, ticket: Ticket) -> None:
        """Free a reservation the batcher never took (an error while tokenizing); idempotent."""
        if not ticket.open:  # settled or cancelled: it never opens again, no lock needed
            return
        with self._lock:
            if ticket.open:
                self._close(ticket)
                self._free(ticket.inputs, ticket.tokens)
                if self.quotas is not None:
                    self.quotas.give_back(ticket.tenant, ticket.inputs)

    def release(self, inputs: int, tokens: int, tenant: str | None = None) -> None:
        """Inputs the batcher has answered or dropped (of ``tenant``'s)."""
        with self._lock:
            self._free(inputs, tokens)
        if self.quotas is not None:
            self.quotas.give_back(tenant, inputs)

    def observe(self, tokens: int, inputs: int, seconds: float) -> None:
        """One computed batch, of ``tokens`` in ``inputs`` computed in ``seconds``."""
        if seconds <= 0:  # below the clock's resolution: no rate to learn from it
            return
        w = _RATE_WEIGHT if self._seconds_ema else 1.0
        with self._lock:
            self._rates.append(tokens / seconds)
            self._inputs_ema += w * (inputs - self._inputs_ema)
            self._seconds_ema += w * (seconds - self._seconds_ema)
            self._derive()

    def close(self) -> None:
        """Refuse new requests (draining) and send the waiting ones away with 503."""
        with self._lock:
            self._closed = True
            while self._waiting:
                ticket = self._waiting.popleft()
                ticket.waiting, ticket.refused = False, shutting_down()
                self._refund(ticket)
                if ticket.notify is not None:
                    ticket.notify(ticket)
            self._cond.notify_all()

    def predicted_wait(self, tokens_ahead: int | None = None) -> float:
        """Seconds until ``tokens_ahead`` (by default: all work admitted or waiting now)
        have been computed, at the device's measured rate."""
        rate = self.rate
        if rate <= 0:
            return 0.0
        if tokens_ahead is None:
            tokens_ahead = self.used_tokens + sum(t.tokens for t in self._waiting)
        return tokens_ahead / rate

    # -- under self._cond ---------------------------------------------------------------------

    def _open(self, ticket: Ticket) -> None:
        self.used_inputs += ticket.inputs
        self.used_tokens += ticket.tokens
        ticket.open = True
        first = ticket.tokens // (ticket.inputs or 1)
        self._opened_first += first
        if ticket.flow is not None:
            opened = self._opened.setdefault(ticket.flow, [0, 0])
            opened[0] += ticket.tokens
            opened[1] += first

    def _close(self, ticket: Ticket) -> None:
        """``ticket`` is no longer open: settled (the batcher holds it) or freed."""
        ticket.open = False
        first = ticket.tokens // (ticket.inputs or 1)
        self._opened_first -= first
        if ticket.flow is not None:
            opened = self._opened[ticket.flow]
            opened[0] -= ticket.tokens
            opened[1] -= first
            if opened[0] <= 0:
                del self._opened[ticket.flow]

    def _free(self, inputs: int, tokens: int) -> None:
        self.used_inputs -= inputs
        self.used_tokens -= tokens
        self._grant()

    def _grant(self) -> None:
        """Room may have freed: grant the waiters at the head of the FIFO that fit, in
        order (a later request never overtakes an earlier one), and tell them."""
        if not self._waiting:  # every request frees and settles once: usually nobody waits
            return
        while self._waiting and self._fits(self._waiting[0]):
            ticket = self._waiting.popleft()
            ticket.waiting = False
            self._open(ticket)
            if ticket.notify is not None:
                ticket.notify(ticket)
        self._cond.notify_all()  # the threads blocked in admit() look at their tickets

    def _refuse_if_late(self, ticket: Ticket, now: float, wait: float) -> None:
        """429 when ``ticket`` would reach the model ``wait`` seconds from ``now``, after
        its deadline."""
        budget = ticket.deadline - now
        if wait <= budget:
            return
        retry = max(1, math.ceil(wait - budget))
        raise Overloaded(
            f"this request would reach the model in about {wait:.1f}s, after its deadline "
            f"({budget:.1f}s, REQUEST_TIMEOUT_S): {self.used_inputs} inputs are admitted and "
            f"{self.waiting} requests wait; retry after the time in Retry-After",
            retry_after_s=retry,
        )

    def _fits(self, ticket: Ticket) -> bool:
        limit = self.max_inputs if self.max_inputs is not None else self._derived  # ``limit``
        if self.used_inputs + ticket.inputs > limit:
            return False
        return self.used_tokens == 0 or self.used_tokens + ticket.tokens <= self.max_tokens

    def _one_batch(self, ticket: Ticket) -> int:
        """A full device batch of inputs like ``ticket``'s: what a request granted from the
        FIFO still waits for once room frees (the batch then on the device). The queue's
        model counts the batch on the device now, which at the start of a burst is a small
        one; the requests granted near their deadline started one batch past it (504)."""
        if self.batch is None:
            return 0
        items, tokens = self.batch
        return min(tokens, items * -(-ticket.tokens // max(1, ticket.inputs)))

    def _fifo_tokens(self, ticket: Ticket) -> int:
        """The tokens the device computes before room frees for ``ticket`` behind the FIFO:
        every waiter ahead opens first, and room frees only as admitted work is answered."""
        inputs = self.used_inputs + ticket.inputs + sum(t.inputs for t in self._waiting)
        tokens = self.used_tokens + ticket.tokens + sum(t.tokens for t in self._waiting)
        per_input = self.used_tokens / self.used_inputs if self.used_inputs else 0.0
        over_inputs = (inputs - self.limit) * per_input
        over_tokens = tokens - self.max_tokens
        return max(0, int(over_inputs), over_tokens)

    def _wait_granted(self, ticket: Ticket, disconnected: Callable[[], bool] | None) -> None:
        """Block until ``ticket`` is granted; withdrawn at its deadline (504), when its
        client leaves (499) or refused when draining (503)."""
        with self._lock:
            while not ticket.open:
                if ticket.refused is not None:
                    raise ticket.refused
                left = ticket.deadline - time.monotonic()
                if left <= 0:
                    self._take_back(ticket)
                    self.metrics.dropped_inputs.labels(reason="timeout").inc(ticket.inputs)
                    raise deadline_error()
                if disconnected is not None and disconnected():
                    self._take_back(ticket)
                    self.metrics.dropped_inputs.labels(reason="disconnected").inc(ticket.inputs)
                    raise ClientDisconnected("the client disconnected", code="client_disconnected")
                self._cond.wait(min(left, _WATCH_S) if disconnected is not None else left)

    def _take_back(self, ticket: Ticket) -> bool:
        if not ticket.waiting:
            return False
        self._waiting.remove(ticket)
        ticket.waiting = False
        self._refund(ticket)
        self._grant()  # the next waiter may fit now
        return True

    def _refund(self, ticket: Ticket) -> None:
        """A ticket that never got in charges its tenant nothing."""
        if self.quotas is not None:
            self.quotas.refund(ticket.tenant, ticket.inputs, ticket.estimate)


def deadline_error() -> DeadlineExceeded:
    return DeadlineExceeded(
        "the request waited past its deadline (REQUEST_TIMEOUT_S) before reaching the model; "
        "retry, or send fewer inputs at once",
        code="timeout",
    )


def still_wanted(metrics: Metrics, left: int, deadline: float | None,
                 disconnected: Callable[[], bool] | None) -> None:
    """Raise 504 past ``deadline``, 499 once the client left; ``left`` inputs dropped."""
    error: ApiError
    if deadline is not None and time.monotonic() > deadline:
        error = deadline_error()
    elif disconnected is not None and disconnected():
        error = ClientDisconnected("the client disconnected", code="client_disconnected")
    else:
        return
    metrics.dropped_inputs.labels(reason=error.reason).inc(left)
    raise error
