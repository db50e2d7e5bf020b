import contextlib
import ctypes
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from embedsvc.api.openai_tokens import write_tiktoken_cache

# Never reach a model hub: the bundled model loads from site-packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Client libraries under test must not phone home: haystack sends telemetry unless told not to.
os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")


@pytest.fixture(scope="session")
def tiktoken_cache(tmp_path_factory):
    """TIKTOKEN_CACHE_DIR holding cl100k_base and o200k_base, so tiktoken never downloads."""
    directory = str(tmp_path_factory.mktemp("tiktoken"))
    write_tiktoken_cache(Path(directory))  # what `embedsvc tiktoken-cache DIR` writes
    before = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = directory
    yield directory
    if before is None:
        os.environ.pop("TIKTOKEN_CACHE_DIR", None)
    else:
        os.environ["TIKTOKEN_CACHE_DIR"] = before


@pytest.fixture(autouse=True)
def _server_loggers_as_found():
    """Put the ``embedsvc`` and ``waitress`` loggers back as each test found them: a test that
    configures logging (as a serving process does) leaves no handler, level or switch behind
    for the tests that run after it in the same worker."""
    import logging

    loggers = [logging.getLogger(name) for name in ("embedsvc", "waitress")]
    found = [(logger.handlers[:], logger.level, logger.propagate) for logger in loggers]
    yield
    for logger, (handlers, level, propagate) in zip(loggers, found, strict=True):
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


@pytest.fixture(autouse=True)
def _signal_handlers_as_found():
    """Put SIGINT, SIGTERM and SIGHUP back as each test found them: a test that runs
    `embedsvc serve` or a bulk job in process leaves SIGHUP ignored (which every process the
    worker starts after it inherits) or SIGINT at its default (Ctrl-C then kills the worker)."""
    import signal

    found = {signum: signal.getsignal(signum)
             for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for signum, handler in found.items():
        if handler is not None and signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


# ONNX graphs that the tests and the servers they start export go to a cache inside this
# checkout's .pytest_cache (ignored by git), never a user's: kept between runs, so only the
# first run exports, and nothing is left in /tmp by a model load still running at exit.
os.environ.setdefault("EMBEDSVC_CACHE_DIR", str(Path(__file__).resolve().parents[1]
                                                / ".pytest_cache" / "embedsvc-graphs"))


_shared_root = pytest.StashKey[str]()
_subreaper = pytest.StashKey[bool]()
_PR_SET_CHILD_SUBREAPER = 36  # prctl(2)


def pytest_configure(config):
    """In the controlling process (xdist's, or pytest's own without -n): the directory where
    tests/integration/servers.py's ``Shared`` keeps one server per configuration, which the
    xdist workers it starts inherit through the environment."""
    from .integration.servers import SHARED_DIR

    if hasattr(config, "workerinput") or SHARED_DIR in os.environ:
        return
    if sys.platform.startswith("linux"):
        # The shared servers outlive the worker that started them: as their subreaper, this
        # process inherits them then, reaps them at the end, and so counts their CPU time.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        config.stash[_subreaper] = True
    root = tempfile.mkdtemp(prefix="embedsvc-shared-")
    os.environ[SHARED_DIR] = root
    config.stash[_shared_root] = root


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtestloop(session):
    """Stop the shared servers once every test has run: inside pytest-cov's wrapper of this
    hook, so that the coverage data their exit writes is in its report."""
    try:
        return (yield)
    finally:
        _stop_shared(session.config)


def pytest_unconfigure(config):
    _stop_shared(config)  # when the run ended before its test loop
    if config.stash.get(_subreaper, False):
        # A shared server that exited while its xdist worker still ran became a zombie of
        # this process when that worker exited: reap it, so that its CPU time is counted.
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass


def _stop_shared(config) -> None:
    from .integration.servers import SHARED_DIR, Shared

    root = config.stash.get(_shared_root, None)
    if root is not None:
        del config.stash[_shared_root]
        Shared(Path(root)).stop_all()
        shutil.rmtree(root, ignore_errors=True)
        os.environ.pop(SHARED_DIR, None)
