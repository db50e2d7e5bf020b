"""tenants.py: keys from a file, checked in constant time, reloaded safely; quotas with exact
Retry-After; admission charges a tenant before its request is tokenized."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from embedsvc.admission import Admission
from embedsvc.errors import Overloaded, QuotaExceeded, Unauthorized
from embedsvc.metrics import Metrics
from embedsvc.tenants import (
    DEFAULT_TENANT,
    Keyring,
    KeysFileError,
    Limits,
    Quotas,
    Tenant,
    digest,
    parse_keys,
)

KEYS = """
[[keys]]
tenant = "search"
key = "sk-search"
requests_per_second = 2

[[keys]]
tenant = "backfill"
sha256 = "{sha}"
tokens_per_minute = 600
inputs_in_flight = 4
""".replace("{sha}", digest("sk-backfill").hex())


def write(path, text: str) -> None:
    path.write_text(text)
    stamp = time.time_ns() + 10**9  # a modification time that differs, however fast
    os.utime(path, ns=(stamp, stamp))


def test_a_key_or_its_hash_names_its_tenant_and_anything_else_is_401(tmp_path):
    path = tmp_path / "keys.toml"
    write(path, KEYS)
    ring = Keyring(str(path), api_key="sk-old")
    assert ring.authenticate("Bearer sk-search").name == "search"
    assert ring.authenticate("bearer sk-backfill").limits.inputs_in_flight == 4
    assert ring.authenticate("Bearer sk-old").name == DEFAULT_TENANT  # API_KEY still works
    for header in (None, "", "Bearer", "Bearer sk-searc", "Basic sk-search", "sk-search"):
        with pytest.raises(Unauthorized):
            ring.authenticate(header)
    assert Keyring().authenticate(None) is None  # no keys: nothing is required


@pytest.mark.parametrize(("text", "says"), [
    ("not toml [", "not TOML"),
    ("[[keys]]\ntenant = 'a'\n", "give 'key' or 'sha256'"),
    ("[[keys]]\ntenant = 'a'\nkey = 'has space'\n", "printable ASCII"),
    ("[[keys]]\ntenant = 'a'\nsha256 = 'abc'\n", "64 hex digits"),
    ("[[keys]]\ntenant = 'a'\nkey = 'k'\nrequests_per_second = 0\n", "above 0"),
    ("[[keys]]\ntenant = 'a'\nkey = 'k'\nrps = 1\n", "unknown field 'rps'"),
    ("[[keys]]\ntenant = 'a'\nkey = 'k'\n[[keys]]\ntenant = 'a'\nkey = 'j'\n", "twice"),
    ("", "no [[keys]]"),
    (f"[[keys]]\ntenant = 'a'\nsha256 = '{digest('').hex()}'\n", "the hash of an empty key"),
    ("[[keys]]\ntenant = 'a'\nkey = 'k'\n[[keys]]\ntenant = 'b'\n"
     f"sha256 = '{digest('k').hex()}'\n", "(b): the same key as tenant 'a'"),
])
def test_a_bad_keys_file_says_where(text, says):
    with pytest.raises(KeysFileError, match=said(says)):
        parse_keys(text)


def test_an_empty_key_is_never_a_tenants(tmp_path):
    """The hash of an empty key (`printf %s "$KEY" | sha256sum` with KEY unset) is refused in
    the file, and a ring that holds one anyway (built in code) still lets no empty key in."""
    path = tmp_path / "keys.toml"
    write(path, f"[[keys]]\ntenant = 'unset'\nsha256 = '{digest('').hex()}'\n")
    with pytest.raises(KeysFileError, match="empty key"):
        Keyring(str(path))
    ring = Keyring.of([Tenant("unset", digest(""))])
    for header in ("Bearer", "Bearer ", "bearer "):
        with pytest.raises(Unauthorized):
            ring.authenticate(header)


def test_api_key_and_a_tenant_named_default_are_refused_together(tmp_path, caplog):
    """API_KEY is tenant 'default' beside the file's: a file naming 'default' too, or giving
    API_KEY's key to a tenant, is refused at start; on a reload the keys in use stay."""
    from embedsvc.serving.preflight import PreflightError, check_keys

    path = tmp_path / "keys.toml"
    write(path, "[[keys]]\ntenant = 'default'\nkey = 'sk-file'\n")
    with pytest.raises(KeysFileError, match="tenant 'default' twice"):
        Keyring(str(path), api_key="sk-env")
    with pytest.raises(PreflightError, match="KEYS_FILE.*'default' twice") as refused:
        check_keys(str(path), "sk-env")
    assert "\n" not in str(refused.value)
    write(path, "[[keys]]\ntenant = 'ops'\nkey = 'sk-env'\n")
    with pytest.raises(KeysFileError, match="the same key as tenant 'ops'"):
        Keyring(str(path), api_key="sk-env")
    write(path, KEYS)
    ring = Keyring(str(path), api_key="sk-env")
    write(path, "[[keys]]\ntenant = 'default'\nkey = 'sk-file'\n")
    with caplog.at_level(logging.ERROR, logger="embedsvc.tenants"):
        assert not ring.reload()
    assert ring.authenticate("Bearer sk-env").name == DEFAULT_TENANT  # API_KEY stays
    assert ring.authenticate("Bearer sk-search").name == "search"
    assert "not reloaded" in caplog.text and "'default' twice" in caplog.text


