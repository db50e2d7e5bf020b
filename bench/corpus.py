"""Real English passages that every machine with the same Python has, for retrieval checks.

Two sources, both shipped with the Python interpreter itself, so the corpus is the same on
every machine with the same Python version (no package, download or OS file involved):

- ``pydoc_data.topics``: the Language Reference's help topics (``help("if")`` and so on);
- the docstrings of the standard library's modules, classes and functions, read with ``ast``
  from its source files (nothing imported), tests and site-packages left out.

Each is split into paragraphs, whitespace folded; a passage is a paragraph of 80-800
characters that is prose (letters and spaces at least 85% of it, no ``>>>`` example).
Passages are deduplicated and sorted, and a sample is drawn with a fixed seed.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from pydoc_data.topics import topics

_LEFT_OUT = {"test", "tests", "site-packages", "idlelib", "lib2to3", "__pycache__"}


def passages(count: int | None = None, *, stdlib: bool = True, seed: int = 0) -> list[str]:
    """``count`` passages (all when None), a seeded sample of the sorted set; the help
    topics alone when ``stdlib`` is False (fewer, but read in milliseconds)."""
    found = set(_prose(topics.values()))
    if stdlib:
        found.update(_prose(_docstrings()))
    ordered = sorted(found)
    if count is None or count >= len(ordered):
        return ordered
    return random.Random(seed).sample(ordered, count)


def _prose(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            letters = sum(c.isalpha() or c == " " for c in para)
            if 80 <= len(para) <= 800 and letters >= 0.85 * len(para) and ">>>" not in para:
                yield para


def _docstrings() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not _LEFT_OUT & set(p.relative_to(root).parts))
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for path in files:
        try:
            tree = ast.parse(path.read_text("utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a file of another Python version's syntax, or not UTF-8
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, kinds) else None
            if doc:
                yield doc
