"""/metrics against known traffic, promtool, and the dashboard and alert rules."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).parents[2]
PROMETHEUS = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "embedsvc.json"
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: `make test` installs it (Debian package prometheus)")
    return path


def samples(client) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(client) -> set[str]:
    return {f.name for f in text_string_to_metric_families(client.get("/metrics").text)}


def grew(before, after, name, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_known_traffic_moves_the_counters_by_exactly_that_much(served_alone, reference):
    texts = [["one short text"], ["two texts here", "and the second one"], ["x"] * 5]
    inputs = sum(len(t) for t in texts)
    tokens = sum(len(reference.tokenizer(x)["input_ids"]) for t in texts for x in t)
    with served_alone.client() as c:
        before = samples(c)
        for t in texts:
            assert c.post("/v1/embeddings", json={"input": t}).status_code == 200
        assert c.post("/v1/embeddings", json={"input": []}).status_code == 400
        assert c.post("/v1/embeddings", content=b"{bad").status_code == 400
        after = samples(c)
    route = "/v1/embeddings"
    assert grew(before, after, "embedsvc_requests_total", route=route, status="200") == 3
    assert grew(before, after, "embedsvc_requests_total", route=route, status="400") == 2
    assert grew(before, after, "embedsvc_request_duration_seconds_count", route=route) == 5
    assert grew(before, after, "embedsvc_rejections_total", reason="invalid") == 2
    assert grew(before, after, "embedsvc_inputs_total") == inputs
    assert grew(before, after, "embedsvc_input_tokens_total") == tokens
    assert grew(before, after, "embedsvc_input_length_tokens_sum") == tokens
    assert grew(before, after, "embedsvc_input_length_tokens_count") == inputs
    assert grew(before, after, "embedsvc_batch_size_sum") == inputs
    assert grew(before, after, "embedsvc_queue_wait_seconds_count") == inputs
    assert grew(before, after, "embedsvc_tokenization_seconds_count") == 3
    batches = grew(before, after, "embedsvc_batch_size_count")
    assert grew(before, after, "embedsvc_inference_seconds_count") == batches >= 3
    assert grew(before, after, "embedsvc_padding_efficiency_ratio_count") == batches
    assert after[("embedsvc_batcher_alive", ())] == 1
    assert after[("embedsvc_queue_depth", ())] == 0
    info = [k for k in after if k[0] == "embedsvc_model_info"][0]
    assert dict(info[1])["model"] == "all-MiniLM-L6-v2" and dict(info[1])["dimension"] == "384"


def test_timing_headers_are_present_and_add_up(served):
    with served.client() as c:
        resp = c.post("/embed", json={"inputs": ["a b c", "d e f g"]})
    ms = {k: float(resp.headers[k]) for k in
          ("x-queue-time", "x-tokenization-time", "x-inference-time", "x-total-time")}
    assert all(v >= 0 for v in ms.values())
    assert ms["x-queue-time"] + ms["x-inference-time"] <= ms["x-total-time"] + 0.01
    assert ms["x-inference-time"] > 0
    assert int(resp.headers["x-compute-tokens"]) == 5 + 6


def test_logs_show_startup_and_one_access_line_per_request(served):
    with served.client() as c:
        c.post("/embed", json={"inputs": ["log me please"]})
    out = served.output()
    assert re.search(r"model ready: pid=\d+ device=cpu dtype=float32 model=all-MiniLM-L6-v2", out)
    assert re.search(r"POST /embed 200 inputs=1 tokens=5 ms=\d", out)


def test_promtool_accepts_the_live_metrics(served):
    with served.client() as c:
        text = c.get("/metrics").text
    result = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_checks_and_unit_tests_the_rules():
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"],
                 ["test", "rules", "alerts_test.yml"]):
        result = subprocess.run([promtool(), *args], cwd=PROMETHEUS, capture_output=True,
                                text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def metric_names(text: str) -> set[str]:
    names = set()
    for name in re.findall(r"\b((?:embedsvc|process)_[a-z0-9_]+)", text):
        for suffix in _SUFFIXES:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
        names.add(name)
    return names


def test_every_metric_in_the_dashboard_and_rules_exists_on_a_live_server(served):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    named = metric_names("\n".join(exprs)) | metric_names((PROMETHEUS / "alerts.yml").read_text())
    with served.client() as c:
        live = families(c)
    missing = sorted(n for n in named if n not in live)
    assert not missing, f"named in deploy/ but not exported: {missing}"
    assert {"embedsvc_queue_wait_seconds", "embedsvc_batch_size", "embedsvc_device_memory_bytes",
            "embedsvc_padding_efficiency_ratio"} <= named