def said(text: str) -> str:
    import re

    return re.escape(text)


def test_a_changed_file_is_reloaded_and_a_bad_one_keeps_the_keys(tmp_path, caplog, monkeypatch):
    from embedsvc import tenants

    monkeypatch.setattr(tenants, "_CHECK_S", 0.01)
    path = tmp_path / "keys.toml"
    write(path, KEYS)
    ring = Keyring(str(path))
    stop = threading.Event()
    ring.watch(stop)
    try:
        write(path, "[[keys]]\ntenant = 'new'\nkey = 'sk-new'\n")
        until(lambda: ring.names == ["new"])  # the watcher saw the change
        assert ring.authenticate("Bearer sk-new").name == "new"
        with pytest.raises(Unauthorized):
            ring.authenticate("Bearer sk-search")  # removed
        with caplog.at_level(logging.ERROR, logger="embedsvc.tenants"):
            write(path, "[[keys]]\ntenant = 'broken'\n")
            until(lambda: "not reloaded" in caplog.text)
            assert ring.authenticate("Bearer sk-new").name == "new"  # the keys in use stay
            assert not ring.reload()
    finally:
        stop.set()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 2 and all("not reloaded" in line for line in lines), lines
    assert all("sk-" not in line for line in caplog.text.splitlines())


def until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within 5 s"
        time.sleep(0.01)


def test_the_keys_file_is_a_bounded_regular_file_never_read_on_a_request(tmp_path, caplog):
    """A FIFO, a device (a symlink to /dev/zero) or a file past the cap is refused at start
    and on a reload (the keys in use stay), and a request never reads the file: a FIFO put
    in its place hung every request, and a symlink to /dev/zero was read without end."""
    from embedsvc import tenants

    path = tmp_path / "keys.toml"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "zero").symlink_to("/dev/zero")
    big = tmp_path / "big.toml"
    big.write_text(KEYS + "#" * tenants.MAX_KEYS_BYTES)
    for bad, says in ((fifo, "not a regular file"), (tmp_path / "zero", "not a regular file"),
                      (big, "larger than")):
        with pytest.raises(KeysFileError, match=says):
            Keyring(str(bad))
    write(path, KEYS)
    ring = Keyring(str(path))
    path.unlink()
    os.mkfifo(path)  # in place of the file, with no writer: reading it would block
    answered: list[str] = []
    request = threading.Thread(
        target=lambda: answered.append(ring.authenticate("Bearer sk-search").name), daemon=True)
    request.start()
    request.join(5)
    assert answered == ["search"], "a request read the keys file"
    with caplog.at_level(logging.ERROR, logger="embedsvc.tenants"):
        assert not ring.reload()
    assert "not a regular file" in caplog.text and ring.names == ["search", "backfill"]


