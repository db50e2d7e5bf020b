"""tenant_usage.py: the tenants' usage in one file that every model's engine maps; a
tenant's quotas drawn from one bucket by several processes, exactly, and a dead engine's
inputs in flight cleared by its successor."""

from __future__ import annotations

import logging
import multiprocessing
import stat
import threading
from pathlib import Path

import pytest

from embedsvc import tenant_usage
from embedsvc.errors import QuotaExceeded
from embedsvc.tenant_usage import UsageTable
from embedsvc.tenants import Keyring, Limits, Quotas, Tenant, digest

RING = [Tenant("rate", digest("k1"), Limits(requests_per_second=2)),
        Tenant("tokens", digest("k2"), Limits(tokens_per_minute=600)),
        Tenant("flight", digest("k3"), Limits(inputs_in_flight=4)),
        Tenant("many", digest("k4"), Limits(requests_per_second=10_000))]
TAKES = 2000


def quotas(path: Path, column: int, columns: int) -> Quotas:
    """What one model's engine builds (serving/children.py): its own mapping of the file."""
    return Quotas(Keyring.of(RING), UsageTable.open(path, column, columns))


def refused(q: Quotas, name: str, inputs: int = 1, tokens: int = 1, now: float = 0.0) -> bool:
    try:
        q.take(name, inputs=inputs, tokens=tokens, now=now)
    except QuotaExceeded:
        return True
    return False


def test_two_engines_draw_from_one_bucket_of_each_quota(tmp_path):
    path = tmp_path / "quotas"
    first, second = quotas(path, 0, 2), quotas(path, 1, 2)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first.take("rate", inputs=1, tokens=1, now=10.0)
    second.take("rate", inputs=1, tokens=1, now=10.0)  # a second's worth: two, in all
    assert refused(first, "rate", now=10.1) and refused(second, "rate", now=10.1)
    assert not refused(second, "rate", now=10.6)  # refilled at two a second, once
    assert refused(first, "rate", now=10.6)
    first.take("tokens", inputs=1, tokens=400, now=0.0)
    assert refused(second, "tokens", tokens=300)  # 200 left of the minute's 600
    second.take("tokens", inputs=1, tokens=200, now=0.0)
    first.take("flight", inputs=3, tokens=1)
    assert refused(second, "flight", inputs=2)  # 5 in flight > 4
    first.give_back("flight", 3)
    second.take("flight", inputs=4, tokens=1)
    assert refused(first, "flight", inputs=1)


def _draw(path: str, column: int, columns: int, ready, go) -> None:
    q = quotas(Path(path), column, columns)
    ready.set()
    go.wait(30)
    _takes(q)


def _takes(q: Quotas) -> None:
    for _ in range(TAKES):  # at one instant: no refill
        q.take("many", inputs=1, tokens=1, now=1000.0)


def test_threads_and_a_second_process_together_draw_exactly(tmp_path):
    """Two engines' mappings in this process (threads) and one in another process take at
    the same time, 3 x 2,000 requests of a bucket of 10,000: none is lost, the bucket holds
    exactly 4,000, and the columns of inputs in flight add up to 6,000."""
    path = tmp_path / "quotas"
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_draw, args=(str(path), 2, 3, ready, go))
    mine = [quotas(path, 0, 3), quotas(path, 1, 3)]
    other.start()
    threads = [threading.Thread(target=lambda q=q: (go.wait(30), _takes(q))) for q in mine]
    for t in threads:
        t.start()
    assert ready.wait(60)
    go.set()
    for t in threads:
        t.join(60)
    other.join(60)
    assert other.exitcode == 0
    usage = mine[0]._usage.get("many")
    assert (usage.requests, usage.in_flight) == (10_000 - 3 * TAKES, 3 * TAKES)


def _take_and_die(path: str) -> None:
    quotas(Path(path), 1, 2).take("flight", inputs=3, tokens=1)  # never given back


