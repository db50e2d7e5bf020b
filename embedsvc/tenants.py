"""API keys of several tenants, each with its own quotas, from one file (KEYS_FILE).

The file is TOML, one ``[[keys]]`` table a key::

    [[keys]]
    tenant = "search"            # the name metrics and logs show (never the key)
    sha256 = "9f86d0..."         # sha256 of the key, hex; or the key itself: key = "..."
    requests_per_second = 50     # optional limits; leave one out for none
    tokens_per_minute = 600000
    inputs_in_flight = 512

    [[keys]]
    tenant = "backfill"
    key = "sk-backfill-..."
    tokens_per_minute = 2000000

It is read at start, again on SIGHUP, and when it changes (its modification time, looked at
once a second by a thread of its own, never on a request's path); it must be a regular file
of at most 1 MiB; a file that does not parse, or holds a bad entry, keeps the keys in
use and logs one line saying why. A presented key is hashed and compared with every
tenant's hash in constant time; an empty key is never one. ``API_KEY`` still works: one
more key, tenant ``default``, with no limits; a file that names a tenant ``default`` too, or
gives API_KEY's key to a tenant, is refused (at start, in one line; on a reload, the keys in
use stay), as is a file whose ``sha256`` is the hash of an empty key (what hashing an unset
variable gives) or that gives one key to two tenants.

``Quotas`` holds each tenant's usage where admission is (admission.py): a request
over its tenant's requests a second or tokens a minute (token buckets refilled at that rate,
so a burst of up to a second's or a minute's worth passes) or inputs in flight is refused
with 429 and a ``Retry-After`` that the quota itself gives, before it is tokenized, in one
process as in the engine process (a front's ``Reserve``); there, a refusal of a rate quota
says how long the quota stays spent (``QuotaExceeded.empty_s``), and the front that sent it
refuses the tenant's requests until then without asking (remote/client.py). Its usage lives in
this process, or, where several models' engine processes serve one service, in a table they
all map (tenant_usage.py), so that a tenant's limits hold across models.

>>> ring = Keyring.of([Tenant("search", digest("k1"), Limits(requests_per_second=1))])
>>> ring.authenticate("Bearer k1").name
'search'
>>> quotas = Quotas(ring)
>>> quotas.take("search", inputs=1, tokens=5, now=100.0)
>>> try:
...     quotas.take("search", inputs=1, tokens=5, now=100.1)
... except QuotaExceeded as exc:
...     print(exc.status, exc.code, exc.headers, round(exc.empty_s, 2))
429 quota_exceeded {'Retry-After': '1'} 0.9
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import stat
import sys
import threading
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .errors import QuotaExceeded, Unauthorized

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

log = logging.getLogger(__name__)

_CHECK_S = 1.0  # how often the file's modification time is looked at
MAX_KEYS_BYTES = 1 << 20  # a keys file's size at most: about 5,000 keys with their limits
_LIMITS = ("requests_per_second", "tokens_per_minute", "inputs_in_flight")
DEFAULT_TENANT = "default"  # the tenant of API_KEY


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


_EMPTY = digest("")  # what `printf %s "$KEY" | sha256sum` gives with KEY unset


@dataclass(frozen=True)
class Limits:
    requests_per_second: float | None = None
    tokens_per_minute: float | None = None
    inputs_in_flight: int | None = None


@dataclass(frozen=True)
class Tenant:
    name: str
    key_digest: bytes = field(repr=False)
    limits: Limits = Limits()


class KeysFileError(ValueError):
    """The keys file does not parse or holds a bad entry; the message says where."""


def read_keys_file(path: str | os.PathLike[str]) -> str:
    """The text of the keys file at ``path``: a regular file of at most ``MAX_KEYS_BYTES``
    (KeysFileError otherwise). Opened without blocking, so that a FIFO or a device put
    there (a symlink to /dev/zero) is refused at once instead of read without end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise KeysFileError("not a regular file")
        chunks, size = [], 0
        while chunk := os.read(fd, MAX_KEYS_BYTES + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_KEYS_BYTES:
                raise KeysFileError(f"larger than {MAX_KEYS_BYTES} bytes")
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KeysFileError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def parse_keys(text: str) -> list[Tenant]:
    """The tenants of a keys file's text; KeysFileError for anything wrong in it."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KeysFileError(f"not TOML: {exc}") from None
    entries = data.get("keys")
    if not isinstance(entries, list) or not entries:
        raise KeysFileError("no [[keys]] entries")
    tenants: list[Tenant] = []
    for i, entry in enumerate(entries):
        tenants.append(_tenant(i, entry))
        _refuse_clashes(tenants, f"entry {i + 1}")
    return tenants


def with_api_key(tenants: list[Tenant], api_key: Tenant | str | None) -> list[Tenant]:
    """API_KEY is one more tenant beside the file's; KeysFileError where they clash."""
    if not api_key:
        return tenants
    if isinstance(api_key, str):
        api_key = Tenant(DEFAULT_TENANT, digest(api_key))
    tenants = [*tenants, api_key]
    _refuse_clashes(tenants, f"API_KEY (tenant {DEFAULT_TENANT!r})")
    return tenants


def _refuse_clashes(tenants: list[Tenant], where: str) -> None:
    """The last of ``tenants`` against the ones before it: a name or a key given twice makes
    who is asking ambiguous, so the whole file is refused."""
    new = tenants[-1]
    for old in tenants[:-1]:
        if old.name == new.name:
            raise KeysFileError(f"{where}: tenant {new.name!r} twice")
        if hmac.compare_digest(old.key_digest, new.key_digest):
            raise KeysFileError(f"{where} ({new.name}): the same key as tenant {old.name!r}")


def _tenant(i: int, entry: object) -> Tenant:
    where = f"entry {i + 1}"
    if not isinstance(entry, dict):
        raise KeysFileError(f"{where} is not a table")
    unknown = set(entry) - {"tenant", "key", "sha256", *_LIMITS}
    if unknown:
        raise KeysFileError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    name = entry.get("tenant")
    if not isinstance(name, str) or not name or not name.isprintable():
        raise KeysFileError(f"{where}: 'tenant' must be a name")
    if ("key" in entry) == ("sha256" in entry):
        raise KeysFileError(f"{where} ({name}): give 'key' or 'sha256', one of them")
    if "key" in entry:
        key = entry["key"]
        if not isinstance(key, str) or not key or not all("!" <= c <= "~" for c in key):
            raise KeysFileError(f"{where} ({name}): a key is printable ASCII without spaces")
        found = digest(key)
    else:
        try:
            found = bytes.fromhex(str(entry["sha256"]))
        except ValueError:
            found = b""
        if len(found) != 32:
            raise KeysFileError(f"{where} ({name}): 'sha256' is 64 hex digits")
        if hmac.compare_digest(found, _EMPTY):
            raise KeysFileError(
                f"{where} ({name}): 'sha256' is the hash of an empty key (was the key's "
                "variable unset when it was hashed?); hash the key itself")
    limits: dict[str, Any] = {}
    for limit in _LIMITS:
        value = entry.get(limit)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not 0 < value < 1e12):
            raise KeysFileError(f"{where} ({name}): {limit!r} is a number above 0")
        limits[limit] = value
    return Tenant(name, found, Limits(**limits))


