"""The two programs of a multi-process server: the engine (the one process that holds the
model, its device and the batcher) and a front (an HTTP process in front of it).

Both are the same program as their parent, started with a subcommand users do not type
(``embedsvc engine``, ``embedsvc front``): ``embedsvc serve --workers N`` starts them
(serving/supervisor.py), and gunicorn's first worker starts the engine
(serving/shared_engine.py). Each watches the processes it serves (``watch``) and drains when they
are gone, so that no engine is left behind when its supervisor or gunicorn's master dies,
even by SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..catalog import catalog
from ..remote.place import engine_address, model_dir, usage_file
from ..service import Service, serve_models
from ..settings import Settings
from ..tenant_usage import UsageTable
from ..tenants import Quotas
from .hangup import reload_keys_on_hangup
from .lifeline import BOOT_FAILURE, ENGINE_BOOT_ERROR, alive, mark_up, watch
from .process import serving_process

log = logging.getLogger(__name__)



def run_engine(settings: Settings, directory: Path, watch_pids: Iterable[int],
               index: int = 0) -> int:
    """Load the model (the ``index``-th of several, catalog.py), then serve it on the engine
    socket in ``directory`` until SIGTERM or until a watched process is gone (then the
    directory goes too); the exit code."""
    from ..model.text import describe, text_spec  # the model side: never in a front
    from ..remote.server import EngineServer

    watch_pids = list(watch_pids)
    serving_process(settings)
    drain: Callable[[str], None] | None = None  # once the model is loaded
    abandoned = threading.Event()

    def gone(pid: int) -> None:
        if drain is None:  # loading: nothing admitted, and nobody will connect
            log.info("engine stopping as it loads: process %d, which it would serve, is gone",
                     pid)
            shutil.rmtree(directory, ignore_errors=True)
            logging.shutdown()  # the line above written out before the exit
            os._exit(0)
        abandoned.set()
        drain(f"process {pid}, which it serves, is gone")

    orphaned = [pid for pid in watch_pids if not alive(pid)]
    if orphaned:
        log.info("engine not started: process %d, which it would serve, is gone", orphaned[0])
        return 0
    # watched from before the load: a supervisor or gunicorn master gone meanwhile would
    # leave a model loading for nobody, beside the next start's copy
    watch(watch_pids, gone)
    entries = catalog(settings)
    settings = entries[index].settings
    service = Service(settings)
    service.name = entries[index].name
    if len(entries) > 1 and settings.keys_file:
        _share_quotas(service, usage_file(directory, index), index, len(entries))
    reload_keys_on_hangup(service)  # while the model loads too
    try:
        service.start(background=False)
    except RuntimeError as exc:
        log.error("%s", exc)
        with contextlib.suppress(OSError):  # for gunicorn's workers to name the cause
            (directory / BOOT_FAILURE).write_text(str(exc).splitlines()[0][:500])
        return ENGINE_BOOT_ERROR
    runner = service.runner
    assert runner is not None
    address = engine_address(directory)
    server = EngineServer(runner, address, state=lambda: service.state,
                          metrics=service.metrics,
                          card={"info": describe(runner.info), "text": text_spec(runner.encoder)})
    stop = threading.Event()
    drain = _drainer(lambda: service.drain(settings.drain_timeout_s), stop)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: drain(f"signal {signum}"))
    info = runner.info
    log.info("engine serving: pid=%d device=%s dtype=%s model=%s kind=%s on %s", os.getpid(),
             info.device, info.dtype, info.name, info.kind, address)
    mark_up(directory)
    server.run(stop)
    if abandoned.is_set():  # nobody will connect again: its directory is litter now
        shutil.rmtree(directory, ignore_errors=True)
    log.info("engine stopped")
    return 0


def _share_quotas(service: Service, path: Path, index: int, models: int) -> None:
    """One count of each tenant's use for every model's engine of the service; where the
    table cannot be made, this model's own count, said in one line."""
    try:
        table = UsageTable.open(path, column=index, columns=models)
    except OSError as exc:
        log.warning("tenants' quotas count this model's requests alone: %s cannot be mapped "
                    "(%s)", path, exc)
        return
    service.quotas = Quotas(service.keyring, table)


def run_front(settings: Settings, directory: Path, fd: int, probe_fd: int | None,
              watch_pids: Iterable[int]) -> int:
    """Serve HTTP on the listening socket ``fd`` (its own, or one shared by every front), the model
    in the engine process; drain on SIGTERM or when the supervisor is gone."""
    from .server import Server

    serving_process(settings)
    service = serve_models(settings, lambda own, i: Service(
        own, engine_address=engine_address(model_dir(directory, i))))
    reload_keys_on_hangup(service)
    service.start(background=True)
    sock = socket.socket(fileno=fd)
    probes = socket.socket(fileno=probe_fd) if probe_fd is not None else None
    server = Server(settings, service, sock=sock, probe_sock=probes)
    watch(watch_pids, lambda pid: server.stop())
    mark_up(directory)
    server.run()
    return 0


def _drainer(drain: Callable[[], Any], stop: threading.Event) -> Callable[[str], None]:
    """Once, in a thread: finish what was admitted, then let the loop end."""
    started = threading.Event()

    def begin(why: str) -> None:
        if started.is_set():
            return
        started.set()
        log.info("engine draining: %s", why)

        def run() -> None:
            try:
                drain()
            finally:
                stop.set()

        threading.Thread(target=run, name="embedsvc-engine-drain", daemon=True).start()

    return begin


def child_command(subcommand: str, *args: str) -> list[str]:
    """This program again, with ``subcommand``: the module ``python -m`` ran, or the script
    (the ``embedsvc`` command), as multiprocessing's spawn finds its parent's main."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        module = spec.name.removesuffix(".__main__")
        return [sys.executable, "-m", module, subcommand, *args]
    return [sys.executable, sys.argv[0], subcommand, *args]
