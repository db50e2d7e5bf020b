import math

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from embedsvc.metrics import BulkHistogram


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
