"""Exported model graphs on disk, built once and shared by every process that starts.

A file (or a directory of files, such as lean.py's record) is published only after it was
built and loaded without error, under a name that says what it holds (the key). Builders
write to a unique temporary name and ``os.replace`` it into place, holding an exclusive lock
meanwhile, so that two processes starting together build it once and never read half a
file. A file that exists but fails to load (truncated, corrupt, or wrong) is rebuilt, never
served. The lock files live in the hidden ``.locks`` directory beside the graphs: deleting
a lock file after use would let a third process lock a new file while a second still waits
on the old one, so they stay, out of the way.

>>> import tempfile
>>> cache = GraphCache(Path(tempfile.mkdtemp()))
>>> build = lambda path: path.write_text("graph")
>>> text, path = cache.get_or_build(cache.path("m", "abc"), build, Path.read_text)
>>> (text, path.name)
('graph', 'm-abc.onnx')
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


def cache_root(setting: str, env: Mapping[str, str] | None = None) -> Path:
    """CACHE_DIR if set, else $XDG_CACHE_HOME/embedsvc, else ~/.cache/embedsvc."""
    if setting:
        return Path(setting).expanduser()
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "embedsvc"


class GraphCache:
    """Files under ``root``, each built at most once; see the module docstring."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, name: str, key: str, suffix: str = ".onnx") -> Path:
        return self.root / f"{_safe(name)}-{key[:24]}{suffix}"

    def named(self, name: str, suffix: str = ".onnx") -> list[Path]:
        """What ``path`` gives for ``name`` and ``suffix`` under any key, that is here."""
        pattern = re.compile(re.escape(_safe(name)) + "-[0-9a-f]{24}" + re.escape(suffix))
        return sorted(p for p in self.root.glob(f"{_safe(name)}-*{suffix}")
                      if pattern.fullmatch(p.name))

    def get_or_build(self, path: Path, build: Callable[[Path], object],
                     load: Callable[[Path], T]) -> tuple[T, Path]:
        """``load(path)`` and the path it read; if that file is missing or does not load,
        ``build`` it first.

        ``load`` raises for a file that must not be served. In a directory this process cannot
        write, a missing file is built into a private temporary directory, loaded, and
        removed with it: what ``load`` returns then must not need the file any more (the
        path returned names where it would have been published).
        """
        found = _try_load(path, load)
        if found is not None:
            return found[0], path
        failed = _identity(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(path):
                if _identity(path) not in (None, failed):  # another process published one
                    found = _try_load(path, load)
                if found is None:
                    _sweep(path)
                return (found[0] if found is not None else _publish(path, build, load)), path
        except OSError as exc:
            if exc.errno not in _READ_ONLY:
                raise
            log.warning("cannot write the cache %s (%s): building %s for this process only, "
                        "in memory (every start builds it again); run 'embedsvc export' where "
                        "it is writable, or set CACHE_DIR", path.parent, exc.strerror, path.name)
            scratch = Path(tempfile.mkdtemp(prefix="embedsvc-"))
            try:
                return _publish(scratch / path.name, build, load), path
            finally:
                shutil.rmtree(scratch, ignore_errors=True)


def _safe(name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-.")
    return safe or "model"


def _try_load(path: Path, load: Callable[[Path], T]) -> tuple[T] | None:
    if not path.exists():
        return None
    try:
        return (load(path),)
    except Exception as exc:  # noqa: BLE001 - any failure to load means: build it again
        log.warning("cached %s does not load (%s); rebuilding it", path, exc)
        return None


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _publish(path: Path, build: Callable[[Path], object], load: Callable[[Path], T]) -> T:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp{path.suffix}")
    try:
        build(tmp)
        loaded = load(tmp)  # never publish what does not load
        if tmp.is_dir():
            _discard(path)  # a directory is not replaced by a rename, as a file is
        os.replace(tmp, path)
        return loaded
    finally:
        _discard(tmp)


def _sweep(path: Path) -> None:
    """Remove what a build of ``path`` that never finished left (its process killed as it
    loaded the model: a model-sized file each time); under ``path``'s lock, which every
    build of it holds, so no temporary of it found here is still being written."""
    mine = re.compile(rf"\.{re.escape(path.stem)}\.\d+-[0-9a-f]{{8}}\.tmp"
                      + re.escape(path.suffix))
    for left in path.parent.glob(f".{path.stem}.*.tmp{path.suffix}"):
        if mine.fullmatch(left.name):
            log.info("removing %s, left by a build that did not finish", left.name)
            with suppress(OSError):
                _discard(left)


def _discard(path: Path) -> None:
    """Remove a file or a directory, if there is one; a directory is first moved aside so
    that no reader finds it half removed."""
    if path.is_dir() and not path.is_symlink():
        aside = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.old")
        os.replace(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    locks = path.parent / ".locks"
    locks.mkdir(exist_ok=True)
    with open(locks / (path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
