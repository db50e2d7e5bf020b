"""logs.py: plain or JSON lines on one stderr handler."""

import logging
import os
import subprocess
import sys

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


def test_waitress_lines_take_the_format_of_ours(capsys):
    configure_logging("info", "json")
    try:
        logging.getLogger("waitress.queue").warning("Task queue depth is %d", 5)
        logging.getLogger("waitress").info("Client disconnected while serving /embed")
        logging.getLogger("embedsvc.x").info("ours")
        lines = [orjson.loads(line) for line in capsys.readouterr().err.splitlines()]
        assert [e["logger"] for e in lines] == ["waitress.queue", "waitress", "embedsvc.x"]
        assert lines[0]["message"] == "Task queue depth is 5" and lines[0]["level"] == "warning"
        configure_logging("info", "plain")
        logging.getLogger("waitress").warning("total open connections reached the limit")
        plain = capsys.readouterr().err.splitlines()
        assert len(plain) == 1 and plain[0].endswith(
            f" WARNING [{os.getpid()}] waitress: total open connections reached the limit")
    finally:
        configure_logging("info", "plain")


def test_the_model_libraries_are_quieted_once_not_looked_at_half_imported():
    """``embedsvc serve`` quiets them, starts the model's loader thread, then quiets them
    again: the second look found transformers in sys.modules, half imported by the loader,
    imported from it and raised ImportError (a circular import, to Python): the start
    failed (a CI run's README test). Run in a process of its own: the quieting is global."""
    code = """
import sys, types
from embedsvc import logs
assert "transformers" not in sys.modules
logs.quiet_model_libraries()
sys.modules["transformers"] = types.ModuleType("transformers")  # as the loader has it
logs.quiet_model_libraries()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_lines_go_to_the_stderr_of_the_moment_not_a_closed_one(monkeypatch):
    import io

    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("info", "plain")
    first.close()  # as pytest closes a test's captured stream
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("embedsvc.x").info("after the swap")
    assert second.getvalue().endswith("embedsvc.x: after the swap\n")
