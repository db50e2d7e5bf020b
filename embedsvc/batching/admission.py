"""Admission: who may tokenize and queue work now, who waits, and who is told to come back.

A request reserves its inputs (and an estimate of its tokens) here *before* it tokenizes,
settles the reservation to its exact token count once tokenized, and gives it back input by
input as the batcher answers them. Three rules:

* **First come, first served.** Requests that do not fit wait in one FIFO; capacity freed
  goes to the oldest waiter, and a later request never overtakes it, so a request of
  MAX_INPUTS_PER_REQUEST inputs waits at most for the work admitted before it.
* **The truth about deadlines.** The device's rate (tokens per second, the best of its
  last few batches) and the tokens ahead of a request predict when it would reach the
  model. A request that would reach it after its deadline even at that rate gets 429 at
  once, with a ``Retry-After`` that says when the work ahead will have shrunk enough,
  instead of a 504 after waiting in vain.
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
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import (
    ClientDisconnected,
    DeadlineExceeded,
    Overloaded,
    PayloadTooLarge,
    shutting_down,
)
from ..metrics import Metrics

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


@dataclass(slots=True)
class Ticket:
    """One request's reservation; ``open`` until the batcher takes it over or it is freed."""

    inputs: int
    tokens: int
    deadline: float
    open: bool = False


class Admission:
    """The FIFO gate in front of tokenizing and queueing; thread-safe."""

    def __init__(self, *, max_inputs: int | None, max_tokens: int, timeout_s: float,
                 floor_inputs: int, metrics: Metrics | None = None) -> None:
        self.max_inputs = max_inputs  # None: derived from the measured rate (see ``limit``)
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.floor_inputs = floor_inputs
        self.metrics = metrics or Metrics()
        self.used_inputs = 0
        self.used_tokens = 0
        self._waiting: deque[Ticket] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._rates: deque[float] = deque(maxlen=_BEST_OF)  # tokens/s of the last batches
        self._inputs_ema = 0.0  # inputs and seconds of recent batches: inputs/s = ratio
        self._seconds_ema = 0.0

    @property
    def limit(self) -> int:
        """The inputs admitted at once (MAX_QUEUE, or its derived value)."""
        if self.max_inputs is not None:
            return self.max_inputs
        per_s = self._inputs_ema / self._seconds_ema if self._seconds_ema else 0.0
        derived = int(per_s * self.timeout_s)
        return max(self.floor_inputs, min(_AUTO_CAP * self.floor_inputs, derived))

    @property
    def rate(self) -> float:
        """Tokens per second: the best of the last _BEST_OF batches; 0 until one has run."""
        return max(self._rates, default=0.0)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def admit(self, inputs: int, tokens: int, deadline: float,
              disconnected: Callable[[], bool] | None = None) -> Ticket:
        """Reserve ``inputs`` and about ``tokens``; waits in FIFO order for room.

        Raises 413 (larger than MAX_QUEUE), 429 (cannot reach the model before
        ``deadline``), 503 (draining), 504 (still waiting at ``deadline``), 499 (the client
        left while waiting).
        """
        limit = self.limit
        if inputs > limit:
            raise PayloadTooLarge(
                f"this request has {inputs} inputs but the server admits at most {limit} at "
                "once (MAX_QUEUE); split it into smaller requests",
                param="input", code="too_many_inputs",
            )
        ticket = Ticket(inputs, min(tokens, self.max_tokens), deadline)
        with self._cond:
            self._refuse_if_closed()
            self._refuse_if_late(ticket, time.monotonic())
            if self._waiting or not self._fits(ticket):  # in line behind others, or no room
                self._waiting.append(ticket)
                try:
                    self._wait_turn(ticket, disconnected)
                finally:
                    self._waiting.remove(ticket)
                    self._cond.notify_all()  # the next waiter may fit now
            self.used_inputs += ticket.inputs
            self.used_tokens += ticket.tokens
            ticket.open = True
        return ticket

    def settle(self, ticket: Ticket, tokens: int) -> None:
        """The batcher takes the reservation over, at its exact token count."""
        with self._cond:
            if ticket.open:
                self.used_tokens += tokens - ticket.tokens
                ticket.tokens, ticket.open = tokens, False
                self._wake()

    def cancel(self, ticket: Ticket) -> None:
        """Free a reservation the batcher never took (an error while tokenizing); idempotent."""
        if not ticket.open:  # settled or cancelled: it never opens again, no lock needed
            return
        with self._cond:
            if ticket.open:
                ticket.open = False
                self._free(ticket.inputs, ticket.tokens)

    def release(self, inputs: int, tokens: int) -> None:
        """Inputs the batcher has answered or dropped."""
        with self._cond:
            self._free(inputs, tokens)

    def observe(self, tokens: int, inputs: int, seconds: float) -> None:
        """One computed batch, of ``tokens`` in ``inputs`` computed in ``seconds``."""
        if seconds <= 0:  # below the clock's resolution: no rate to learn from it
            return
        w = _RATE_WEIGHT if self._seconds_ema else 1.0
        with self._cond:
            self._rates.append(tokens / seconds)
            self._inputs_ema += w * (inputs - self._inputs_ema)
            self._seconds_ema += w * (seconds - self._seconds_ema)

    def close(self) -> None:
        """Refuse new requests (draining) and send the waiting ones away with 503."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def predicted_wait(self, tokens_ahead: int | None = None) -> float:
        """Seconds until work admitted or waiting now has reached the model."""
        rate = self.rate
        if rate <= 0:
            return 0.0
        if tokens_ahead is None:
            tokens_ahead = self.used_tokens + sum(t.tokens for t in self._waiting)
        return tokens_ahead / rate

    # -- under self._cond ---------------------------------------------------------------------

    def _free(self, inputs: int, tokens: int) -> None:
        self.used_inputs -= inputs
        self.used_tokens -= tokens
        self._wake()

    def _wake(self) -> None:
        """Tell the waiting requests that room may have freed. Only they wait on the
        condition (``_wait_turn``), each listed in ``_waiting`` while it does; when none is,
        the notification is skipped (every request frees and settles once)."""
        if self._waiting:
            self._cond.notify_all()

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise shutting_down()

    def _refuse_if_late(self, ticket: Ticket, now: float) -> None:
        wait = self.predicted_wait()
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
        if self.used_inputs + ticket.inputs > self.limit:
            return False
        return self.used_tokens == 0 or self.used_tokens + ticket.tokens <= self.max_tokens

    def _wait_turn(self, ticket: Ticket, disconnected: Callable[[], bool] | None) -> None:
        while not (self._waiting[0] is ticket and self._fits(ticket)):
            self._refuse_if_closed()
            left = ticket.deadline - time.monotonic()
            if left <= 0:
                raise deadline_error()
            if disconnected is not None and disconnected():
                self.metrics.dropped_inputs.labels(reason="disconnected").inc(ticket.inputs)
                raise ClientDisconnected("the client disconnected", code="client_disconnected")
            self._cond.wait(min(left, _WATCH_S) if disconnected is not None else left)


def deadline_error() -> DeadlineExceeded:
    return DeadlineExceeded(
        "the request waited past its deadline (REQUEST_TIMEOUT_S) before reaching the model; "
        "retry, or send fewer inputs at once",
        code="timeout",
    )