def test_quotas_refuse_with_the_wait_the_quota_gives():
    ring = Keyring.of([Tenant("a", digest("k"), Limits(requests_per_second=2)),
                       Tenant("t", digest("j"), Limits(tokens_per_minute=600)),
                       Tenant("f", digest("f"), Limits(inputs_in_flight=4))])
    q = Quotas(ring)
    q.take("a", inputs=1, tokens=1, now=10.0)
    q.take("a", inputs=1, tokens=1, now=10.0)  # a second's worth: two
    with pytest.raises(Overloaded) as info:
        q.take("a", inputs=1, tokens=1, now=10.1)
    assert info.value.headers["Retry-After"] == "1" and info.value.code == "quota_exceeded"
    q.take("a", inputs=1, tokens=1, now=10.6)  # refilled at 2 a second
    q.take("t", inputs=1, tokens=900, now=0.0)  # a burst past the bucket: its debt, 300
    with pytest.raises(Overloaded) as info:
        q.take("t", inputs=1, tokens=1, now=0.0)
    assert info.value.headers["Retry-After"] == "31"  # 300 tokens at 10 a second, then 1
    q.take("f", inputs=3, tokens=1, now=0.0)
    with pytest.raises(Overloaded):
        q.take("f", inputs=2, tokens=1, now=0.0)  # 5 in flight > 4
    q.give_back("f", 3)
    q.take("f", inputs=4, tokens=1, now=0.0)
    q.take(None, inputs=10**6, tokens=10**9)  # no tenant: no quota
    q.take("unknown", inputs=1, tokens=1)  # a name not in the file (removed): no quota


def test_a_token_quota_lets_a_request_in_only_when_its_tokens_fit():
    """300 tokens a minute: 200, then 160 would make 360 (as it did, the bucket being above
    zero); it waits until 160 are there, while a request that fits goes in. One larger than
    the whole bucket goes in when the bucket is full: the one overdraw, by that request."""
    q = Quotas(Keyring.of([Tenant("t", digest("k"), Limits(tokens_per_minute=300))]))
    q.take("t", inputs=1, tokens=200, now=0.0)
    with pytest.raises(QuotaExceeded) as info:
        q.take("t", inputs=1, tokens=160, now=0.0)
    assert info.value.headers["Retry-After"] == "13"  # 60 tokens short, at 5 a second
    assert info.value.empty_s == 0  # not spent: a smaller request may go in meanwhile
    q.take("t", inputs=1, tokens=100, now=0.0)  # fits: the bucket is now empty
    with pytest.raises(QuotaExceeded) as info:
        q.take("t", inputs=1, tokens=1, now=0.0)
    assert info.value.empty_s > 0  # spent: the front may refuse the tenant meanwhile
    q.take("t", inputs=1, tokens=160, now=32.0)  # 160 refilled by then
    with pytest.raises(QuotaExceeded) as info:
        q.take("t", inputs=1, tokens=1000, now=32.0)  # more than the bucket: waits for it full
    assert info.value.headers["Retry-After"] == "61"  # the whole 300, at 5 a second
    q.take("t", inputs=1, tokens=1000, now=92.0)


def test_admission_charges_the_tenant_first_and_a_refused_request_costs_it_nothing():
    ring = Keyring.of([Tenant("a", digest("k"), Limits(requests_per_second=1,
                                                       inputs_in_flight=3))])
    a = Admission(max_inputs=2, max_tokens=100, timeout_s=30, floor_inputs=2,
                  metrics=Metrics())
    a.quotas = Quotas(ring)
    later = time.monotonic() + 10
    with pytest.raises(Exception, match="at most 2"):  # 413 from admission
        a.admit(3, 3, later, tenant="a")
    ticket = a.admit(2, 10, later, tenant="a")  # the refused one did not spend the second
    with pytest.raises(Overloaded, match="quota"):
        a.admit(1, 1, later, tenant="a")
    a.settle(ticket, 12)
    a.release(2, 12, "a")
    assert a.quotas._usage["a"].in_flight == 0


def test_a_limit_a_reload_gives_starts_with_a_full_bucket():
    """A tenant charged while it had no token or request limit owes nothing when a reload
    gives it one: its first request after the reload goes in."""
    ring = Keyring.of([Tenant("t", digest("k"), Limits(inputs_in_flight=8))])
    q = Quotas(ring)
    for i in range(500):
        q.take("t", inputs=1, tokens=200, now=i * 0.01)
        q.give_back("t", 1)
    ring._install([Tenant("t", digest("k"), Limits(requests_per_second=2,
                                                   tokens_per_minute=6000))])
    q.take("t", inputs=1, tokens=10, now=10.0)
    q.take("t", inputs=1, tokens=5990, now=10.0)  # the whole minute's, and a second's two
    with pytest.raises(QuotaExceeded):
        q.take("t", inputs=1, tokens=1, now=10.0)
