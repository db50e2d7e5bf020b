"""Tenants' usage in one file that every engine process of a service maps, so that a
tenant's quotas (tenants.py ``Quotas``) hold for the service, not once per model.

With several models under ``embedsvc serve --workers N`` or ``gunicorn -w N``, each model has
an engine process of its own, and each charges the tenants' quotas as requests arrive. They
share this table, a file in the run's private directory (serving/children.py): the rate
buckets (requests a second, tokens a minute, when they were last refilled) are one per
tenant for the whole service; inputs in flight are counted by each engine in a column of its
own and summed, so that an engine that dies leaves none counted forever: its successor
clears its column as it starts. ``time.monotonic`` is the system's clock on Linux, the same
in every process, so a refill time one engine writes means the same to another.

The file: a header, then ``SLOTS`` slots of 8-byte words, a tenant's found by open addressing
(linear probing) from a 64-bit hash of its name. A keys file holds about 5,000 keys (1 MiB),
so the table stays under a third full; past ``SLOTS`` tenants seen in one run, a tenant is
counted by each engine alone (one log line). Slots are never freed: a tenant removed from
the keys file keeps its slot until the run ends. Processes exclude one another with
``flock`` on the file, the threads of one process with a lock (``flock`` does not exclude
threads that share one open file).

>>> import tempfile
>>> path = Path(tempfile.mkdtemp()) / "quotas"
>>> first, second = UsageTable.open(path, 0, 2), UsageTable.open(path, 1, 2)
>>> with first.lock:
...     first.add("search").in_flight += 3
>>> with second.lock:
...     usage = second.add("search"); usage.in_flight += 2; usage.in_flight
5
>>> successor = UsageTable.open(path, 1, 2)  # the second engine's: its column cleared
>>> with first.lock:
...     first.get("search").in_flight
3
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import stat
import threading
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

SLOTS = 1 << 14  # a power of two: a hash's low bits are its first slot
_MAGIC = int.from_bytes(b"EMBQUOT1", "little")
_HEADER = 8  # words: magic, slots, columns, then room
# a slot's words: the name's hash (0: free), the two buckets, their refill time, primed,
# then one count of inputs in flight per column (each engine's own)
_KEY, _REQUESTS, _TOKENS, _UPDATED, _PRIMED, _FLIGHT = range(6)


class _FileLock:
    """This process's threads, then the other processes, one at a time."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._threads = threading.Lock()

    def __enter__(self) -> None:
        self._threads.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._threads.release()
            raise

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._threads.release()


class _Float:
    """A float word of a slot."""

    def __init__(self, word: int) -> None:
        self.word = word

    def __get__(self, slot: Slot, owner: type[Slot]) -> float:
        return slot.floats[slot.at + self.word]

    def __set__(self, slot: Slot, value: float) -> None:
        slot.floats[slot.at + self.word] = value


class Slot:
    """One tenant's usage, read and written in place (under the table's lock): the fields of
    tenants.py's ``_Usage``. ``in_flight`` is every column's sum; setting it moves this
    engine's own column by the difference (never below 0)."""

    __slots__ = ("floats", "ints", "at", "own", "columns")
    requests = _Float(_REQUESTS)
    tokens = _Float(_TOKENS)
    updated = _Float(_UPDATED)

    def __init__(self, floats: memoryview[float], ints: memoryview[int], at: int, column: int,
                 columns: int) -> None:
        self.floats, self.ints, self.at = floats, ints, at
        self.own, self.columns = at + _FLIGHT + column, columns

    @property
    def primed(self) -> bool:
        return bool(self.ints[self.at + _PRIMED])

    @primed.setter
    def primed(self, value: bool) -> None:
        self.ints[self.at + _PRIMED] = int(value)

    @property
    def in_flight(self) -> int:
        first = self.at + _FLIGHT
        return sum(self.ints[first:first + self.columns])

    @in_flight.setter
    def in_flight(self, total: int) -> None:
        others = self.in_flight - self.ints[self.own]
        self.ints[self.own] = max(0, total - others)


def _words(columns: int) -> int:
    return _FLIGHT + columns