class Keyring:
    """The keys in use: who a presented key belongs to; reloaded when its file changes."""

    def __init__(self, path: str | None = None, api_key: str | None = None) -> None:
        self.path = Path(path) if path else None
        self._api_key = Tenant(DEFAULT_TENANT, digest(api_key)) if api_key else None
        self._tenants: tuple[Tenant, ...] = ()
        self._by_name: dict[str, Tenant] = {}
        self._stamp: tuple[int, int] | None = None
        self._lock = threading.Lock()
        if self.path is not None:
            self._install(parse_keys(read_keys_file(self.path)))
            self._stamp = self._file_stamp()
            log.info("keys file %s: %d tenants (%s)", self.path, len(self._tenants),
                     ", ".join(self.names))
        else:
            self._install([])

    @classmethod
    def of(cls, tenants: Iterable[Tenant]) -> Keyring:
        ring = cls()
        ring._install(list(tenants))
        return ring

    @property
    def required(self) -> bool:
        """Whether a request must present a key."""
        return bool(self._tenants)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._tenants]

    def tenant(self, name: str | None) -> Tenant | None:
        return self._by_name.get(name) if name else None

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of ``Authorization: Bearer <key>`` (None when no key is required);
        401 for a missing or unknown key. Every tenant's hash is compared, in constant time,
        so the time taken says nothing of which key came near."""
        tenants = self._tenants
        if not tenants:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        presented = digest(token)
        found = None
        for tenant in tenants:
            if hmac.compare_digest(presented, tenant.key_digest):
                found = tenant
        if scheme.lower() != "bearer" or not token or found is None:
            raise Unauthorized("missing or wrong API key; send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
        return found

    def reload(self, why: str = "SIGHUP") -> bool:
        """Read the file again; keep the keys in use (one log line) if it is wrong."""
        if self.path is None:
            return False
        try:
            tenants = parse_keys(read_keys_file(self.path))
            with_api_key(tenants, self._api_key)
        except (OSError, KeysFileError) as exc:
            log.error("keys file %s not reloaded (%s): %s; the %d keys in use stay", self.path,
                      why, exc, len(self._tenants) - (self._api_key is not None))
            self._stamp = self._file_stamp()  # not again until it changes again
            return False
        before = set(self.names)
        self._install(tenants)
        self._stamp = self._file_stamp()
        after = set(self.names)
        log.info("keys file %s reloaded (%s): %d tenants; added %s; removed %s", self.path, why,
                 len(tenants), sorted(after - before) or "none", sorted(before - after) or "none")
        return True

    def _install(self, tenants: list[Tenant]) -> None:
        tenants = with_api_key(tenants, self._api_key)
        with self._lock:
            self._tenants = tuple(tenants)
            self._by_name = {t.name: t for t in tenants}

    def watch(self, stop: threading.Event) -> None:
        """Reload the file when it changes, looked at once a second in a thread of its own
        until ``stop``: never on a request's path, where a slow file would hold requests."""
        if self.path is not None:
            threading.Thread(target=self._watch, args=(stop,), name="embedsvc-keys",
                             daemon=True).start()

    def _watch(self, stop: threading.Event) -> None:
        while not stop.wait(_CHECK_S):
            if self._file_stamp() != self._stamp:
                self.reload("the file changed")

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            found = os.stat(self.path)  # type: ignore[arg-type]
        except OSError:
            return None
        return found.st_mtime_ns, found.st_size


