import os
from pathlib import Path

# Never reach a model hub: the bundled model loads from site-packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# ONNX graphs that the tests and the servers they start export go to a cache inside this
# checkout's .pytest_cache (ignored by git), never a user's: kept between runs, so only the
# first run exports, and nothing is left in /tmp by a model load still running at exit.
os.environ.setdefault("EMBEDSVC_CACHE_DIR", str(Path(__file__).resolve().parents[1]
                                                / ".pytest_cache" / "embedsvc-graphs"))
