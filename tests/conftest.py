import os
import shutil
import tempfile

import pytest

from .tiktoken_files import write_cache

# Never reach a model hub: the bundled model loads from site-packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Client libraries under test must not phone home: haystack sends telemetry unless told not to.
os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")


@pytest.fixture(scope="session")
def tiktoken_cache(tmp_path_factory):
    """TIKTOKEN_CACHE_DIR holding cl100k_base and o200k_base, so tiktoken never downloads."""
    directory = str(write_cache(tmp_path_factory.mktemp("tiktoken")))
    before = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = directory
    yield directory
    if before is None:
        os.environ.pop("TIKTOKEN_CACHE_DIR", None)
    else:
        os.environ["TIKTOKEN_CACHE_DIR"] = before

# ONNX graphs exported during the run go to a directory of the run, removed at its end: the
# suite neither reads a user's cache nor leaves one behind. Servers the tests start inherit it.
_CACHE = tempfile.mkdtemp(prefix="embedsvc-test-cache-")
os.environ.setdefault("EMBEDSVC_CACHE_DIR", _CACHE)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE, ignore_errors=True)
