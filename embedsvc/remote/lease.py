"""A front's lease: the engine's room, reserved in the front before it tokenizes.

In one process a request reserves room in the device's admission before it is tokenized
(admission.py), so that a request refused costs nothing. A front before an engine process does
the same on its lease, an ``Admission`` with the engine's room (MAX_QUEUE inputs, or the value
the engine derived and says in its pongs, and MAX_QUEUE_TOKENS tokens) and the same rules in
the same order: first come, first served in the front's FIFO; 413 past MAX_QUEUE; 429 at once,
with ``Retry-After``, for work that would reach the model after its deadline; 504 for a wait in
the FIFO past it; 499 for a client that left; 503 when draining.

The wait is predicted from the engine's pongs (every 0.5 s): the device's rate and the tokens
ahead of a new client's first input there (``Admission.ahead_of_new``). The front adds what is
its own: its requests still tokenizing, its client's own requests in the engine (ahead of its
next one, as in the engine's fair queue), and when its room is full, everything it holds: a
front's room frees as its requests end, and under the engine's fair queue the requests of many
clients end together, late, where one process frees room input by input. The fronts share the
device, so the front's own work drains at its share of the rate (the rate divided by the fronts
the engine hears from), and the engine's queue, which drains at the whole rate, counts in
proportion.

Each front holds the engine's whole room, not a part of it: a part frees only as whole requests
end, and a burst of 48 requests on two fronts (tests/integration/test_overload.py's) then got
18 answers where one process gives 33. The engine still admits each request on arrival, at its
exact token count, with the room of all fronts together and its tenant's quotas; a refusal there
costs the front its tokenizing: it comes when the fronts' work meets in the engine, and when the
pong a front predicted from (up to 0.5 s old) missed a burst.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

from ..admission import Admission, Ticket
from ..metrics import Metrics
from ..settings import Settings


class EngineView(Protocol):
    """What the lease reads of the engine (``Link``'s fields, from its last card and pong)."""

    queue_limit: int
    fronts: list[int]
    rate: float
    ahead: int


class Lease(Admission):
    """A front's admission before tokenizing, on the engine's room."""

    def __init__(self, engine: EngineView, settings: Settings,
                 metrics: Metrics | None = None) -> None:
        self.engine = engine
        self._in_engine: dict[Hashable, int] = {}  # flow -> its tokens sent, not answered
        super().__init__(max_inputs=None, max_tokens=settings.max_queue_tokens,
                         timeout_s=settings.request_timeout_s,
                         floor_inputs=settings.max_inputs_per_request, metrics=metrics,
                         queue=self._ahead)

    @property
    def shares(self) -> int:
        """Among how many fronts the device is shared: those the engine hears from."""
        return max(1, len(self.engine.fronts))

    @property
    def limit(self) -> int:
        return self.engine.queue_limit or self.floor_inputs  # 0: no card yet

    @property
    def rate(self) -> float:
        """The front's share of the device's rate: how fast its own work drains."""
        return self.engine.rate / self.shares

    def _ahead(self, flow: Hashable) -> int:
        """The tokens ahead of ``flow``'s next input, in tokens of this lease's rate: the
        engine's queue (which drains at the whole rate) and the flow's own work there."""
        return self.engine.ahead // self.shares + self._in_engine.get(flow, 0)

    def _fifo_tokens(self, ticket: Ticket) -> int:
        """What must be answered before room frees for ``ticket`` behind the FIFO: all the
        lease holds and every waiter ahead (its room frees as requests end, not input by
        input as the engine's does)."""
        return self.used_tokens + sum(t.tokens for t in self._waiting)

    def sent(self, ticket: Ticket, tokens: int) -> None:
        """``ticket``'s request went to the engine with ``tokens`` tokens: its room is held
        at that count until ``answered``."""
        self.settle(ticket, tokens)
        if ticket.flow is not None:
            with self._cond:
                self._in_engine[ticket.flow] = self._in_engine.get(ticket.flow, 0) + tokens

    def answered(self, ticket: Ticket) -> None:
        """``ticket``'s request is over (answered, failed or given up on): its room frees."""
        if ticket.flow is not None:
            with self._cond:
                left = self._in_engine.pop(ticket.flow, 0) - ticket.tokens
                if left > 0:
                    self._in_engine[ticket.flow] = left
        self.release(ticket.inputs, ticket.tokens)