def test_a_dead_engines_inputs_in_flight_are_cleared_by_its_successor(tmp_path):
    path = tmp_path / "quotas"
    first = quotas(path, 0, 2)
    for _ in range(2):  # its burst spent
        first.take("rate", inputs=1, tokens=1, now=5.0)
    dead = multiprocessing.get_context("spawn").Process(target=_take_and_die,
                                                        args=(str(path),))
    dead.start()
    dead.join(60)
    assert dead.exitcode == 0
    assert refused(first, "flight", inputs=2)  # the dead engine's 3 still count
    quotas(path, 1, 2)  # its successor starts: its column cleared
    first.take("flight", inputs=2, tokens=1)
    assert refused(first, "rate", now=5.0)  # the buckets are not the column's: kept


def test_a_file_of_another_shape_is_made_anew(tmp_path):
    path = tmp_path / "quotas"
    quotas(path, 0, 2).take("flight", inputs=4, tokens=1)
    again = quotas(path, 0, 3)  # a run with three models, where two were left
    again.take("flight", inputs=4, tokens=1)
    assert path.stat().st_size == (8 + tenant_usage.SLOTS * 8) * 8


def test_a_full_table_counts_a_new_tenant_in_each_engine_alone(tmp_path, monkeypatch,
                                                             caplog):
    monkeypatch.setattr(tenant_usage, "SLOTS", 2)
    path = tmp_path / "quotas"
    first, second = quotas(path, 0, 2), quotas(path, 1, 2)
    first.take("rate", inputs=1, tokens=1, now=0.0)
    first.take("tokens", inputs=1, tokens=1, now=0.0)
    with caplog.at_level(logging.WARNING, logger="embedsvc.tenant_usage"):
        first.take("flight", inputs=4, tokens=1)
        second.take("flight", inputs=4, tokens=1)  # its own count: not refused
    assert "holds 2 tenants, its most" in caplog.text
    assert refused(first, "flight") and refused(second, "flight")
    second.take("rate", inputs=1, tokens=1, now=0.0)
    assert refused(first, "rate", now=0.0)  # the tenants that have a slot still share it


def test_the_file_is_never_followed_through_a_symlink(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    (tmp_path / "quotas").symlink_to(target)
    with pytest.raises(OSError):
        UsageTable.open(tmp_path / "quotas", 0, 2)
    assert target.read_bytes() == b""


def test_a_tenant_without_limits_takes_no_slot_and_no_lock(tmp_path):
    ring = Keyring.of([*RING, Tenant("free", digest("k5"))])
    table = UsageTable.open(tmp_path / "quotas", 0, 2)
    q = Quotas(ring, table)
    q.take("free", inputs=10**6, tokens=10**9)
    q.settle("free", 10**9, 10**9 + 1)
    q.give_back("free", 10**6)
    assert table.get("free") is None and table._found == {}


TWO_COLUMNS_BYTES = (8 + tenant_usage.SLOTS * 7) * 8  # the header, then 5 words and 2 a slot


def _touch_far_slot(path: str, ready, go, done) -> None:
    """An engine of a run of three models, charging a tenant whose slot lies past where a
    table of two columns ends."""
    table = UsageTable.open(Path(path), 1, 3)
    name = next(f"t{i}" for i in range(10_000)
                if table.add(f"t{i}").at * 8 >= TWO_COLUMNS_BYTES)
    ready.set()
    go.wait(60)
    with table.lock:
        table.add(name).in_flight += 1
    done.set()


def test_a_file_of_another_shape_is_replaced_not_cut_from_under_an_engine(tmp_path):
    """A successor engine that reads another models list (MODELS_FILE edited since the
    launch) makes a table of its own shape; the engines that map the old one keep it, where
    cutting it in place killed them with SIGBUS on their next request."""
    path = tmp_path / "quotas"
    spawn = multiprocessing.get_context("spawn")
    ready, go, done = spawn.Event(), spawn.Event(), spawn.Event()
    other = spawn.Process(target=_touch_far_slot, args=(str(path), ready, go, done))
    other.start()
    assert ready.wait(60)
    quotas(path, 0, 2).take("flight", inputs=4, tokens=1)  # the successor, of two models
    go.set()
    other.join(60)
    assert other.exitcode == 0 and done.is_set()
    assert path.stat().st_size == TWO_COLUMNS_BYTES
    assert [p.name for p in tmp_path.iterdir()] == ["quotas"]