class Usage(Protocol):
    """One tenant's usage: ``_Usage`` here, or its slot in a shared table (tenant_usage.py)."""

    requests: float  # tokens of the requests-a-second bucket
    tokens: float  # of the tokens-a-minute bucket
    updated: float
    in_flight: int
    primed: bool


class UsageTable(Protocol):
    """Where ``Quotas`` keeps the tenants' usage: ``get`` and ``add`` under ``lock``."""

    @property
    def lock(self) -> AbstractContextManager[Any]: ...

    def get(self, name: str, /) -> Usage | None: ...

    def add(self, name: str, /) -> Usage: ...


@dataclass
class _Usage:
    requests: float = 0.0
    tokens: float = 0.0
    updated: float = 0.0
    in_flight: int = 0
    primed: bool = False


class _Local(dict[str, _Usage]):
    """The tenants' usage in this process."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def add(self, name: str, /) -> _Usage:
        usage = self.get(name)
        if usage is None:
            usage = self[name] = _Usage()
        return usage


_NO_LIMITS = Limits()


class Quotas:
    """Each tenant's usage against its limits; thread-safe. ``take`` before admission,
    ``settle`` with the exact tokens, ``give_back`` as its inputs are answered. ``table``:
    where the usage lives, when not in this process alone (tenant_usage.py)."""

    def __init__(self, keyring: Keyring, table: UsageTable | None = None) -> None:
        self.keyring = keyring
        self._usage: UsageTable = _Local() if table is None else table
        self._lock = self._usage.lock

    def take(self, name: str | None, *, inputs: int, tokens: int,
             now: float | None = None) -> None:
        """Charge one request of ``inputs`` and about ``tokens``; 429 if over a limit. A
        tenant without limits is not counted: nothing to hold it to, and no lock taken."""
        tenant = self.keyring.tenant(name)
        if tenant is None or tenant.limits == _NO_LIMITS:
            return
        limits = tenant.limits
        now = time.monotonic() if now is None else now
        with self._lock:
            usage = self._refilled(tenant, now)
            if limits.requests_per_second is not None and usage.requests < 1:
                wait = (1 - usage.requests) / limits.requests_per_second
                raise _over(tenant, f"{limits.requests_per_second:g} requests a second", wait,
                            spent=True)
            if limits.tokens_per_minute is not None:
                self._refuse_unless_tokens_fit(tenant, usage, tokens)
            if limits.inputs_in_flight is not None and usage.in_flight \
                    and usage.in_flight + inputs > limits.inputs_in_flight:
                raise _over(tenant, f"{limits.inputs_in_flight} inputs in flight", 1.0,
                            spent=False)
            usage.requests -= 1
            usage.tokens -= tokens
            usage.in_flight += inputs

    @staticmethod
    def _refuse_unless_tokens_fit(tenant: Tenant, usage: Usage, tokens: int) -> None:
        """429 unless the bucket holds the request's tokens: the quota is never overdrawn by
        letting a request in, only by an estimate that fell short of the exact count. A
        request larger than the whole bucket goes in when the bucket is full, or never."""
        per_minute = tenant.limits.tokens_per_minute
        assert per_minute is not None
        need = min(tokens, per_minute)
        if usage.tokens >= need:
            return
        rate = per_minute / 60
        empty = usage.tokens <= 0  # then every request of the tenant waits, whatever its size
        refusal = _over(tenant, f"{per_minute:g} tokens a minute",
                        (need - usage.tokens) / rate + 1e-3, spent=empty)
        if empty:
            refusal.empty_s = -usage.tokens / rate + 1e-3
        raise refusal

    # settle, refund and give_back look up the usage ``take`` made before taking the lock
    # (usage is never removed): a tenant never charged (no limits) takes no lock, and no
    # tenant (no keys) costs no call, as admission calls give_back for every answer

    def settle(self, name: str | None, estimate: int, tokens: int) -> None:
        """The request's exact tokens, once tokenized, in place of its estimate."""
        usage = self._usage.get(name) if name is not None else None
        if usage is not None:
            with self._lock:
                usage.tokens -= tokens - estimate

    def refund(self, name: str | None, inputs: int, tokens: int) -> None:
        """A request charged by ``take`` and then refused or withdrawn: as if never sent."""
        usage = self._usage.get(name) if name is not None else None
        if usage is not None:
            with self._lock:
                usage.requests += 1
                usage.tokens += tokens
                usage.in_flight = max(0, usage.in_flight - inputs)

    def give_back(self, name: str | None, inputs: int) -> None:
        """Inputs answered, dropped or never queued: no longer in flight."""
        usage = self._usage.get(name) if name is not None else None
        if usage is not None:
            with self._lock:
                usage.in_flight = max(0, usage.in_flight - inputs)

    def _refilled(self, tenant: Tenant, now: float) -> Usage:
        usage = self._usage.add(tenant.name)
        limits = tenant.limits
        if not usage.primed:  # full buckets at first sight
            usage.updated, usage.primed = now, True
            usage.requests = usage.tokens = math.inf
        elapsed = max(0.0, now - usage.updated)
        # another thread or process may have refilled it at a later ``now`` than this one
        usage.updated = max(now, usage.updated)
        # a bucket without its limit stays full: charged meanwhile, it would otherwise hold a
        # debt that a reload giving the limit turns into a lockout of the tenant
        usage.requests = math.inf if limits.requests_per_second is None else min(
            _burst(limits.requests_per_second),
            usage.requests + elapsed * limits.requests_per_second)
        usage.tokens = math.inf if limits.tokens_per_minute is None else min(
            limits.tokens_per_minute, usage.tokens + elapsed * limits.tokens_per_minute / 60)
        return usage


def _burst(per_second: float | None) -> float:
    """A requests-a-second bucket holds a second's worth, and at least one request."""
    return max(1.0, per_second or 0.0)


def _over(tenant: Tenant, what: str, wait_s: float, *, spent: bool) -> QuotaExceeded:
    return QuotaExceeded(f"tenant {tenant.name!r} is over its quota of {what}; retry after "
                         "the time in Retry-After", wait_s=wait_s, spent=spent)
