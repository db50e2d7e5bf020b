import os
import shutil
import tempfile

# Never reach a model hub: the bundled model loads from site-packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# ONNX graphs exported during the run go to a directory of the run, removed at its end: the
# suite neither reads a user's cache nor leaves one behind. Servers the tests start inherit it.
_CACHE = tempfile.mkdtemp(prefix="embedsvc-test-cache-")
os.environ.setdefault("EMBEDSVC_CACHE_DIR", _CACHE)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE, ignore_errors=True)
