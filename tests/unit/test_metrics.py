import math
import os
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from embedsvc.metrics import (
    BulkHistogram,
    Metrics,
    Snapshots,
    check_families,
    thread_waiting_seconds,
)


def samples(registry: CollectorRegistry, name: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() if family.name == name
            for s in family.samples if not s.name.endswith("_created")}


def test_bulk_histogram_exposes_what_prometheus_client_would():
    values = [0.0, 0.5, 1.0, 1.0001, 7.5, 16.0, 17.0, 1e9, 3.0]
    buckets = (1.0, 2.0, 16.0, math.inf)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    bulk = BulkHistogram("demo_seconds", "demo", buckets=buckets, registry=ours)
    reference = Histogram("demo_seconds", "demo", buckets=buckets, registry=theirs)
    bulk.observe_many(values[:5])
    for v in values[5:]:
        bulk.observe(v)
    for v in values:
        reference.observe(v)
    assert samples(ours, "demo_seconds") == samples(theirs, "demo_seconds")
    assert b'demo_seconds_bucket{le="+Inf"} 9.0' in generate_latest(ours)


def _counter(value: float) -> list:
    return [("demo_requests", "counter", "demo", [("demo_requests_total", {}, value)])]


def _total(merged: list) -> float:
    return sum(v for name, _, _, samples in merged for n, _, v in samples
               if n == "demo_requests_total")


def test_a_front_snapshot_older_than_the_kept_one_is_not_kept():
    """A front's periodic snapshot and its scrape's travel on different sockets: the older
    one arriving last took the front's counts back (14, 21, 14 over three scrapes)."""
    kept = Snapshots()
    kept.keep(11, origin=1, seq=5, snapshot=_counter(21))
    kept.keep(11, origin=1, seq=4, snapshot=_counter(14))
    assert _total(kept.merged([], live=[11])) == 21
    kept.keep(11, origin=1, seq=6, snapshot=_counter(22))
    assert _total(kept.merged([], live=[11])) == 22


def test_a_gone_front_keeps_its_counts_and_a_reused_pid_adds_to_them():
    kept = Snapshots()
    kept.keep(11, origin=1, seq=9, snapshot=_counter(7))
    kept.keep(11, origin=2, seq=1, snapshot=_counter(1))  # another process, the same pid
    kept.keep(12, origin=3, seq=1, snapshot=_counter(5))
    assert _total(kept.merged(_counter(100), live=[11])) == 113


@pytest.mark.parametrize("family", [
    ("demo", "bogus", "h", []),
    ("demo requests", "counter", "h", []),
    ("demo", "counter", "h", [("other_total", {}, 1.0)]),
    ("demo", "counter", "h", [("demo_total", {"bad-label": "x"}, 1.0)]),
    ("demo", "counter", "h", [("demo_total", {"__name__": "x"}, 1.0)]),
    ("demo", "gauge", "h", [("demo", {}, math.nan)]),
    ("demo", "gauge", "h", [("demo", {}, math.inf)]),
])
def test_a_family_a_scrape_could_not_render_is_refused(family):
    with pytest.raises(ValueError):
        check_families([family])


def test_the_service_own_families_pass_the_check(registry):
    metrics = Metrics(registry)
    metrics.count_request("/embed", 200, 0.01)
    metrics.model_info.info({"model": "m"})
    origin, seq, found = metrics.snapshot(123)
    check_families(found)
    assert metrics.snapshot(123)[:2] == (origin, seq + 1)


def test_a_threads_wait_for_a_cpu_is_what_its_schedstat_says():
    """Three busy processes on one CPU: each runs a third of the time and waits the rest,
    so their waits add up to about twice the time spent, where their run times add up to
    at most the time spent (the field read is the wait, not the run time)."""
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin) for _ in range(3)]
    try:
        cpu = min(os.sched_getaffinity(0))
        for p in procs:
            os.sched_setaffinity(p.pid, {cpu})
        time.sleep(0.2)
        before = [thread_waiting_seconds(p.pid, p.pid) for p in procs]
        started = time.monotonic()
        time.sleep(1.0)
        after = [thread_waiting_seconds(p.pid, p.pid) for p in procs]
        spent = time.monotonic() - started
    finally:
        for p in procs:
            p.kill()
            p.wait()
    waited = sum(a - b for a, b in zip(after, before, strict=True))  # type: ignore[operator]
    assert waited > 1.4 * spent, (waited, spent)
    assert thread_waiting_seconds(procs[0].pid, procs[0].pid) is None  # gone: no such thread
