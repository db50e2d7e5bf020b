"""``embedsvc serve`` in one process: the model loads in a thread of its own from the start,
while this one imports and prepares the web stack; then the server binds and serves.

ONNX Runtime builds its session (the larger part of a start: the graph optimised, the
weights placed) and the record's files are digested without the GIL, while the web stack's
imports (the metrics, pydantic, the route table, waitress) and pydantic's one-off lookup of
its plugins hold it: side by side they take the longer of the two, not their sum, where the
machine has a second core free. The port is bound once the model is loaded, as before: until
then a client's connection is refused, never answered 503. Several models load one after
another in this thread, as before.

Example (loads the model and blocks)::

    serve(Settings(port=0))
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

from ..logs import configure_logging, quiet_model_libraries
from ..settings import Settings
from .hangup import reload_keys_on_hangup

if TYPE_CHECKING:
    from ..model.encoder import Encoder
    from ..service import Service

log = logging.getLogger(__name__)


class Loading:
    """The model of ``settings`` loading in a daemon thread (a Ctrl-C during the load exits
    without waiting for it); ``result()`` waits for the encoder or raises what the load
    raised."""

    def __init__(self, settings: Settings) -> None:
        self._done = threading.Event()
        self._encoder: Encoder | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._load, args=(settings,), name="embedsvc-loader",
                         daemon=True).start()

    def _load(self, settings: Settings) -> None:
        try:
            from ..model import backend  # not through service.py: its imports wait

            self._encoder = backend.load_encoder(settings)
        except BaseException as exc:  # noqa: BLE001 - raised again in the thread that waits
            self._error = exc
        finally:
            self._done.set()

    def result(self) -> Encoder:
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._encoder is not None
        return self._encoder


def serve(settings: Settings) -> int:
    """Load the model, then serve until a signal; the exit code."""
    configure_logging(settings.log_level, settings.log_format)  # before the loader logs
    if settings.log_level != "debug":
        quiet_model_libraries()
    one = not settings.models and not settings.models_file  # else catalog.py's list
    loading = Loading(settings) if one else None
    from .process import serving_process

    serving_process(settings)
    service = _service(settings, loading)
    reload_keys_on_hangup(service)  # while the model loads too
    _prepare_web()
    try:
        service.start(background=False)
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    return _run(settings, service)


def _service(settings: Settings, loading: Loading | None) -> Service:
    from ..service import Service, serve_models

    return serve_models(settings, lambda own, i: Service(
        own, loader=loading.result if loading is not None else None))


def _prepare_web() -> None:
    """What the server and its first request need of the web stack, while the model loads."""
    from ..api.schemas import prepare_validation
    from . import server  # noqa: F401 - its imports: the pipeline, the route table, waitress

    prepare_validation()


def _run(settings: Settings, service: Service) -> int:
    from .server import Server, flush_logs

    server = Server(settings, service)
    server.run()
    if server.drain_report is not None and not server.drain_report.clean:
        # The batch still on the device at the drain timeout runs in torch's native threads,
        # which abort the process (SIGABRT) if the interpreter tears them down: leave now.
        log.info("exiting with a batch still computing")
        flush_logs()
        os._exit(0)
    return 0
