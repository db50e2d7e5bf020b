"""What `embedsvc serve` and the gunicorn worker share of a graceful drain: how the service is
drained once the requests already arriving are in, and the one log line that says how it went.

>>> summary(1.25, 12, ShutdownReport(completed=12, failed=0, clean=True))
'drained in 1.2s: 12 inputs computed while draining, none left unfinished; stopping'
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator

from ..service import Service
from ..work import ShutdownReport

log = logging.getLogger(__name__)
_POLL_S = 0.05

# Linux's SO_ATTACH_FILTER and SO_DETACH_FILTER, and a classic BPF program of one
# instruction, "return 0": every packet to the socket dropped. The program must outlive the
# call, so it is kept here.
_SO_ATTACH_FILTER, _SO_DETACH_FILTER = 26, 27
_DROP_ALL = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0))  # BPF_RET|BPF_K


@contextlib.contextmanager
def queue_shut(listener: socket.socket) -> Iterator[None]:
    """Within, new connections are kept out of ``listener``'s accept queue: empty the queue
    there, and close the listener right after.

    A listener closed with connections in its queue resets them, and their clients have
    sent a request that cannot then be retried safely. Taking the queued ones first left a
    gap between the last accept and the close (the accept gives up the interpreter lock, and
    getting it back can take milliseconds under load), in which clients reconnecting after
    a ``Connection: close`` queued and were reset: one run in ten of a CI test. On Linux a
    filter on the listener drops the new connections' first packets meanwhile: their clients
    send again a second later, to a closed port, and are refused, as after the close. The
    connections already queued took the listener's filter when they were made, so they are
    not touched (one whose handshake is completing as the filter goes on can still be reset,
    a far narrower gap). The filter comes off at the end, before the close: the kernel's
    socket may outlive this process (systemd's socket activation keeps it for the next
    start). It is on the kernel's socket, which every process that holds the listener
    shares: use it only where the others stop too. Several gunicorn workers share one: the
    first to finish takes the filter off while the others may still be emptying the queue,
    so there the gap narrows without closing.
    """
    shut = False
    if sys.platform.startswith("linux"):
        program = struct.pack("HL", 1, ctypes.addressof(_DROP_ALL))  # struct sock_fprog
        try:
            listener.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, program)
            shut = True
        except OSError as exc:
            log.debug("new connections not kept out of the listener's queue: %s", exc)
    try:
        yield
    finally:
        if shut:
            with contextlib.suppress(OSError):
                listener.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)


def held_by(pid: int, listener: socket.socket) -> bool:
    """Whether process ``pid`` holds ``listener`` too; true when it cannot be told (no /proc,
    or another user's process)."""
    with contextlib.suppress(OSError):
        mine = f"socket:[{os.fstat(listener.fileno()).st_ino}]"
        root = f"/proc/{pid}/fd"
        for fd in os.listdir(root):
            with contextlib.suppress(OSError):
                if os.readlink(f"{root}/{fd}") == mine:
                    return True
        return False
    return True


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
