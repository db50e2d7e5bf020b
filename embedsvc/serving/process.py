"""The process model: where the model lives for the process that serves, and fork() handled.

``embedsvc:app`` is a ``LazyApp``. Importing it loads nothing and touches no accelerator.
In each process that serves, the first request of any kind builds that process's engine:
the model itself, or, under ``gunicorn -w N`` (N > 1) and ENGINE=process, a front of the
one engine process that the workers share (serving/shared_engine.py starts it).
Several models (MODELS) are weighed against their devices' memory before any loads
(serving/memory.py): outside gunicorn as the app loads, under gunicorn by the first worker
to build its app, once a master.

Around ``fork()``:
- a child never uses its parent's engine, batcher, queue or locks: it builds its own;
- when the workers share an engine process, the master preloads nothing, even with
  ``--preload``: no worker is forked from a process that holds a model;
- otherwise (one worker, ENGINE=inline), under ``gunicorn --preload`` the master loads the
  weights onto the CPU (no device probing) while it loads the app, so that its forked
  workers share those pages copy-on-write; each worker then places them on its device
  itself, so the master never initialises CUDA. A model that serves from its export record
  (model/lean.py) is not preloaded: the master holds no ONNX Runtime session, whose threads
  a fork would break;
- a child whose parent had initialised CUDA cannot use it: it stops at boot with one line
  that says why and what to do.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from types import FrameType
from typing import TYPE_CHECKING, Any

from ..errors import Unavailable
from ..logs import configure_logging, quiet_model_libraries
from ..service import Service, load_encoder, serve_models
from ..settings import Settings
from .preflight import FAILURE, PreflightError, check_tracing

if TYPE_CHECKING:  # the web stack is imported where the app is built, not with this module
    from flask import Flask

    from ..api.wsgi import Pipeline
    from ..model.encoder import Encoder

log = logging.getLogger(__name__)

BAD_FORK_MESSAGE = (
    "embedsvc: CUDA was initialised in the parent process before it forked this worker, so "
    "this worker cannot use the GPU. Drop --preload (or preload_app), or move the code that "
    "touches CUDA into a post_fork hook; embedsvc itself touches CUDA only after the fork."
)
# gunicorn stops (rather than respawning forever) when a worker exits with this code at boot.
WORKER_BOOT_ERROR = 3


def serving_process(settings: Settings) -> None:
    """Set up the output of the process that serves, when it starts serving (never at import).

    Its log handler; the model libraries' progress bars and warnings off (kept at
    LOG_LEVEL=debug); and /metrics without the ``*_created`` samples, which prometheus_client
    adds to every counter and histogram (half the exposition, and nothing our dashboards or
    alerts read). prometheus_client's switch for them is global, hence here and not in
    ``Metrics``.
    """
    from prometheus_client import disable_created_metrics

    configure_logging(settings.log_level, settings.log_format)
    if settings.log_level != "debug":
        quiet_model_libraries()
    disable_created_metrics()


def cuda_poisoned() -> bool:
    """True in a forked child whose parent had initialised CUDA. Imports nothing."""
    torch = sys.modules.get("torch")
    check = getattr(getattr(torch, "cuda", None), "_is_in_bad_fork", None)
    if check is None:  # torch not imported (so CUDA was not used) or a torch without the flag
        return False
    return bool(check())


def check_fork(settings: Settings) -> None:
    """Raise at boot if this process cannot use the device it is configured for."""
    if settings.device != "cpu" and cuda_poisoned():
        raise RuntimeError(BAD_FORK_MESSAGE)


@dataclass(frozen=True)
class OpenFiles:
    """What the open-files limit leaves a server: ``connections`` of ``per_connection``
    descriptors each, beside the ``held`` open at start and ``spare`` for what opens later."""

    limit: int | None  # the soft limit; None when unlimited
    held: int
    spare: int
    per_connection: int
    connections: int

    def __str__(self) -> str:
        if self.limit is None:
            return f"up to {self.connections} connections (no open-files limit)"
        return (f"up to {self.connections} connections: open-files limit {self.limit} = "
                f"{self.held} open + {self.spare} spare + {self.per_connection} a connection")


# What a serving process opens after its start besides connections: the probe port's listener
# and its 32 connections, a cache file written or read, a log file reopened
SPARE_DESCRIPTORS = 128


def ensure_open_files(connections: int, per_connection: int = 1,
                      spare: int = SPARE_DESCRIPTORS) -> OpenFiles:
    """Raise the soft open-files limit to fit ``connections`` of ``per_connection``
    descriptors each (a socket and the temporary files it may hold), the descriptors open now
    and ``spare``, where the hard limit allows; how many connections fit under it then.

    A server past its limit fails every accept and every temporary file, its probe port's
    included, so the connections are bounded by what fits rather than by what was asked.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = _open_descriptors()
    want = held + spare + connections * per_connection
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft == resource.RLIM_INFINITY:
        return OpenFiles(None, held, spare, per_connection, connections)
    fits = max(1, min(connections, (soft - held - spare) // per_connection))
    if fits < connections:
        log.warning("the open-files limit (%d, hard %s) holds %d of MAX_CONNECTIONS=%d "
                    "connections (%d descriptors each, %d open, %d spare); raise the limit "
                    "(ulimit -n, LimitNOFILE=) or lower MAX_CONNECTIONS", soft,
                    "unlimited" if hard == resource.RLIM_INFINITY else hard, fits,
                    connections, per_connection, held, spare)
    return OpenFiles(soft, held, spare, per_connection, fits)


def _open_descriptors() -> int:
    """Descriptors this process holds now (Linux and macOS list them in /dev/fd)."""
    try:
        return len(os.listdir("/dev/fd")) - 1  # less the one listdir held
    except OSError:
        return 0


def sibling_workers(pid: int | None = None, read: Callable[[str], str] | None = None) -> int:
    """How many children the parent of ``pid`` has (gunicorn workers are siblings); Linux only."""
    ppid = os.getppid() if pid is None else pid
    path = f"/proc/{ppid}/task/{ppid}/children"
    try:
        text = read(path) if read else open(path).read()  # noqa: SIM115
    except OSError:
        return 1
    return max(1, len(text.split()))


def warn_if_wasteful(device: str, workers: int, server: str | None) -> str | None:
    """The warning for several gunicorn workers each holding a model copy on one GPU."""
    if not device.startswith("cuda") or workers <= 1 or not server:
        return None
    message = (
        f"this is one of {workers} {server} workers and each holds its own copy of the model "
        f"on {device}; '-w 1 --threads N' serves the same load with one copy"
    )
    log.warning(message)
    return message


def preloading_in_gunicorn_master() -> bool:
    """True while gunicorn's master loads the app for ``--preload`` (before any fork).

    gunicorn loads a preloaded app from ``Arbiter.setup`` in the master, and a plain one from
    the worker after the fork, so the caller's stack tells the two apart without asking
    gunicorn for its configuration.
    """
    arbiter = sys.modules.get("gunicorn.arbiter")
    setup = getattr(getattr(arbiter, "Arbiter", None), "setup", None)
    if setup is None:
        return False
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is setup.__code__:
            return True
        frame = frame.f_back
    return False


class LazyApp:
    """The WSGI app of ``embedsvc:app``; see the module docstring for what it does when.

    In a gunicorn ``post_worker_init`` hook, to load the model before the first request::

        from embedsvc import app
        app.warm(timeout=120)
    """

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        load: Callable[[Settings, Any], Encoder] = load_encoder,
    ) -> None:
        self._env = os.environ if env is None else env
        self._load = load
        self._lock = threading.Lock()
        self._app: Pipeline | None = None
        self._pid = 0
        self._preloaded: Any = None
        settings = Settings.from_env(self._env)
        check_fork(settings)
        check_tracing(settings.otlp_endpoint)  # when the app loads, not at its first request
        if not _under_gunicorn():  # waitress-serve: before it listens (gunicorn: _build)
            weigh_models(settings)
        os.register_at_fork(after_in_child=self._after_fork_in_child)
        if preloading_in_gunicorn_master():
            self._preload(settings)

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        return self.pipeline()(environ, start_response)

    def pipeline(self) -> Pipeline:
        """This process's app (``api/wsgi.py``'s ``serving_app``); its engine starts loading
        on the first call."""
        app = self._app
        if app is not None and self._pid == os.getpid():
            return app
        with self._lock:
            if self._app is None or self._pid != os.getpid():
                self._app = self._build()
                self._pid = os.getpid()
            return self._app

    def flask(self) -> Flask:
        """This process's Flask app, which serves the same pipeline (Flask is imported and
        built on this call, or on the first request for a path outside the route table)."""
        from ..api.wsgi import flask_host

        return flask_host(self.pipeline())

    @property
    def service(self) -> Service:
        return self.pipeline().service

    def warm(self, timeout: float | None = None) -> Service:
        """Build this process's service and wait until the model is loaded and warm."""
        service = self.service
        try:
            service.ready(timeout)
        except Unavailable as exc:
            raise RuntimeError(service.failure or exc.message) from None
        return service

    def _build(self) -> Pipeline:
        from ..api.schemas import prepare_validation
        from ..api.wsgi import serving_app
        from .shared_engine import SharedEngine, engine_owner, gunicorn_workers

        settings = Settings.from_env(self._env)
        serving_process(settings)
        check_fork(settings)
        workers = gunicorn_workers()
        owner = engine_owner(settings, workers)
        if owner is not None:  # every worker and engine of the master reads one list
            from ..catalog import pinned
            from ..remote.place import owner_dir

            settings = pinned(settings, owner_dir(owner))
        if workers is not None:
            weigh_in_worker(settings, owner)
        if owner is not None:  # each model in one engine process that every worker feeds
            from ..remote.place import engine_address

            def remote(own: Settings, index: int) -> Service:
                shared = SharedEngine(settings, owner, index)
                shared.ensure()
                return Service(own, engine_address=engine_address(shared.directory),
                               keeper=shared.ensure)

            service = serve_models(settings, remote)
        else:
            service = serve_models(settings, lambda own, index: Service(
                own, loader=partial(self._load, own, self._preloaded if index == 0 else None)))
            service.on_ready.append(lambda info: warn_if_wasteful(
                info.device, sibling_workers(), _server_software(self._env)))
        app = serving_app(service)
        service.start(background=True)
        prepare_validation()  # while the model loads, not in the request that waits for it
        return app

    def _preload(self, settings: Settings) -> None:
        from ..model.device import pytorch_installed
        from ..model.kinds import load_model
        from ..model.lean import recorded
        from .shared_engine import engine_owner, gunicorn_workers

        serving_process(settings)
        workers = gunicorn_workers()
        if engine_owner(settings, workers) is not None:
            log.info("gunicorn master (pid %d) preloads nothing: its %s workers share one "
                     "engine process, which the first of them starts", os.getpid(), workers)
            return
        if settings.models or settings.models_file:
            log.info("gunicorn master (pid %d) preloads nothing: it serves several models "
                     "(MODELS), each loaded after the fork", os.getpid())
            return
        if recorded(settings) or not pytorch_installed():
            log.info("gunicorn master (pid %d) preloads nothing: the model serves without "
                     "PyTorch, and each worker opens its own ONNX Runtime session after the "
                     "fork", os.getpid())
            return
        log.info("gunicorn master (pid %d) preloads the weights on the CPU for its workers "
                 "to share; each worker places them on its device after the fork", os.getpid())
        self._preloaded = load_model(settings.model, settings.kind)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # another thread may have held the parent's at the fork
        self._app = None
        try:
            check_fork(Settings.from_env(self._env))
        except RuntimeError as exc:
            sys.stderr.write(f"{exc}\n")
            sys.stderr.flush()
            os._exit(WORKER_BOOT_ERROR)


def weigh_models(settings: Settings) -> None:
    """Several models: PreflightError, in one line, when they do not fit their devices."""
    from .memory import check_apart

    if settings.models or settings.models_file:
        refusal = check_apart(settings)
        if refusal is not None:
            raise PreflightError(refusal, FAILURE)


def weigh_in_worker(settings: Settings, owner: int | None) -> None:
    """Several models under gunicorn, before any engine starts: weighed once a master where
    the workers share the engines; where each worker holds its own (ENGINE=inline), by
    each worker. Models that do not fit stop gunicorn in one line."""
    from .shared_engine import check_memory_once, flush_logs

    if owner is not None:
        if settings.models or settings.models_file:
            check_memory_once(settings, owner)
        return
    try:
        weigh_models(settings)
    except PreflightError as exc:
        log.error("%s; then start gunicorn again", exc)
        flush_logs()
        os._exit(WORKER_BOOT_ERROR)


def _under_gunicorn() -> bool:
    """Whether gunicorn runs this code (its master or a worker), without importing it."""
    if "gunicorn.arbiter" not in sys.modules:
        return False
    from .shared_engine import gunicorn_workers

    return gunicorn_workers() is not None


def _server_software(env: Mapping[str, str]) -> str | None:
    software = env.get("SERVER_SOFTWARE", "")
    return software.split("/")[0] or None
