"""What `embedsvc serve` and the gunicorn worker share of a graceful drain: how the service is
drained once the requests already arriving are in, and the one log line that says how it went.

>>> summary(1.25, 12, ShutdownReport(completed=12, failed=0, clean=True))
'drained in 1.2s: 12 inputs computed while draining, none left unfinished; stopping'
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..service import Service
from ..work import ShutdownReport

log = logging.getLogger(__name__)
_POLL_S = 0.05


def inputs_computed(service: Service) -> int:
    value = service.metrics.registry.get_sample_value("embedsvc_inputs_total")
    return int(value or 0)


def drain_service(service: Service, arriving: Callable[[], bool], deadline: float
                  ) -> ShutdownReport:
    """Drain ``service`` by ``deadline`` (monotonic), once ``arriving()`` is false.

    The requests arriving or running when the listener closed (an upload in progress, a
    request between its parsing and the batcher) are let in before the service stops
    admitting; ``arriving`` says whether any of them still is.
    """
    while arriving() and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return service.drain(max(0.0, deadline - time.monotonic()))


def summary(seconds: float, computed: int, report: ShutdownReport) -> str:
    """The drain's log line."""
    done = f"drained in {seconds:.1f}s: {computed} inputs computed while draining"
    if report.failed == 0:
        return f"{done}, none left unfinished; stopping"
    return (f"{done}; requests unfinished at the timeout ({report.failed} inputs) got 503; "
            "stopping")
