"""logs.py: plain or JSON lines on one stderr handler."""

import logging

import orjson

from embedsvc.logs import JsonFormatter, configure_logging


def test_json_logs_are_one_object_per_line():
    record = logging.LogRecord("embedsvc.x", logging.INFO, __file__, 1, "hi %s", ("there",), None)
    entry = orjson.loads(JsonFormatter().format(record))
    assert entry["message"] == "hi there" and entry["level"] == "info" and entry["pid"] > 0


def test_configuring_twice_keeps_one_handler():
    configure_logging("info", "plain")
    configure_logging("warning", "json")
    logger = logging.getLogger("embedsvc")
    ours = [h for h in logger.handlers if getattr(h, "_embedsvc", False)]
    assert len(ours) == 1 and isinstance(ours[0].formatter, JsonFormatter)
    assert logger.level == logging.WARNING and not logger.propagate
