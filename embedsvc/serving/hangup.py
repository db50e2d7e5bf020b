"""SIGHUP in a serving program: the keys file reloaded, from the program's first moment.

SIGHUP's default ends a process. A serving program that installed its handler only once
its model had loaded (or its server had started) was ended by a key rotation's SIGHUP
that came meanwhile: the load was lost, and ``embedsvc serve --workers N``, which passes
SIGHUP to its children, counted it as a start that failed (five in a row stop it). The
command line calls ``reload_keys_on_hangup(None)`` first thing for ``embedsvc serve`` and
for the engine's and a front's programs (cli.py), before their imports; each program calls
it again with its service once that exists. Imports nothing else, so that it costs those
first lines nothing.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..service import Service


def reload_keys_on_hangup(service: Service | None) -> None:
    """SIGHUP reloads ``service``'s keys file; with ``None`` (no service yet: it reads the
    file as it is built) SIGHUP is ignored."""
    if service is None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGHUP, lambda signum, frame: service.keyring.reload())