class UsageTable:
    """The tenants' usage of every engine of one service, in the file at ``path``; this
    engine's inputs in flight in ``column`` of ``columns`` (one per model). ``get`` and
    ``add`` under ``lock``, as tenants.py's ``Quotas`` calls them."""

    def __init__(self, fd: int, mapped: mmap.mmap, column: int, columns: int) -> None:
        self.lock = _FileLock(fd)
        self.column, self.columns = column, columns
        self._fd, self._mapped = fd, mapped
        view = memoryview(mapped)
        self._floats, self._ints = view.cast("d"), view.cast("q")
        self._found: dict[str, Slot] = {}  # this process's tenants: no probing on their path
        self._full_logged = False

    @classmethod
    def open(cls, path: Path, column: int, columns: int) -> UsageTable:
        """Map the file (made, mode 0600, by the first engine to come; replaced when it is
        another shape, see ``_shaped``), then clear this engine's column: whatever its
        predecessor counted was answered or lost."""
        if not 0 <= column < columns:
            raise ValueError(f"column {column} is not one of {columns}")
        size = (_HEADER + SLOTS * _words(columns)) * 8
        fd = _shaped(path, size, columns)
        try:
            table = cls(fd, mmap.mmap(fd, size), column, columns)
        except BaseException:
            os.close(fd)
            raise
        table._clear_column()
        return table

    def get(self, name: str, /) -> Slot | None:
        """The usage this process charged ``name`` (``add`` gave it); None if it charged
        none: refunds and inputs answered concern only what it charged."""
        return self._found.get(name)

    def add(self, name: str, /) -> Slot:
        """``name``'s slot, claimed if it has none yet."""
        slot = self._found.get(name)
        if slot is None:
            slot = self._found[name] = self._claim(name)
        return slot

    def _claim(self, name: str) -> Slot:
        key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
        key = key >> 1 or 1  # a signed word holds it; 0 marks a free slot
        words = _words(self.columns)
        first = key & (SLOTS - 1)
        for probe in range(SLOTS):
            at = _HEADER + (first + probe) % SLOTS * words
            held = self._ints[at + _KEY]
            if held == 0:
                self._ints[at + _KEY] = key
            if held in (0, key):
                return Slot(self._floats, self._ints, at, self.column, self.columns)
        if not self._full_logged:
            self._full_logged = True
            log.warning("the tenants' usage table holds %d tenants, its most: a tenant "
                        "first seen now is counted by each model's engine alone", SLOTS)
        own = memoryview(bytearray(words * 8))
        return Slot(own.cast("d"), own.cast("q"), 0, 0, 1)

    def _clear_column(self) -> None:
        words = _words(self.columns)
        with self.lock:
            for at in range(_HEADER, _HEADER + SLOTS * words, words):
                if self._ints[at + _KEY]:
                    self._ints[at + _FLIGHT + self.column] = 0


def _shaped(path: Path, size: int, columns: int) -> int:
    """The file at ``path`` open, ``size`` bytes with a header for ``columns``. One of another
    shape is replaced by a new file, never cut in place: it is left over from a run with other
    models, or mapped by this run's other engines where this one read another models list
    (MODELS_FILE changed since the launch), and a page cut from under a mapping kills its
    process (SIGBUS). Under the file's lock, so that two engines starting together make it
    once; one that waited on a file replaced meanwhile opens the new one."""
    while True:
        fd = _own_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _current(path, fd):
                header = [int.from_bytes(os.pread(fd, 24, 0)[i:i + 8], "little")
                          for i in (0, 8, 16)]
                if header == [_MAGIC, SLOTS, columns] and os.fstat(fd).st_size == size:
                    return fd
                if os.fstat(fd).st_size == 0:  # new: nobody maps it yet
                    _fill(fd, size, columns)
                    return fd
                _replace(path, size, columns)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the lock goes with it; the loop opens the file now at ``path``


def _own_file(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid():
        os.close(fd)
        raise OSError(f"{path} is not a regular file of this user's")
    return fd


def _current(path: Path, fd: int) -> bool:
    """Whether ``fd`` is still the file at ``path`` (not replaced while this one waited)."""
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _fill(fd: int, size: int, columns: int) -> None:
    os.ftruncate(fd, size)
    os.pwrite(fd, b"".join(n.to_bytes(8, "little") for n in (_MAGIC, SLOTS, columns)), 0)


def _replace(path: Path, size: int, columns: int) -> None:
    new = path.with_name(f"{path.name}.{os.getpid()}")
    fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        _fill(fd, size, columns)
    finally:
        os.close(fd)
    os.replace(new, path)
