"""Log setup for the ``embedsvc`` loggers: plain text or one JSON object per line."""

from __future__ import annotations

import logging
import os
import sys

import orjson

_PLAIN = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"


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


def configure_logging(level: str, fmt: str) -> None:
    """Give the ``embedsvc`` loggers one stderr handler, whatever server hosts them.

    Servers such as gunicorn configure their own loggers only; without this, ours would
    fall through to Python's last-resort handler and lose everything below WARNING.
    """
    logger = logging.getLogger("embedsvc")
    logger.setLevel(level.upper())
    for handler in list(logger.handlers):
        if getattr(handler, "_embedsvc", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._embedsvc = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_PLAIN))
    logger.addHandler(handler)
    logger.propagate = False
    logger.debug("logging configured in pid %d", os.getpid())
