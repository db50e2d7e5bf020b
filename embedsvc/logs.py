"""Log setup of a serving process: the ``embedsvc`` loggers and waitress's own (plain text or
one JSON object per line, the same for both) and, in that process only, the model libraries'
progress bars and warnings switched off.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import orjson

_PLAIN = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"
# The libraries that load the model: what they print while loading (a "Loading weights"
# progress bar, notes about the checkpoint) is not a server's output.
_MODEL_LIBRARIES = ("transformers", "sentence_transformers", "huggingface_hub")
# Loggers whose lines are the process's own: ours, and waitress's ("waitress" and
# "waitress.queue": connection limit reached, task queue depth, a client gone mid-answer),
# which serves `embedsvc serve`, `waitress-serve` and the probe port under gunicorn.
_SERVER_LOGGERS = ("embedsvc", "waitress")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


class _StderrHandler(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is when a line is written, as
    Python's last-resort handler does: one that kept the stream of the moment it was made
    wrote to a closed file once that stream was swapped out and closed (pytest's capture)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


def configure_logging(level: str, fmt: str) -> None:
    """Give the ``embedsvc`` and ``waitress`` loggers one stderr handler and one format,
    whatever server hosts them.

    Servers such as gunicorn configure their own loggers only; without this, ours would
    fall through to Python's last-resort handler and lose everything below WARNING, and
    waitress's would reach the root logger in another format (``waitress-serve`` sets one up).
    """
    handler = _StderrHandler()
    handler._embedsvc = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_PLAIN))
    for name in _SERVER_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level.upper())
        for old in list(logger.handlers):
            if getattr(old, "_embedsvc", False):
                logger.removeHandler(old)
        logger.addHandler(handler)
        logger.propagate = False
    logging.getLogger("embedsvc").debug("logging configured in pid %d", os.getpid())


_quieted = False  # quiet_model_libraries has run in this process


def quiet_model_libraries() -> None:
    """Switch off the model libraries' progress bars and warnings in this process.

    For the process that serves only: a library user's own process keeps its defaults. Errors
    still show, and anything that stops the model from loading reaches our log as the error.
    Imports none of them: a process that serves without PyTorch never loads transformers, and
    one that does reads the settings left in its environment when it first imports it.

    Once a process: a second look would find a library that the model's loader thread is
    importing meanwhile (``embedsvc serve`` starts it between its two looks) listed in
    ``sys.modules`` but half made, and importing from it there raised ImportError (a
    circular import, to Python): the start failed.
    """
    global _quieted
    if _quieted:
        return
    _quieted = True
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # also huggingface_hub's bars
        transformers_logging.set_verbosity_error()
    else:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    else:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars too
    for name in _MODEL_LIBRARIES:
        logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module=rf"{name}(\.|$)")
